"""A scripted engine for the agent's fast tests, in the spirit of tests/push/simulator.py.

This is a fake, on purpose: the scheduler, hot swap and fallback are about what happens around a
model (admission, queues, cancellation, failures in one sequence or a whole step, swaps that fail
in a given phase, a first token that comes late), and a real model makes every such scenario cost
seconds and hard to force. The real-engine tests (tests/agent/runtime/test_scheduler.py,
test_hotswap.py, tests/agent/serving/test_fallback.py) stay the conformance layer.

What is scripted is the `Engine` interface, so the scheduler, ModelManager and FallbackSource above
it all run for real:

    vocabulary   one token per character (its code point), EOS = 0: `encode`/`decode` are exact,
                 and a chat prompt is its messages' contents joined by newlines
    Reply        what one prompt answers: its text (then EOS, or filler up to the budget), the
                 probability each token reports as logprob, an exception at its n-th token
                 (0: its prefill), a Gate that holds the engine thread at its n-th token
    ScriptedEngine
                 the engine: replies by prompt text; exceptions at load or warm-up; gates that
                 hold load, warm-up, unload (`holds`) or the next prefill (`hold_next_prefill`);
                 `fail_steps` makes the next whole steps raise; `group` answers step_group;
                 prefill, step and release are recorded in `calls` (load, warm-up and unload in a
                 `log` several engines share); `takes` advances a FakeClock per call, for the
                 code under test that reads a clock
    Gate         a threading.Event pair: the engine sets `reached` and waits until `open()`, so a
                 test acts while a request is provably mid-generation (never a sleep)
    FakeClock    a monotonic clock the test (or the engine) moves
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from deployer.agent.engines.base import Engine, token_budget
from deployer.agent.engines.textstream import token_events
from deployer.agent.types import ChatMessage, EngineInfo, Logprob, SamplingParams, TokenEvent, TokenLogprobs
from deployer.errors import AgentError

__all__ = ["EOS", "FakeClock", "Gate", "Reply", "ScriptedEngine", "ScriptedFault", "decode", "encode"]

EOS = 0
FILLER = "."  # what a reply without an end generates after its text, until the budget ends it
WAIT_S = 30.0  # a gate nobody opens fails the engine call after this long, rather than hang the test


class ScriptedFault(Exception):
    """An exception a script raises (as a real engine's foreign code would: not an AgentError)."""


def encode(text: str) -> list[int]:
    """The scripted vocabulary: one token per character, its code point."""
    return [ord(c) for c in text]


def decode(ids: Sequence[int]) -> str:
    """Inverse of `encode`; EOS is no text."""
    return "".join(chr(i) for i in ids if i != EOS)


class FakeClock:
    """A monotonic clock that moves only when told (thread-safe enough: one float)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock forward."""
        self.now += seconds


class Gate:
    """Where the engine thread waits for the test: `reached` is set when it arrives, and it goes on
    once `open()` was called (at once if it already was)."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self._opened = threading.Event()

    def open(self) -> None:
        """Let the engine thread through, now and every later time."""
        self._opened.set()

    def wait_reached(self, timeout_s: float = WAIT_S) -> None:
        """Block until the engine thread waits at the gate; fails the test if it never does."""
        assert self.reached.wait(timeout_s), "the engine never reached the gate"

    def pass_through(self) -> None:
        """On the engine thread: say so, then wait to be let through."""
        self.reached.set()
        if not self._opened.wait(WAIT_S):
            raise ScriptedFault("the test never opened the gate")


@dataclass(frozen=True)
class Reply:
    """What the engine answers to one prompt. Token n is the n-th generated (0: prefill's)."""

    text: str = "ok"
    end: bool = True  # EOS after the text; False: FILLER after it until max_tokens ("length")
    probability: float = 0.9  # of every token, as its logprob reports it (when asked for)
    error: Exception | None = None  # raised for this sequence alone...
    error_at: int = 0  # ...at this token
    hold: Gate | None = None  # the engine thread waits at this gate...
    hold_at: int = 1  # ...before this token (the whole batch waits, as on a real engine thread)

    def token(self, n: int) -> int:
        """The n-th generated token id."""
        ids = encode(self.text)
        if n < len(ids):
            return ids[n]
        return EOS if self.end else ord(FILLER)


@dataclass
class _Sequence:
    reply: Reply
    params: SamplingParams
    produced: int = 0  # the index of its last token


class ScriptedEngine(Engine):
    """An Engine without a model; see the module docstring."""

    def __init__(
        self,
        replies: Mapping[str, Reply] | None = None,
        *,
        default: Reply | None = None,
        name: str = "scripted",
        slots: int = 4,
        context_length: int = 256,
        load_error: Exception | None = None,
        warmup_error: Exception | None = None,
        group: int | None = None,
        clock: FakeClock | None = None,
        takes: Mapping[str, float] | None = None,
        log: list[tuple[str, str]] | None = None,
        holds: Mapping[str, Gate] | None = None,
    ) -> None:
        """`replies` by prompt text (`default` for any other); `group`: what step_group answers
        (None: every running sequence); `takes`: fake seconds each call ("load", "warmup",
        "prefill", "step") advances `clock` by; `log`: a list shared by several engines, which
        gets (name, call) for load, warmup and unload, in the order they happen; `holds`: a Gate
        each of those calls ("load", "warmup", "unload") waits at once logged."""
        self.replies = dict(replies or {})
        self.default = default or Reply()
        self.name = name
        self._slots = slots
        self._context_length = context_length
        self._load_error = load_error
        self._warmup_error = warmup_error
        self._group = group
        self._clock = clock
        self._takes = dict(takes or {})
        self._log = log if log is not None else []
        self._holds = dict(holds or {})
        self._lock = threading.Lock()
        self._failing_steps: list[Exception] = []
        self._prefill_gate: Gate | None = None
        self._running: dict[int, _Sequence] = {}
        self.loaded_from: Path | None = None
        self.unloaded = threading.Event()
        self.calls: list[tuple[str, tuple[int, ...]]] = []  # prefill, step, release with their slots
        self.params: list[SamplingParams] = []  # of each prefill, in order

    # -- scripting ------------------------------------------------------------------------------

    def fail_steps(self, error: Exception, count: int = 1) -> None:
        """Make the next `count` steps raise `error` as a whole (a failed forward pass), after any
        gate they wait at."""
        with self._lock:
            self._failing_steps += [error] * count

    def hold_next_prefill(self, gate: Gate) -> None:
        """Make the next prefill wait at `gate` (whatever its reply): requests submitted meanwhile
        queue, and join the batch before its next step."""
        with self._lock:
            self._prefill_gate = gate

    def reply_for(self, prompt: Sequence[int]) -> Reply:
        """The scripted reply to a prompt."""
        return self.replies.get(decode(prompt), self.default)

    def _lifecycle(self, call: str) -> None:
        """Log a lifecycle call, wait at its gate, spend its fake time."""
        self._log.append((self.name, call))
        if call in self._holds:
            self._holds[call].pass_through()
        self._spend(call)

    def _spend(self, call: str) -> None:
        if self._clock is not None:
            self._clock.advance(self._takes.get(call, 0.0))

    def _check_loaded(self) -> None:
        if self.loaded_from is None or self.unloaded.is_set():
            raise AgentError(f"the scripted engine {self.name} is not loaded")

    # -- lifecycle ------------------------------------------------------------------------------

    def load(self, artifact_dir: Path) -> None:
        """Record the artifact; raise `load_error` if scripted."""
        self._lifecycle("load")
        if self._load_error is not None:
            raise self._load_error
        self.loaded_from = artifact_dir

    def warmup(self) -> None:
        """Raise `warmup_error` if scripted."""
        self._lifecycle("warmup")
        if self._warmup_error is not None:
            raise self._warmup_error

    def unload(self) -> None:
        """Forget the sequences; later calls that compute raise AgentError."""
        self._lifecycle("unload")
        self._running.clear()
        self.unloaded.set()

    def describe(self) -> EngineInfo:
        """Facts of the scripted model; AgentError once unloaded (as the real engines)."""
        if self.unloaded.is_set():
            raise AgentError(f"the scripted engine {self.name} is unloaded")
        return EngineInfo("scripted", self.name, "", "none", "none", "cpu", self._context_length)

    # -- text -----------------------------------------------------------------------------------

    def chat_prompt(self, messages: Sequence[ChatMessage], tools: Sequence[dict] | None = None) -> list[int]:
        """The messages' contents joined by newlines (the scripted chat template)."""
        return encode("\n".join(m.content for m in messages))

    def encode(self, text: str) -> list[int]:
        """See `encode`."""
        return encode(text)

    def decode(self, ids: list[int]) -> str:
        """See `decode`."""
        return decode(ids)

    @property
    def end_ids(self) -> frozenset[int]:
        """EOS only."""
        return frozenset({EOS})

    # -- generation -----------------------------------------------------------------------------

    @property
    def max_slots(self) -> int:
        """As constructed."""
        return self._slots

    def step_group(self, running: int) -> int:
        """`group` (at most `running`), else every running sequence."""
        return running if self._group is None else min(self._group, running)

    def prefill(self, slot: int, prompt: Sequence[int], params: SamplingParams) -> int:
        """Start the reply scripted for `prompt`: its token 0, or its error."""
        self._check_loaded()
        if not 0 <= slot < self._slots:
            raise AgentError(f"slot {slot} is not one of the {self._slots} slots")
        token_budget(prompt, params, self._context_length)
        with self._lock:
            gate, self._prefill_gate = self._prefill_gate, None
        if gate is not None:
            gate.pass_through()
        self.calls.append(("prefill", (slot,)))
        self.params.append(params)
        self._spend("prefill")
        sequence = _Sequence(self.reply_for(prompt), params)
        self._running[slot] = sequence
        return self._advance(slot, sequence)

    def step(self, slots: Sequence[int]) -> list[int | Exception]:
        """Each slot's next token (or its own error); raises for slots that are not running and for
        a scripted whole-step failure."""
        self._check_loaded()
        self.calls.append(("step", tuple(slots)))
        missing = [s for s in slots if s not in self._running]
        if missing:
            raise AgentError(f"slots {missing} are not running")
        sequences = [self._running[s] for s in slots]
        for sequence in sequences:
            sequence.produced += 1
        for sequence in sequences:
            if sequence.reply.hold is not None and sequence.reply.hold_at == sequence.produced:
                sequence.reply.hold.pass_through()
        with self._lock:
            failing = self._failing_steps.pop(0) if self._failing_steps else None
        if failing is not None:
            raise failing
        self._spend("step")
        results: list[int | Exception] = []
        for slot, sequence in zip(slots, sequences, strict=True):
            try:
                results.append(self._token(sequence))
            except Exception as exc:  # this sequence alone, as Engine.step says
                del self._running[slot]
                results.append(exc)
        return results

    def _advance(self, slot: int, sequence: _Sequence) -> int:
        """Token 0 at prefill: through its gate, or its error (which ends the sequence)."""
        reply = sequence.reply
        if reply.hold is not None and reply.hold_at == 0:
            reply.hold.pass_through()
        try:
            return self._token(sequence)
        except Exception:
            del self._running[slot]
            raise

    @staticmethod
    def _token(sequence: _Sequence) -> int:
        reply = sequence.reply
        if reply.error is not None and reply.error_at == sequence.produced:
            raise reply.error
        return reply.token(sequence.produced)

    def release(self, slot: int) -> None:
        """End the slot's sequence."""
        self.calls.append(("release", (slot,)))
        self._running.pop(slot, None)

    def logprobs(self, slot: int) -> TokenLogprobs | None:
        """The scripted probability of the slot's last token, when its params asked for logprobs."""
        sequence = self._running.get(slot)
        if sequence is None or sequence.params.logprobs is None:
            return None
        token = sequence.reply.token(sequence.produced)
        chosen = Logprob(token, decode([token]).encode(), math.log(sequence.reply.probability))
        return TokenLogprobs(chosen, (chosen,)[: sequence.params.logprobs])

    def stream(self, prompt: list[int], params: SamplingParams) -> Iterator[TokenEvent]:
        """The reply on its own, through the scheduler's own text path (no slot is taken)."""
        reply = self.reply_for(prompt)
        tokens = (reply.token(n) for n in range(params.max_tokens))
        budget = token_budget(prompt, params, self._context_length)
        return token_events(tokens, decode, stops=params.stop, end_ids=self.end_ids, budget=budget)
