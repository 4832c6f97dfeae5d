"""Tools through the model's own chat template: a template that renders tools, tool calls and
tool messages gets them (rendered as transformers renders them); what a template does not render
is written in the Hermes format instead."""

from __future__ import annotations

import json
import shutil

import pytest

from deployer.agent.chat import ChatTemplate, tool_call_text, tools_prompt
from deployer.agent.types import ChatMessage, ToolCall

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
CONVERSATION = [
    ChatMessage("user", "Weather in Paris?"),
    ChatMessage("assistant", "", tool_calls=(CALL,)),
    ChatMessage("tool", '{"temperature_c": 21}', tool_call_id="call_1"),
]
# A Hermes-style template in the manner of Qwen2.5's: tools in the system turn, calls as
# <tool_call> JSON with `tojson` arguments, results in <tool_response>.
NATIVE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
STRICT_ROLES = (
    "{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m.role) }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


def _with_template(src, dest, template):
    shutil.copytree(src, dest)
    config = json.loads((dest / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


def test_a_template_without_tools_gets_them_as_hermes_text(tiny_model_dir):
    template = ChatTemplate.from_dir(tiny_model_dir)  # plain ChatML: no tools, no tool_calls
    caps = template.capabilities
    assert (caps.tools, caps.tool_calls, caps.tool_role) == (False, False, True)
    text = template.render(CONVERSATION, tools=TOOLS)
    assert text.startswith("<|im_start|>system\n" + tools_prompt(TOOLS))
    assert f"<|im_start|>assistant\n{tool_call_text(CALL)}<|im_end|>" in text
    assert '<|im_start|>tool\n{"temperature_c": 21}<|im_end|>' in text


def test_a_system_message_keeps_its_text_before_the_tools(tiny_model_dir):
    text = ChatTemplate.from_dir(tiny_model_dir).render(
        [ChatMessage("system", "Be brief."), *CONVERSATION], tools=TOOLS
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n" + tools_prompt(TOOLS))
    assert text.count("<|im_start|>system") == 1


def test_a_native_template_renders_as_transformers_does(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    directory = _with_template(tiny_model_dir, tmp_path / "m", NATIVE)
    template = ChatTemplate.from_dir(directory)
    assert template.capabilities.tools and template.capabilities.tool_calls
    hf_messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": '{"temperature_c": 21}', "tool_call_id": "call_1"},
    ]
    hf = AutoTokenizer.from_pretrained(directory)
    expected = hf.apply_chat_template(hf_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert template.render(CONVERSATION, tools=TOOLS) == expected


def test_a_template_that_refuses_the_tool_role_gets_the_result_as_a_user_turn(tiny_model_dir, tmp_path):
    template = ChatTemplate.from_dir(_with_template(tiny_model_dir, tmp_path / "m", STRICT_ROLES))
    assert not template.capabilities.tool_role
    text = template.render(CONVERSATION, tools=TOOLS)
    assert '<|im_start|>user\n<tool_response>\n{"temperature_c": 21}\n</tool_response><|im_end|>' in text


@pytest.mark.parametrize("tools", [None, []])
def test_no_tools_renders_as_before(tiny_model_dir, tools):
    template = ChatTemplate.from_dir(tiny_model_dir)
    assert template.render(CONVERSATION[:1], tools=tools) == template.render(CONVERSATION[:1])
    assert "<tools>" not in template.render(CONVERSATION[:1], tools=tools)
