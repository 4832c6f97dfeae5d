"""The OpenAI wire format the agent speaks: request models, OpenAI-style error bodies, ids and usage.

Request models are tolerant as vLLM's are: a field they do not know is ignored and reported
(`ignored_fields`; the routes log and count it), except those in REFUSED, whose meaning we cannot
honour, which are refused by name. Values of known fields are checked strictly.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from deployer.agent.types import MAX_TOP_LOGPROBS, ChatMessage, SamplingParams, ToolCall

__all__ = [
    "REFUSED",
    "ApiError",
    "ChatCompletionRequest",
    "CompletionRequest",
    "EmbeddingRequest",
    "ignored_fields",
    "new_id",
    "parse_request",
    "usage",
]

_MAX_STOP = 4  # as OpenAI
MAX_TOOLS = 128  # as OpenAI: each tool is a grammar to compile (openai/constraints.py)
MAX_LOGIT_BIAS = 1024  # entries; each is checked against the vocabulary, and a refusal lists them
M = TypeVar("M", bound=BaseModel)


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
    # Fields we do not know are kept (to be reported, then ignored), not refused: SDKs send newer
    # fields and defaults (`store`, `metadata`, ...) that change nothing we do.
    model_config = ConfigDict(extra="allow", frozen=True)


class TextPart(_Wire):
    """A text part of a message whose content is a list (images and audio are refused by name)."""

    type: Literal["text"]
    text: str


class FunctionCallIn(_Wire):
    """The function of an assistant's tool call: its name and its arguments as JSON text."""

    name: str
    arguments: str = ""


class ToolCallIn(_Wire):
    """A tool call an earlier assistant message made."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class MessageIn(_Wire):
    """One message of a chat request."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: object) -> object:
        kinds = {p.get("type") for p in value if isinstance(p, dict)} if isinstance(value, list) else set()
        other = sorted(str(k) for k in kinds - {"text"})
        if other:
            raise PydanticCustomError(
                "unsupported",
                "content parts of type {kinds} are not supported (text only)",
                {"kinds": ", ".join(other)},
            )
        return value

    def to_chat_message(self) -> ChatMessage:
        """The engine's form; a list of text parts is joined, "developer" is the newer name of "system"."""
        content = self.content or ""
        text = content if isinstance(content, str) else "".join(p.text for p in content)
        calls = tuple(
            ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
            for c in self.tool_calls or ()
        )
        role = "system" if self.role == "developer" else self.role
        return ChatMessage(role=role, content=text, tool_calls=calls, tool_call_id=self.tool_call_id)


class FunctionDef(_Wire):
    """A function the model may call: its parameters are a JSON schema."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def schema_(self) -> dict[str, Any]:
        """The parameters' schema (an empty object when none is given, as OpenAI)."""
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class ToolIn(_Wire):
    """An entry of `tools`."""

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Wire):
    name: str


class NamedToolChoice(_Wire):
    """`tool_choice` naming the one function to call."""

    type: Literal["function"]
    function: NamedFunction


class TextFormat(_Wire):
    type: Literal["text"]


class JsonObjectFormat(_Wire):
    type: Literal["json_object"]


class JsonSchemaSpec(_Wire):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    # The field is `schema` on the wire; pydantic's BaseModel has a `schema` method.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(_Wire):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class StreamOptions(_Wire):
    """`stream_options`: include_usage adds a final chunk with `choices: []` and the usage."""

    include_usage: bool = False


