"""Request parsing: what OpenAI clients send is accepted (unknown fields ignored and reported),
what cannot be honoured is refused by name."""

import pytest

from deployer.agent.openai.schemas import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    ignored_fields,
    parse_request,
)
from deployer.agent.types import ChatMessage


def _chat(**extra):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def test_chat_request_maps_to_sampling_params():
    request = parse_request(
        ChatCompletionRequest,
        _chat(
            max_tokens=7,
            temperature=0.5,
            top_p=0.9,
            stop=["\n", ""],
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
            presence_penalty=0.5,
            frequency_penalty=-1,
            logit_bias={"12": -100, "3": 5},
            logprobs=True,
            top_logprobs=4,
        ),
    )
    params = request.sampling(request.requested_max_tokens(), "grammar")
    assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (7, 0.5, 0.9, 3)
    assert params.stop == ("\n",)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -1)
    assert params.logit_bias == ((3, 5.0), (12, -100.0))
    assert (params.logprobs, params.grammar) == (4, "grammar")
    assert request.include_usage()
    assert parse_request(ChatCompletionRequest, _chat(top_logprobs=3)).top_logprobs_count() is None


def test_unknown_fields_are_ignored_and_named():
    body = _chat(store=True, metadata={"a": "b"}, frequency_penalty=0)
    body["messages"][0]["refusal"] = None
    request = parse_request(ChatCompletionRequest, body)
    assert ignored_fields(request) == ["messages[].refusal", "metadata", "store"]


def test_content_parts_and_developer_role():
    request = parse_request(
        ChatCompletionRequest,
        {
            "model": "m",
            "messages": [
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
        },
    )
    assert request.messages[0].to_chat_message() == ChatMessage(role="system", content="ab")


def test_max_completion_tokens_wins_and_completions_default_is_16():
    assert parse_request(ChatCompletionRequest, _chat(max_completion_tokens=5)).requested_max_tokens() == 5
    assert parse_request(ChatCompletionRequest, _chat()).requested_max_tokens() is None
    completion = parse_request(CompletionRequest, {"model": "m", "prompt": ["once"]})
    assert (completion.prompt_text(), completion.requested_max_tokens()) == ("once", 16)


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"model": "m"}, "missing_parameter", "messages"),
        (_chat(temperature=3), "invalid_value", "temperature"),
        (_chat(n=0), "invalid_value", "n"),
        (_chat(stop=["a", "b", "c", "d", "e"]), "invalid_value", "stop.str"),
        (_chat(top_logprobs=21, logprobs=True), "invalid_value", "top_logprobs"),
        (_chat(frequency_penalty=2.5), "invalid_value", "frequency_penalty"),
        (_chat(logit_bias={"x": 1}), "invalid_value", "logit_bias"),
        (_chat(modalities=["text", "audio"]), "unsupported_parameter", "modalities"),
        (_chat(functions=[{"name": "f"}]), "unsupported_parameter", "functions"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "unsupported_value",
            "messages.0.content",
        ),
        (_chat(tool_choice="required"), "invalid_value", "tool_choice"),
        (
            _chat(
                tools=[{"type": "function", "function": {"name": "a"}}],
                tool_choice={"type": "function", "function": {"name": "b"}},
            ),
            "invalid_value",
            "tool_choice",
        ),
        (_chat(tools=[{"type": "function", "function": {"name": "has space"}}]), "invalid_value", "tools"),
        (_chat(response_format={"type": "xml"}), "unsupported_value", "response_format"),
    ],
)
def test_refusals_name_the_parameter(body, code, param):
    with pytest.raises(ApiError) as info:
        parse_request(ChatCompletionRequest, body)
    assert info.value.status == 400
    assert info.value.code == code
    assert info.value.param.startswith(param.split(".")[0])
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}


def test_body_must_be_an_object():
    with pytest.raises(ApiError, match="JSON object"):
        parse_request(CompletionRequest, ["not", "an", "object"])
