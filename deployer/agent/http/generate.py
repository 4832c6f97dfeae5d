"""The one seam between the HTTP layer and generation: `TokenSource.start(job)` gives a running
`Generation` whose token events are read asynchronously and which can be cancelled.

Everything the routes know of the model goes through it. `SlotTokenSource` is today's path: the
model manager's lease, admission control and `ModelSlot.stream`, run on a worker thread per
request so that the event loop never blocks on the engine. Tokens travel through a bounded queue:
a client that reads slowly only fills its own queue, the worker then waits, and when the client is
gone or stalled the route cancels the generation; the worker sees that at its next token and
closes the engine stream, which frees the engine. A scheduler that owns the engine replaces this
class with one implementing the same `start`.

`LoadReport` is what a local source tells the edge-cloud fallback (deployer/agent/fallback) before
a job starts: whether it can serve at all, and when the job's first token would come. The fallback
wraps the local source in a TokenSource of its own; `Started.served_by` says who answered.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from deployer.agent.engines.base import ChatMessage, Engine, EngineInfo, SamplingParams, TokenEvent
from deployer.agent.hotswap import ModelManager, Unavailable
from deployer.agent.http.admission import Admission, Overloaded, QueueTimeout
from deployer.agent.http.openai_schemas import ApiError, ChatCompletionRequest, CompletionRequest
from deployer.agent.http.timing import ServiceTimes
from deployer.agent.notify import lifecycle_event
from deployer.errors import AgentError, SitsError

__all__ = [
    "QUEUE_EVENTS",
    "Cancelled",
    "EdgeStatus",
    "Generation",
    "Job",
    "LoadReport",
    "Metered",
    "ServedBy",
    "SlotTokenSource",
    "Started",
    "TokenSource",
    "api_error",
]

QUEUE_EVENTS = 64  # token events buffered per request between the engine and the client


@dataclass(frozen=True)
class Job:
    """One generation the HTTP layer asks for: chat messages (with the tools the model may call) or
    plain text (with the `suffix` to fill in before), and how to turn the tokenized prompt's length
    and the model into sampling parameters (raises ApiError 400 when the request cannot fit)."""

    messages: tuple[ChatMessage, ...] | None
    text: str | None
    plan: Callable[[int, EngineInfo], SamplingParams]
    timeout_s: float
    request: ChatCompletionRequest | CompletionRequest | None = None  # as the client sent it
    fallback: bool = True  # False: the device's own model answers (`x-sits-fallback: off`)
    tools: tuple[dict, ...] | None = None
    suffix: str | None = None

    def prompt_chars(self) -> int:
        """The prompt's length in characters (what a load estimate has before tokenizing)."""
        if self.messages is not None:
            return sum(len(m.content) for m in self.messages)
        return len(self.text or "")


@dataclass(frozen=True)
class ServedBy:
    """Who answers a request and, when it is not the device's own model, why (the fallback's
    trigger and a human-readable detail) and the model name the upstream answered with."""

    by: Literal["edge", "upstream"]
    reason: str | None = None
    detail: str | None = None
    model: str | None = None


EDGE = ServedBy("edge")


@dataclass(frozen=True)
class Started:
    """The first thing a generation reports: which model runs it and the prompt's length."""

    info: EngineInfo
    prompt_tokens: int
    served_by: ServedBy = EDGE


class Cancelled(Exception):
    """The generation was cancelled (client gone or stalled) before it finished."""


class Generation(Protocol):
    """A running generation. `cancel` is called on the event loop's thread."""

    started: Started

    def events(self) -> AsyncIterator[TokenEvent]:
        """Token events until the one with a finish_reason; raises ApiError for an engine failure
        and Cancelled after `cancel`."""
        ...

    def cancel(self) -> None:
        """Stop generating as soon as possible and free the engine; idempotent."""
        ...


@runtime_checkable
class Metered(Protocol):
    """A generation that learns its token counts only at its end (an upstream's `usage`)."""

    def usage(self) -> tuple[int, int] | None:
        """(prompt tokens, completion tokens) once reported, else None."""
        ...


EdgeStatus = Literal["ready", "busy", "offline"]


class LoadReport(Protocol):
    """What a local source tells the fallback before it starts a job."""

    def edge_status(self) -> EdgeStatus:
        """offline: no model can serve; busy: a new request would wait for others; else ready."""
        ...

    def first_token_estimate(self, job: Job) -> float | None:
        """Seconds until `job`, started now, would produce its first token: its queue position times
        the recent time per request ahead of it, plus its own prefill; None without recent timings."""
        ...


class TokenSource(Protocol):
    """Starts generations."""

    async def start(self, job: Job) -> Generation:
        """Admit, tokenize and start `job`; raise ApiError (429, 503, 400, 404...) before any token."""
        ...

    def cancel_all(self) -> None:
        """Cancel every running generation (at shutdown)."""
        ...


_END = object()
_CANCELLED = object()


