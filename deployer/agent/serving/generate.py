"""The one seam between the HTTP layer and generation: `TokenSource.start(job)` gives a running
`Generation` whose token events are read asynchronously and which can be cancelled.

Everything the routes know of the model goes through it. `SchedulerTokenSource` takes a lease on
the active model, tokenizes the job and submits it to that model's scheduler (on a worker thread:
a long prompt must not hold the event loop), then awaits its first event on the loop. The
scheduler batches it with the others, bounds its waiting queue, and hands its tokens over through
a bounded buffer: a client that reads slowly only pauses its own sequence; when the client is gone
or stalled the route cancels the generation and the scheduler frees its slot at the next step.

`LoadReport` is what a local source tells the edge-cloud fallback (deployer/agent/serving/fallback) before
a job starts: whether it can serve at all, and when the job's first token would come. The fallback
wraps the local source in a TokenSource of its own; `Started.served_by` says who answered.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from deployer.agent.engines.base import EngineText
from deployer.agent.notify import lifecycle_event
from deployer.agent.openai.schemas import ApiError, ChatCompletionRequest, CompletionRequest
from deployer.agent.runtime import scheduler
from deployer.agent.runtime.hotswap import ModelManager, Unavailable
from deployer.agent.runtime.scheduler import EngineStopped, Overloaded, QueueTimeout
from deployer.agent.serving.timing import ServiceTimes
from deployer.agent.types import ChatMessage, EngineInfo, SamplingParams, TokenEvent
from deployer.errors import AgentError, GrammarError, SitsError

__all__ = [
    "Cancelled",
    "EdgeStatus",
    "Generation",
    "Job",
    "LoadReport",
    "Metered",
    "SchedulerTokenSource",
    "ServedBy",
    "Started",
    "TokenSource",
    "api_error",
]


@dataclass(frozen=True)
class Job:
    """One generation the HTTP layer asks for: chat messages (with the tools the model may call) or
    plain text (with the `suffix` to fill in before), and how to turn the tokenized prompt's length
    and the model into sampling parameters (raises ApiError 400 when the request cannot fit)."""

    messages: tuple[ChatMessage, ...] | None
    text: str | None
    plan: Callable[[int, EngineInfo], SamplingParams]
    request: ChatCompletionRequest | CompletionRequest  # as the client sent it
    fallback: bool = True  # False: the device's own model answers (`x-sits-fallback: off`)
    tools: tuple[dict, ...] | None = None
    suffix: str | None = None
    # Choices after a request's first: who answered the first, so that one model answers them all.
    answerer: ServedBy | None = None

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
    adapter: str | None = None  # the LoRA adapter it runs with (`info` names it and its version)


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


class _Running:
    """A scheduler's generation as the routes read it: ApiError for failures, Cancelled at a cancel."""

    def __init__(
        self,
        generation: scheduler.Generation,
        started: Started,
        done: Callable[[float, float, int], None],
    ) -> None:
        """`done(first, ended, tokens)` is told the times of a generation that finished."""
        self._generation = generation
        self.started = started
        self._done = done

    async def first(self) -> None:
        """Wait for the first event: raises what the request met instead (queue timeout, refused)."""
        await self._generation.await_started()

    async def events(self) -> AsyncIterator[TokenEvent]:
        """See Generation.events."""
        first, tokens = 0.0, 0
        try:
            async for event in self._generation:
                first = first or time.monotonic()
                tokens += event.token_id is not None
                yield event
                if event.finish_reason is not None:
                    self._done(first, time.monotonic(), tokens)
                    return
        except Exception as exc:
            raise _failed_midway(exc) from exc
        raise Cancelled()  # the scheduler ends a generation without a finish reason only when cancelled

    def cancel(self) -> None:
        """See Generation.cancel."""
        self._generation.cancel()