Stop = str | Annotated[list[str], Field(max_length=_MAX_STOP)] | None
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _Sampling(_Wire):
    model: str = Field(min_length=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: Stop = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # what a 64-bit generator takes
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=128)
    user: str | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: (
        Annotated[
            dict[Annotated[str, Field(pattern=r"^\d{1,9}$")], Annotated[float, Field(ge=-100, le=100)]],
            Field(max_length=MAX_LOGIT_BIAS),
        ]
        | None
    ) = None
    # Extensions that llama.cpp's and vLLM's servers take too.
    top_k: int = Field(default=0, ge=0)
    repeat_penalty: float = Field(default=1.0, gt=0.0, le=10.0)

    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple of non-empty strings."""
        items = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in items if s)

    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def top_logprobs_count(self) -> int | None:
        """How many alternatives each token's logprobs list (None: no logprobs)."""
        raise NotImplementedError

    def sampling(self, max_tokens: int, grammar: str | None) -> SamplingParams:
        """The engine's sampling parameters, with `max_tokens` already resolved against the limits."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop_strings(),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repeat_penalty=self.repeat_penalty,
            logit_bias=tuple(sorted((int(k), v) for k, v in (self.logit_bias or {}).items())),
            grammar=grammar,
            logprobs=self.top_logprobs_count(),
        )


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[MessageIn] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolIn] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None

    @field_validator("tool_choice")
    @classmethod
    def _choice_names_a_tool(cls, choice: object, info: ValidationInfo) -> object:
        tools = info.data.get("tools") or []
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in tools]
            if choice.function.name not in names:
                raise ValueError(
                    f"it names {choice.function.name!r}, which is not among the tools "
                    f"({', '.join(names) or 'none given'})"
                )
        elif choice == "required" and not tools:
            raise ValueError("'required' needs `tools`")
        return choice

    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` (the newer name) or `max_tokens`, None when neither is given."""
        return self.max_completion_tokens or self.max_tokens

    def max_tokens_param(self) -> str:
        """The name the client gave its token budget under (what an error about it names)."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def top_logprobs_count(self) -> int | None:
        """See _Sampling.top_logprobs_count: `top_logprobs` when `logprobs` is true."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_mode(self) -> Literal["none", "auto", "required"] | str:
        """How tools are used: "none" (also without tools), "auto", "required", or the one name."""
        if not self.tools:
            return "none"
        choice = self.tool_choice or "auto"
        return choice.function.name if isinstance(choice, NamedToolChoice) else choice


class CompletionRequest(_Sampling):
    """POST /v1/completions (one prompt string)."""

    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for this endpoint
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=128)

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        # best_of > n would need ranking candidates by total logprob; nothing here does that.
        n = info.data.get("n", 1)
        if best_of is not None and best_of != n:
            raise ValueError(f"it must equal n ({n}) here: candidates are not ranked")
        return best_of

    def prompt_text(self) -> str:
        """The prompt as one string."""
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def requested_max_tokens(self) -> int | None:
        """`max_tokens` as given."""
        return self.max_tokens

    def max_tokens_param(self) -> str:
        """See ChatCompletionRequest.max_tokens_param."""
        return "max_tokens"

    def top_logprobs_count(self) -> int | None:
        """See _Sampling.top_logprobs_count: `logprobs` is the count here."""
        return self.logprobs


class EmbeddingRequest(_Wire):
    """POST /v1/embeddings."""

    model: str = Field(min_length=1)
    input: str | Annotated[list[str], Field(min_length=1, max_length=256)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    def texts(self) -> list[str]:
        """The inputs as a list."""
        return [self.input] if isinstance(self.input, str) else list(self.input)


# Fields whose meaning cannot be honoured, so ignoring them would answer something else than was
# asked: refused by name. Everything else unknown is ignored and reported.
REFUSED = {
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "functions": "the legacy `functions` is not supported: send `tools`",
    "function_call": "the legacy `function_call` is not supported: send `tool_choice`",
    "web_search_options": "web search is not supported",
}


def parse_request(model: type[M], data: object) -> M:
    """Validate a decoded JSON body; raise ApiError 400 naming the first offending parameter."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    for name, why in REFUSED.items():
        if name in data and not (name == "modalities" and data[name] == ["text"]):
            raise ApiError(400, f"{name}: {why}", param=name, code="unsupported_parameter")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ())]
        param = ".".join(loc) or None
        kind = first.get("type")
        if kind == "missing":
            message, code = f"missing required parameter: {param}", "missing_parameter"
        elif kind in ("unsupported", "union_tag_invalid"):
            message, code = f"unsupported value for {param}: {first.get('msg')}", "unsupported_value"
        else:
            message, code = f"invalid value for {param}: {first.get('msg')}", "invalid_value"
        raise ApiError(400, message, param=param, code=code) from None


def ignored_fields(body: BaseModel) -> list[str]:
    """The request's fields that nothing here reads, as paths such as `store` or `messages[].refusal`."""
    found: set[str] = set()

    def walk(value: object, path: str) -> None:
        if isinstance(value, BaseModel):
            found.update(f"{path}{name}" for name in value.model_extra or {})
            for name in type(value).model_fields:
                walk(getattr(value, name), f"{path}{name}.")
        elif isinstance(value, list):
            for item in value:
                walk(item, f"{path[:-1]}[].")

    walk(body, "")
    return sorted(found)


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