class _ThreadGeneration:
    """A generation produced by a worker thread into a bounded asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[object] = asyncio.Queue(QUEUE_EVENTS)
        self._lock = threading.Lock()
        self._cancelled = False
        self._pending: concurrent.futures.Future | None = None
        self.started: Started

    # -- worker side -------------------------------------------------------------------------------

    @property
    def cancelled(self) -> bool:
        """Whether cancel() was called (read by the worker)."""
        return self._cancelled

    def put(self, item: object) -> bool:
        """Queue one item, waiting while the queue is full; False once cancelled (stop producing)."""
        with self._lock:
            if self._cancelled:
                return False
            try:
                future = asyncio.run_coroutine_threadsafe(self._queue.put(item), self._loop)
            except RuntimeError:  # the event loop is closed: nobody will read
                return False
            self._pending = future
        try:
            future.result()
        except (concurrent.futures.CancelledError, RuntimeError):
            return False
        return True

    # -- event loop side ---------------------------------------------------------------------------

    async def first(self) -> None:
        """Wait for Started (or the error that came instead)."""
        item = await self._queue.get()
        if item is _CANCELLED:
            raise Cancelled()
        if isinstance(item, BaseException):
            raise item
        assert isinstance(item, Started)
        self.started = item

    async def events(self) -> AsyncIterator[TokenEvent]:
        """See Generation.events."""
        while True:
            item = await self._queue.get()
            if item is _END:
                return
            if item is _CANCELLED:
                raise Cancelled()
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, TokenEvent)
            yield item

    def cancel(self) -> None:
        """See Generation.cancel (event loop thread only)."""
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            pending, self._pending = self._pending, None
        if pending is not None:
            pending.cancel()  # a worker blocked on a full queue wakes up and stops
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(_CANCELLED)  # wakes a reader waiting for the next event


class SlotTokenSource:
    """Today's path: admission, a lease on the active model, and its engine's `stream`."""

    def __init__(self, manager: ModelManager, admission: Admission) -> None:
        self._manager = manager
        self._admission = admission
        self._live: set[_ThreadGeneration] = set()
        self._live_lock = threading.Lock()
        self._times = ServiceTimes()

    def edge_status(self) -> EdgeStatus:
        """See LoadReport."""
        if not self._manager.ready:
            return "offline"
        counts = self._admission.counts()
        # The engine runs one request at a time: anyone running means a newcomer waits.
        return "busy" if counts.running or counts.waiting else "ready"

    def first_token_estimate(self, job: Job) -> float | None:
        """See LoadReport: every admitted request (running or waiting) is ahead of `job`."""
        counts = self._admission.counts()
        return self._times.first_token_estimate(counts.running + counts.waiting, job.prompt_chars())

    async def start(self, job: Job) -> Generation:
        """See TokenSource.start."""
        generation = _ThreadGeneration(asyncio.get_running_loop())
        with self._live_lock:
            self._live.add(generation)
        worker = threading.Thread(target=self._run, args=(generation, job), name="sits-generate", daemon=True)
        worker.start()
        try:
            await generation.first()
        except BaseException:
            generation.cancel()
            raise
        return generation

    def cancel_all(self) -> None:
        """See TokenSource.cancel_all (event loop thread)."""
        with self._live_lock:
            live = list(self._live)
        for generation in live:
            generation.cancel()

    def _run(self, generation: _ThreadGeneration, job: Job) -> None:
        try:
            with self._admission.slot(job.timeout_s), self._manager.lease() as slot:
                if generation.cancelled:  # the client left while this request waited
                    return
                prompt = slot.call(lambda engine: _tokenize(engine, job), job.timeout_s)
                params = job.plan(len(prompt), slot.info)
                with contextlib.closing(slot.stream(prompt, params, job.timeout_s)) as events:
                    if not generation.put(Started(slot.info, len(prompt))):
                        return
                    began, first, tokens = time.monotonic(), None, 0
                    for event in events:
                        first = first or time.monotonic()
                        tokens += event.token_id is not None
                        if not generation.put(event):
                            return  # cancelled: closing the stream frees the engine
                    if first is not None:
                        self._times.add(began, first, time.monotonic(), job.prompt_chars(), tokens)
                generation.put(_END)
        except BaseException as exc:
            generation.put(api_error(exc))
        finally:
            with self._live_lock:
                self._live.discard(generation)


def _tokenize(engine: Engine, job: Job) -> list[int]:
    if job.messages is not None:
        return engine.chat_prompt(list(job.messages), tools=job.tools)
    if job.suffix is not None:
        try:
            return engine.infill_prompt(job.text or "", job.suffix)
        except AgentError as exc:
            raise ApiError(400, exc.message, param="suffix", code="unsupported_parameter") from exc
    return engine.encode(job.text or "")


def api_error(exc: BaseException) -> BaseException:
    """The ApiError a failure of the worker answers as."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, Overloaded):
        return ApiError(
            429,
            f"the agent is at capacity ({exc}); retry later",
            type_="rate_limit_error",
            code="overloaded",
            headers={"Retry-After": "1"},
        )
    if isinstance(exc, QueueTimeout):
        return ApiError(
            503,
            f"{exc}; retry later",
            type_="server_error",
            code="queue_timeout",
            headers={"Retry-After": "1"},
        )
    if isinstance(exc, Unavailable):
        return ApiError(
            503,
            str(exc),
            type_="server_error",
            code="model_unavailable",
            headers={"Retry-After": str(exc.retry_after_s)},
        )
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":  # torch.cuda's too
        return ApiError(
            503,
            "the engine ran out of memory; retry later",
            type_="server_error",
            code="out_of_memory",
            headers={"Retry-After": "1"},
        )
    if isinstance(exc, SitsError):
        # Raised by the engine before or while generating (tokenizing, refused parameters).
        return ApiError(400, exc.message, code="invalid_request")
    if isinstance(exc, Exception):
        lifecycle_event("generation-failed", version=None, reason=f"{type(exc).__name__}: {exc}")
        return ApiError(500, f"generation failed: {exc}", type_="server_error", code="engine_error")
    return exc