class SchedulerTokenSource:
    """Generations on the active model's scheduler (see the module docstring)."""

    def __init__(self, manager: ModelManager, slots: int) -> None:
        """`slots`: how many sequences the active model's batch runs at once (max_concurrent)."""
        self._manager = manager
        self._slots = slots
        self._times = ServiceTimes()

    def edge_status(self) -> EdgeStatus:
        """See LoadReport: busy once a newcomer would wait for a slot."""
        if not self._manager.ready:
            return "offline"
        return "busy" if self._ahead() else "ready"

    def first_token_estimate(self, job: Job) -> float | None:
        """See LoadReport: with a free slot, only the job's own prefill; with none, every request
        that must finish before one frees up (running ones beyond the slots, and the waiting)."""
        return self._times.first_token_estimate(self._ahead(), job.prompt_chars())

    def _ahead(self) -> int:
        counts = self._manager.counts()
        return max(0, counts.running + counts.waiting + 1 - self._slots)

    async def start(self, job: Job) -> Generation:
        """See TokenSource.start."""
        self._manager.arrivals.coming()
        submitted = _WORKERS.submit(self._submit, job)
        # Once it is submitted, failed or dropped (and only then): the scheduler stops waiting for it.
        submitted.add_done_callback(lambda _: self._manager.arrivals.came())
        try:
            running = await asyncio.wrap_future(submitted)
        except asyncio.CancelledError:
            # The client left while the job was tokenized: cancel what the worker submits.
            submitted.add_done_callback(_cancel_submitted)
            raise
        except Exception as exc:
            raise api_error(exc) from None
        try:
            await running.first()
        except BaseException as exc:
            running.cancel()
            if isinstance(exc, Exception):
                raise api_error(exc) from None
            raise
        return running

    def cancel_all(self) -> None:
        """See TokenSource.cancel_all."""
        self._manager.cancel_all()

    def _submit(self, job: Job) -> _Running:
        """Tokenize, plan and queue `job` on the active model (a worker thread)."""
        began = time.monotonic()
        with self._manager.lease() as served:
            prompt = _tokenize(served.engine, job)
            # A `model` naming a LoRA adapter runs with it; under `use` until submitted, so that a
            # reload of the adapter lets this request finish on the version it starts with.
            with served.adapters.use(job.request.model) as adapter:
                info = served.info
                if adapter is not None:
                    info = dataclasses.replace(info, model=adapter.name, version=adapter.version)
                params = job.plan(len(prompt), info)
                if adapter is not None:
                    params = dataclasses.replace(params, adapter=adapter.key)
                generation = served.scheduler.submit(prompt, params)

        def done(first: float, ended: float, tokens: int) -> None:
            self._times.add(began, first, ended, job.prompt_chars(), tokens)

        name = adapter.name if adapter is not None else None
        return _Running(generation, Started(info, len(prompt), adapter=name), done)


# Tokenizing is short but not free (a prompt of max_request_bytes takes a while): off the event loop,
# on a few threads (the GIL-bound work gains nothing from more).
_WORKERS = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="sits-submit")


def _cancel_submitted(submitted: concurrent.futures.Future) -> None:
    if not submitted.cancelled() and submitted.exception() is None:
        submitted.result().cancel()


def _tokenize(engine: EngineText, job: Job) -> list[int]:
    if job.messages is not None:
        return engine.chat_prompt(list(job.messages), tools=job.tools)
    if job.suffix is not None:
        try:
            return engine.infill_prompt(job.text or "", job.suffix)
        except AgentError as exc:
            raise ApiError(400, exc.message, param="suffix", code="unsupported_parameter") from exc
    return engine.encode(job.text or "")


def _failed_midway(exc: Exception) -> ApiError:
    """The error of a generation that failed after its first token: its own grammar's dead end is
    the request's doing (400, as when the grammar is refused up front), anything else the server's."""
    if isinstance(exc, GrammarError):
        return api_error(exc)
    lifecycle_event("generation-failed", version=None, reason=f"{type(exc).__name__}: {exc}")
    return ApiError(500, f"generation failed: {exc}", type_="server_error", code="engine_error")


def api_error(exc: BaseException) -> ApiError:
    """The ApiError a request that could not start answers with."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, Overloaded):
        return ApiError(
            429,
            f"the agent is at capacity ({exc}); retry later",
            type_="rate_limit_error",
            code="overloaded",
            headers={"Retry-After": str(exc.retry_after_s)},
        )
    if isinstance(exc, QueueTimeout):
        return ApiError(
            503,
            f"{exc}; retry later",
            type_="server_error",
            code="queue_timeout",
            headers={"Retry-After": str(exc.retry_after_s)},
        )
    if isinstance(exc, Unavailable | EngineStopped):
        retry_after_s = exc.retry_after_s if isinstance(exc, Unavailable) else 1
        return ApiError(
            503,
            str(exc),
            type_="server_error",
            code="model_unavailable",
            headers={"Retry-After": str(retry_after_s)},
        )
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":  # torch.cuda's too
        return ApiError(
            503,
            "the engine ran out of memory; retry later",
            type_="server_error",
            code="out_of_memory",
            headers={"Retry-After": "1"},
        )
    if isinstance(exc, GrammarError):
        # Not retried by clients (a 5xx would be, and fail the same way): the schema must change.
        return ApiError(400, str(exc), param=exc.param, code="grammar_dead_end")
    if isinstance(exc, SitsError):
        # Raised before the first token (tokenizing, the engine refusing the prompt or parameters).
        param = exc.param if isinstance(exc, AgentError) else None
        return ApiError(400, exc.message, param=param, code="invalid_request")
    lifecycle_event("generation-failed", version=None, reason=f"{type(exc).__name__}: {exc}")
    return ApiError(500, f"generation failed: {exc}", type_="server_error", code="engine_error")
