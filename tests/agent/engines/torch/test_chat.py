"""Chat formatting without transformers equals transformers' apply_chat_template."""

from __future__ import annotations

import json
import shutil

import pytest

from deployer.agent.chat import ChatTemplate, TextCodec
from deployer.agent.types import ChatMessage
from deployer.errors import AgentError

CONVERSATIONS = [
    [ChatMessage("user", "What is the capital of France?")],
    [
        ChatMessage("system", "You answer in one word."),
        ChatMessage("user", "Capital of Italy?"),
        ChatMessage("assistant", "Rome"),
        ChatMessage("user", "And of Spain? 🇪🇸 café"),
    ],
]


def _assert_same_as_transformers(directory):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(directory)
    template, codec = ChatTemplate.from_dir(directory), TextCodec.from_dir(directory)
    for messages in CONVERSATIONS:
        plain = [{"role": m.role, "content": m.content} for m in messages]
        text = template.render(messages)
        assert text == hf.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
        want_ids = hf.apply_chat_template(plain, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert codec.encode(text, add_special_tokens=False) == list(want_ids)


def test_tiny_chat_template_matches_transformers(tiny_model_dir):
    _assert_same_as_transformers(tiny_model_dir)


@pytest.mark.slow
def test_smollm2_chat_template_matches_transformers(smollm2_dir):
    _assert_same_as_transformers(smollm2_dir)


def _with_template(src, dest, template):
    shutil.copytree(src, dest)
    config = json.loads((dest / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


def test_template_sees_special_tokens_and_hf_helpers(tiny_model_dir, tmp_path):
    template = (
        "{{ bos_token }}{% for m in messages %}{% generation %}{{ m.content | tojson }}"
        "{% endgeneration %}{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}{{ eos_token }}"
    )
    directory = _with_template(tiny_model_dir, tmp_path / "m", template)
    text = ChatTemplate.from_dir(directory).render([ChatMessage("user", "a<b")])
    assert text == '<|im_start|>"a<b"<|im_end|>'


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ raise_exception('only user and assistant roles') }}", "only user and assistant roles"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "rejected the messages"),
        ("{% for %}", "does not compile"),
    ],
)
def test_template_errors_and_sandbox_escapes_become_agent_errors(template, message, tiny_model_dir, tmp_path):
    directory = _with_template(tiny_model_dir, tmp_path / "m", template)
    with pytest.raises(AgentError, match=message):
        ChatTemplate.from_dir(directory).render([ChatMessage("user", "hi")])


def test_model_without_template_has_none(tiny_model_dir, tmp_path):
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.from_dir(tmp_path / "m") is None
