"""Request parsing: what OpenAI clients send is accepted, anything else is refused by name."""

import pytest

from deployer.agent.engines.base import ChatMessage
from deployer.agent.http.openai_schemas import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)


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
        ),
    )
    params = request.sampling(request.requested_max_tokens())
    assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (7, 0.5, 0.9, 3)
    assert params.stop == ("\n",)
    assert request.include_usage()


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
        (_chat(frequency_penalty=0.5), "unknown_parameter", "frequency_penalty"),
        ({"model": "m"}, "missing_parameter", "messages"),
        (_chat(temperature=3), "invalid_value", "temperature"),
        (_chat(n=2), "invalid_value", "n"),
        (_chat(stop=["a", "b", "c", "d", "e"]), "invalid_value", "stop.str"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x", "extra": 1}]},
            "unknown_parameter",
            "messages.0.extra",
        ),
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
