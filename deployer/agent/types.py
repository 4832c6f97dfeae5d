"""The agent's shared vocabulary: what a request asks for (messages, tool calls, sampling), what
generation yields (token events, log-probabilities) and what a loaded model says of itself.

Every layer speaks these words, from the OpenAI schemas down to the engines, so they live below all
of them and import nothing of the agent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from deployer.errors import AgentError


@dataclass(frozen=True)
class ToolCall:
    """A function call the assistant made: `arguments` is the JSON text of the call's arguments."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ChatMessage:
    """One message of a conversation, as the OpenAI API sends it: an assistant message may carry
    the tool calls it made, a "tool" message answers the call `tool_call_id`."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy; `seed` makes sampling repeatable;
    top_k 0 keeps every token.

    The rest change the logits before a token is picked (engines/logits.py does it for both
    engines): `logit_bias` adds to the named token ids; the OpenAI penalties subtract
    `presence_penalty` once and `frequency_penalty` per occurrence of each token generated so far,
    and `repeat_penalty` (llama.cpp's, 1 is off) divides those tokens' positive logits and
    multiplies their negative ones; `grammar`, an llguidance grammar, allows only the tokens that
    keep the output inside it. `logprobs` k (0..20) reports each chosen token's log-probability
    and the k most likely alternatives.
    """

    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str | None = None
    logprobs: int | None = None
    # The key of the LoRA adapter the engine runs the request with (Engine.load_adapter); None: the base.
    adapter: str | None = None

    @property
    def processed(self) -> bool:
        """Whether anything changes the logits or reads them (else the plain sampler runs)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repeat_penalty != 1.0
            or self.logit_bias
            or self.grammar is not None
            or self.logprobs is not None
        )


# Below this temperature sampling is greedy (dividing by ~0 would overflow anyway).
GREEDY_BELOW = 1e-5


MAX_TOP_LOGPROBS = 20  # as OpenAI


def check_params(params: SamplingParams) -> None:
    """Raise AgentError for parameters no sampler can honour."""
    if params.max_tokens < 1:
        raise AgentError(f"max_tokens must be at least 1, got {params.max_tokens}")
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise AgentError(f"temperature must be a finite number >= 0, got {params.temperature}")
    if not (0 < params.top_p <= 1):
        raise AgentError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k < 0:
        raise AgentError(f"top_k must be 0 (off) or a positive number, got {params.top_k}")
    penalties = (params.presence_penalty, params.frequency_penalty, params.repeat_penalty)
    if not all(math.isfinite(p) for p in penalties) or params.repeat_penalty <= 0:
        raise AgentError(f"penalties must be finite (repeat_penalty above 0), got {penalties}")
    if params.logprobs is not None and not 0 <= params.logprobs <= MAX_TOP_LOGPROBS:
        raise AgentError(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {params.logprobs}")


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability; `token` is its bytes (a piece of a character, possibly)."""

    token_id: int
    token: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's log-probability and the most likely tokens at that step, best first."""

    chosen: Logprob
    top: tuple[Logprob, ...]


@dataclass(frozen=True)
class TokenEvent:
    """One step of generation: the new text (may be empty mid-character) and, at the end, why."""

    token_id: int | None
    text: str
    finish_reason: str | None = None  # None while running; "stop" or "length" on the last event
    logprobs: TokenLogprobs | None = None  # when SamplingParams.logprobs asked for them


@dataclass(frozen=True)
class EngineInfo:
    """What /v1/models and /metrics report about the loaded model."""

    engine: str  # "torch" | "llama.cpp"
    model: str
    version: str
    quantization: str  # e.g. "int8", "int4-g128", "layered", "fp16"
    kernel: str  # the matmul path in use, e.g. "aten._weight_int8pack_mm" or "dequant+linear"
    device: str  # "cpu" | "cuda"
    context_length: int
    extra: dict[str, str] = field(default_factory=dict)
