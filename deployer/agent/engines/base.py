"""The one interface the agent's server, hot swap and smoke tests use to run a model.

An engine loads one artifact directory, warms up, turns chat messages or text into tokens,
streams generated tokens, describes itself, and unloads. The server never knows which
implementation (torch, llama.cpp) it is talking to. `EngineText` is the part any thread may
call (text, facts); `Engine` adds what computes, for the engine thread alone.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from deployer.agent.types import (
    ChatMessage,
    EngineInfo,
    SamplingParams,
    TokenEvent,
    TokenLogprobs,
    check_params,
)
from deployer.core.lora import LoraAdapter
from deployer.errors import AgentError


def token_budget(prompt: Sequence[int], params: SamplingParams, context_length: int) -> int:
    """How many tokens may be generated after `prompt`: max_tokens, capped by the room left.

    Raises AgentError for bad parameters, an empty prompt, or a prompt that fills the context.
    """
    check_params(params)
    if not prompt:
        raise AgentError("the prompt is empty", param="prompt")  # a chat template never is
    room = context_length - len(prompt)
    if room < 1:
        raise AgentError(
            f"the prompt has {len(prompt)} tokens; the context holds {context_length}",
            hint="shorten the prompt",
        )
    return min(params.max_tokens, room)


# An embedding request's work between two decode steps: inputs are grouped up to this many tokens.
# A piece stalls the running batch as a prompt of its length would (prefill is not split either).
EMBED_PIECE_TOKENS = 64
Embedding = Generator[None, None, tuple[list[list[float]], int]]  # see Engine.embed_pieces
T = TypeVar("T")


def in_pieces(items: Iterable[T], tokens: Callable[[T], int]) -> Iterator[list[T]]:
    """Consecutive `items` grouped into pieces of at most EMBED_PIECE_TOKENS tokens each (`tokens`
    counts an item's); an item longer than that is a piece alone."""
    piece: list[T] = []
    size = 0
    for item in items:
        n = tokens(item)
        if piece and size + n > EMBED_PIECE_TOKENS:
            yield piece
            piece, size = [], 0
        piece.append(item)
        size += n
    if piece:
        yield piece


def token_of(result: int | Exception) -> int:
    """One sequence's outcome of `Engine.step`: its token, or its exception raised."""
    if isinstance(result, Exception):
        raise result
    return result


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids two sequences share (prefix reuse in a slot's cache; benches compare
    greedy runs with it)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# A slot's cache is copied from another's when that saves at least this many prompt tokens: the
# copy is not free (llama.cpp moves the whole stream), and a short shared prefix saves little.
SHARE_FROM = 16


def prefix_donor(slot: int, prompt: Sequence[int], held: Sequence[Sequence[int]]) -> tuple[int | None, int]:
    """(the other slot whose cache holds the longest prefix of `prompt`, when copying it saves
    decoding at least SHARE_FROM tokens more than `slot`'s own cache does, else None; how many
    leading prompt tokens the cache `slot` starts from then holds, at most all but the last).
    `held[s]` is what slot s's cache holds."""
    usable = len(prompt) - 1  # the last prompt token is always decoded: its logits give a token
    own = min(common_prefix(held[slot], prompt), usable)
    shared = {o: min(common_prefix(ids, prompt), usable) for o, ids in enumerate(held) if o != slot}
    best = max(shared, key=lambda other: shared[other], default=None)
    if best is not None and shared[best] - own >= SHARE_FROM:
        return best, shared[best]
    return None, own


def longest_prefix_slot(free: Sequence[int], prompt: Sequence[int], held: Sequence[Sequence[int]]) -> int:
    """The free slot whose cache (`held[s]`) shares the longest prefix with `prompt`, the first of
    `free` on a tie."""
    return max(free, key=lambda s: common_prefix(held[s], prompt))


class EngineText(abc.ABC):
    """What any thread may ask of an engine, also while its engine thread generates: turning
    messages and text into ids and back, the ids that end generation, and the facts about the
    model. Code on request threads holds an engine as this type, so the type checker refuses
    a call that computes there (those are `Engine`'s, for the engine thread)."""

    @abc.abstractmethod
    def chat_prompt(self, messages: Sequence[ChatMessage], tools: Sequence[dict] | None = None) -> list[int]:
        """Format messages (and the OpenAI `tools` the model may call) with the model's own chat
        template and tokenize them."""

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Tokenize plain text (for /v1/completions)."""

    def infill_prompt(self, prefix: str, suffix: str) -> list[int]:
        """The fill-in-the-middle prompt for text between `prefix` and `suffix`; AgentError when the
        model has no infill tokens."""
        raise AgentError(f"the {type(self).__name__} engine cannot fill in the middle")

    @abc.abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Ids to text, special tokens left out (the scheduler streams text through textstream)."""

    @property
    @abc.abstractmethod
    def end_ids(self) -> frozenset[int]:
        """Token ids that end generation (EOS, end of turn)."""

    @abc.abstractmethod
    def describe(self) -> EngineInfo:
        """Facts about the loaded model and the kernels in use."""


class Engine(EngineText):
    """A loaded model. The calls declared here compute (load, warmup, stream, the batched steps,
    embed, unload) and come from one thread, the scheduler's engine thread; the text calls of
    `EngineText` may come from any thread.

    Two ways to generate. `stream` runs one sequence to its end (tests, benchmarks, warm-up).
    The batched step interface (`max_slots`, `prefill`, `step`, `release`) is what the scheduler
    drives to serve many requests at once: each request owns a slot; requests join (prefill) and
    leave (release) between steps, and one `step` advances every running slot by one token; the
    scheduler turns the ids into text with `decode` and ends a sequence on `end_ids`.
    """

    @property
    @abc.abstractmethod
    def max_slots(self) -> int:
        """How many sequences `step` can advance together."""

    @abc.abstractmethod
    def prefill(self, slot: int, prompt: Sequence[int], params: SamplingParams) -> int:
        """Start `slot` on `prompt` with its own sampling (seeded per request) and return the first
        generated token id. The slot's cache is written by position, so a prompt that shares a prefix
        with what the slot last held may skip that part. Raises AgentError for a bad slot, a prompt
        that does not fit, or bad parameters."""

    def prefill_many(
        self, items: Sequence[tuple[int, Sequence[int], SamplingParams]]
    ) -> list[int | Exception]:
        """Start several (slot, prompt, params) at once, the requests admitted in one round: the
        first token of each, or its exception in its place, as `step` returns them. By default one
        `prefill` after another; an engine may decode the prompts in one batch."""
        results: list[int | Exception] = []
        for slot, prompt, params in items:
            try:
                results.append(self.prefill(slot, prompt, params))
            except Exception as exc:  # this request alone
                results.append(exc)
        return results

    def choose_slot(self, free: Sequence[int], prompt: Sequence[int]) -> int:
        """Which of the `free` slots `prompt` should go to: by default the first (the lowest, so an
        engine that steps rows 0..max runs the smallest batch); an engine may pick the one whose
        cache shares the longest prefix with it."""
        return free[0]

    @abc.abstractmethod
    def step(self, slots: Sequence[int]) -> list[int | Exception]:
        """One decode step for each of `slots` (each continues from its last token); the next token
        id of each, in the same order.

        A sequence that fails on its own (its grammar allows no token, its cache is full, its logit
        processing raised) has its exception in its place, as asyncio.gather's return_exceptions
        does, and stops running (release its slot); the others get their tokens as if it had not
        been there. What fails the whole step (slots that are not running, the forward pass itself)
        raises."""

    def step_group(self, running: int) -> int:
        """How many of `running` sequences the next `step` should advance, 1 to `running`; the
        scheduler steps the others next, longest waiting first, so each advances once per round.
        By default all of them: one batched step costs less than several smaller ones."""
        return running

    @abc.abstractmethod
    def release(self, slot: int) -> None:
        """End the sequence in `slot`; the slot may be prefilled again (its prefix kept for reuse)."""

    @abc.abstractmethod
    def logprobs(self, slot: int) -> TokenLogprobs | None:
        """The log-probabilities of the token the slot's last prefill or step chose (None unless its
        SamplingParams asked for logprobs)."""

    @abc.abstractmethod
    def load(self, artifact_dir: Path) -> None:
        """Load the artifact (memory-mapped where possible). Raises SitsError subclasses on bad input."""

    @abc.abstractmethod
    def warmup(self) -> None:
        """Run a short generation so the first real request does not pay one-time costs."""

    def embed(self, texts: Sequence[str]) -> tuple[list[list[float]], int]:
        """Each text's embedding (the mean of the model's last hidden states, L2-normalised) and the
        number of tokens read: `embed_pieces` run to its end."""
        pieces = self.embed_pieces(texts)
        while True:
            try:
                next(pieces)
            except StopIteration as done:
                return done.value

    def embed_pieces(self, texts: Sequence[str]) -> Embedding:
        """`embed` a piece at a time: the generator yields between pieces of inputs of up to
        EMBED_PIECE_TOKENS tokens together (a longer input is a piece alone; none is split), so the
        scheduler can run decode steps in between, and returns what `embed` returns. AgentError
        at once when the engine has no embeddings."""
        raise AgentError(f"the {type(self).__name__} engine has no embeddings")

    def load_adapter(self, key: str, adapter: LoraAdapter, directory: Path) -> None:
        """Load a LoRA adapter (read from the artifact `directory`) under `key`, the base model
        untouched; requests name it by `SamplingParams.adapter`. AgentError when this engine
        serves no adapters or the adapter does not fit its model (nothing loaded)."""
        raise AgentError(f"the {type(self).__name__} engine serves no LoRA adapters")

    def unload_adapter(self, key: str) -> None:
        """Drop the adapter loaded under `key` (no running sequence may use it; nothing when none
        is loaded)."""

    @abc.abstractmethod
    def stream(self, prompt: list[int], params: SamplingParams) -> Iterator[TokenEvent]:
        """Generate from `prompt`, yielding one event per token; the last has a finish_reason.

        Stop strings end generation with finish_reason "stop" and are not included in the text.
        Closing the iterator early (client gone) must release the engine promptly.
        """

    @abc.abstractmethod
    def unload(self) -> None:
        """Free the model's memory. The engine cannot be used afterwards."""
