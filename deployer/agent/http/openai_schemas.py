"""The OpenAI wire format the agent speaks: request models (strict: unknown fields are refused),
OpenAI-style error bodies, and the response and stream-chunk bodies.
"""

from __future__ import annotations

import secrets
import time
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployer.agent.engines.base import ChatMessage, SamplingParams

__all__ = [
    "ApiError",
    "ChatCompletionRequest",
    "CompletionRequest",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "new_id",
    "parse_request",
    "usage",
]

_MAX_STOP = 4  # as OpenAI


class ApiError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        """The JSON body OpenAI clients parse."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TextPart(_Wire):
    """A text part of a message whose content is a list (images and audio are not supported)."""

    type: Literal["text"]
    text: str


class MessageIn(_Wire):
    """One message of a chat request."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def to_chat_message(self) -> ChatMessage:
        """The engine's form; a list of text parts is joined, "developer" is the newer name of "system"."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return ChatMessage(role="system" if self.role == "developer" else self.role, content=text)


class StreamOptions(_Wire):
    """`stream_options`: include_usage adds a final chunk with `choices: []` and the usage."""

    include_usage: bool = False


Stop = str | Annotated[list[str], Field(max_length=_MAX_STOP)] | None


class _Sampling(_Wire):
    model: str = Field(min_length=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: Stop = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # what a 64-bit generator takes
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    user: str | None = None

    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple of non-empty strings."""
        items = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in items if s)

    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling(self, max_tokens: int) -> SamplingParams:
        """The engine's sampling parameters, with `max_tokens` already resolved against the limits."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=self.stop_strings(),
        )


RequestT = TypeVar("RequestT", bound=_Sampling)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[MessageIn] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` (the newer name) or `max_tokens`, None when neither is given."""
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    """POST /v1/completions (one prompt string)."""

    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for this endpoint

    def prompt_text(self) -> str:
        """The prompt as one string."""
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def requested_max_tokens(self) -> int | None:
        """`max_tokens` as given."""
        return self.max_tokens


def parse_request(model: type[RequestT], data: object) -> RequestT:
    """Validate a decoded JSON body; raise ApiError 400 naming the first offending parameter."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        kind = first.get("type")
        if kind == "extra_forbidden":
            message, code = f"unrecognized request argument: {param}", "unknown_parameter"
        elif kind == "missing":
            message, code = f"missing required parameter: {param}", "missing_parameter"
        else:
            message, code = f"invalid value for {param}: {first.get('msg')}", "invalid_value"
        raise ApiError(400, message, param=param, code=code) from None


def new_id(prefix: str) -> str:
    """A unique response id such as chatcmpl-3f9a..."""
    return f"{prefix}-{secrets.token_hex(12)}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """The `usage` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _envelope(rid: str, obj: str, model: str, choices: list, extra: dict[str, Any]) -> dict:
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        **extra,
    }


def chat_response(rid: str, model: str, text: str, finish_reason: str, usage_: dict) -> dict:
    """A complete (non-streamed) chat completion."""
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "finish_reason": finish_reason,
        "logprobs": None,
    }
    return _envelope(rid, "chat.completion", model, [choice], {"usage": usage_})


def chat_chunk(
    rid: str, model: str, delta: dict, finish_reason: str | None, usage_: dict | None = None
) -> dict:
    """One streamed chat chunk; with `usage_`, the final usage chunk (no choices)."""
    if usage_ is not None:
        return _envelope(rid, "chat.completion.chunk", model, [], {"usage": usage_})
    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
    return _envelope(rid, "chat.completion.chunk", model, [choice], {})


def completion_response(rid: str, model: str, text: str, finish_reason: str, usage_: dict) -> dict:
    """A complete (non-streamed) text completion."""
    choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    return _envelope(rid, "text_completion", model, [choice], {"usage": usage_})


def completion_chunk(
    rid: str, model: str, text: str, finish_reason: str | None, usage_: dict | None = None
) -> dict:
    """One streamed text-completion chunk; with `usage_`, the final usage chunk (no choices)."""
    if usage_ is not None:
        return _envelope(rid, "text_completion", model, [], {"usage": usage_})
    choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    return _envelope(rid, "text_completion", model, [choice], {})
