"""The scheduler that owns an engine: one engine thread, continuous batching, bounded queues.

One thread per loaded engine runs every call that computes (load, warm-up, prefill, step, release,
unload), so per-thread runtime state (torch's OpenMP team size, llama.cpp's thread) is set once
and never fought over. Its loop, between two decode steps:

1. runs queued engine calls (`run`, e.g. load or unload), and one piece of work given in pieces
   (`run_in_pieces`, e.g. an embedding: each of those in turn), so a long computation delays the
   batch by one of its pieces per step rather than by all of it;
2. drops requests that were cancelled, abandoned (their `Generation` was garbage-collected), whose
   consumer stopped reading for longer than `stall_timeout_s`, or that waited longer than
   `queue_timeout_s` for a slot; their slots are released;
3. admits waiting requests into free slots (prefill: the first token; the prompts admitted in one
   round go to the engine together, which may decode them in one batch). An idle engine first
   waits a moment for requests already on their way (`Arrivals`), and for as many as came in the
   last burst, so a burst starts together. When more wait for a free slot after a prefill, the
   next round admits them before anyone steps: a first token waits for as little as possible;
4. advances the running requests by one token with a single `engine.step`: all of them, or as many
   as `engine.step_group` says are cheaper to step apart (those whose last token is oldest), so a
   round of steps advances each once and a new request waits for one small step, not a whole round.
   A request that fails on its own in a step (its grammar allows no token, its slot is full) ends
   with its error; the others get their tokens as without it. Only a failure of the step itself
   ends them all.

A request's events travel to its consumer through a bounded buffer. A full buffer pauses that request
(it sits out the steps, the others go on) until its consumer reads again or the stall deadline drops
it.

Consumers get a `Generation` from `submit`: an iterator (threads) and an async iterator (asyncio) of
`TokenEvent`s with `cancel()`. Text is produced on the engine thread by `textstream`, so stop strings
end a sequence (and free its slot) the step they complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, TypeVar

from deployer.agent.engines.base import Engine, token_budget
from deployer.agent.engines.textstream import token_events
from deployer.agent.types import SamplingParams, TokenEvent
from deployer.errors import AgentError

__all__ = [
    "Arrivals",
    "EngineStopped",
    "Generation",
    "Overloaded",
    "QueueTimeout",
    "Scheduler",
    "SchedulerCounts",
    "SchedulerLimits",
]

T = TypeVar("T")
_END = object()  # what a buffer yields once its request has nothing more to say


class Overloaded(Exception):
    """Every batch slot and every queue place is taken (the HTTP layer answers 429 + Retry-After)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueTimeout(Exception):
    """A request waited longer than queue_timeout_s for a slot (503 + Retry-After)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineStopped(AgentError):
    """The scheduler's engine thread has ended (its model was unloaded, or the thread failed): the
    request cannot run on this model (503: a newer model, or a reload, serves it)."""


@dataclass(frozen=True)
class SchedulerLimits:
    """How much a scheduler takes on. `batch_size` is agent.yaml's max_concurrent (capped by the
    engine's max_slots); `queue_length` bounds the requests waiting beyond the batch."""

    batch_size: int = 4
    queue_length: int = 16
    queue_timeout_s: float = 120.0  # the longest a request waits for a slot
    stall_timeout_s: float = 120.0  # the longest a consumer may leave its full buffer unread
    buffer_events: int = 64  # events held for a consumer before its request pauses
    # The longest an idle engine waits for requests on their way (Arrivals) or of a burst: about
    # the time it takes to tokenize a few chat prompts, and the spread of a burst's sends.
    gather_s: float = 0.01


class Arrivals:
    """Requests that reached the agent and are on their way to a scheduler (being tokenized).

    Clients often come in bursts (an app's workers, a fan-out): when the engine is idle, the first
    of a burst would start alone and the rest wait for its whole prefill and a step. A scheduler
    with an idle engine therefore waits for the requests already on their way, at most
    `SchedulerLimits.gather_s`, and starts them together (one batched prefill). A lone request has
    none on its way and starts at once.

    The members of a burst are often a few milliseconds apart on the wire, too far apart to be
    seen on their way when the first is submitted. So the scheduler also remembers how many came
    within `gather_s` of the last idle start and waits (at most as long) for as many: a workload of
    bursts gets them gathered from its second burst on, one of lone requests never waits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._watchers: weakref.WeakSet[Scheduler] = weakref.WeakSet()

    @property
    def count(self) -> int:
        """How many are on their way now."""
        return self._count

    def coming(self) -> None:
        """A request is on its way (call `came` when it is submitted, or given up)."""
        with self._lock:
            self._count += 1

    def came(self) -> None:
        """A request announced by `coming` was submitted or given up: the schedulers look again."""
        with self._lock:
            self._count -= 1
            watchers = list(self._watchers)
        for scheduler in watchers:
            scheduler._wake()

    def watch(self, scheduler: Scheduler) -> None:
        """Wake `scheduler` whenever a request has come."""
        with self._lock:
            self._watchers.add(scheduler)


@dataclass(frozen=True)
class SchedulerCounts:
    """Requests in the batch (prefilled, generating) and waiting for a slot."""

    running: int
    waiting: int


class _Feed:
    """Token ids pushed one at a time into `token_events`, which pulls them."""

    def __init__(self) -> None:
        self.token = -1

    def __iter__(self) -> Iterator[int]:
        while True:
            yield self.token


class _Request:
    """One request's state, shared by the engine thread and the consumer (under `cond`)."""

    def __init__(
        self,
        engine: Engine,
        prompt: list[int],
        params: SamplingParams,
        budget: int,
        buffer: int,
        wake: Callable[[], None],
    ) -> None:
        self.prompt = prompt
        self.params = params
        self.buffer = buffer
        self.wake = wake
        self.submitted = time.monotonic()
        self.cond = threading.Condition()
        self.items: deque[TokenEvent | BaseException] = deque()
        self.closed = False  # no more items will be pushed
        self.cancelled = False
        self.stalled_since: float | None = None
        self.waker: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None
        # Engine-thread state while running: the slot, and the text of the ids fed in one at a time
        # (a generator: nothing runs before the first token is fed).
        self.slot = -1
        self.stepped = 0  # the scheduler's step count when this request got its last token
        self.feed = _Feed()
        self.events = token_events(
            self.feed,
            engine.decode,
            stops=params.stop,
            end_ids=engine.end_ids,
            budget=budget,
            logprobs=(lambda: engine.logprobs(self.slot)) if params.logprobs is not None else None,
        )

    # -- engine side ---------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        """The consumer's buffer is full: the request sits out the next step."""
        return len(self.items) >= self.buffer

    def push(self, item: TokenEvent | BaseException) -> None:
        """Hand one event (or the error that ended the request) to the consumer."""
        last = isinstance(item, BaseException) or item.finish_reason is not None
        with self.cond:
            if self.closed:
                return
            self.items.append(item)
            self.closed = last
            self.cond.notify()
            waker, self.waker = self.waker, None
        _resolve(waker)

    def finish_silently(self) -> None:
        """End the request without an event (it was cancelled: nobody reads it)."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
            waker, self.waker = self.waker, None
        _resolve(waker)

    # -- consumer side -------------------------------------------------------------------------

    def cancel(self) -> None:
        """Stop generating; the engine thread frees the slot at its next step."""
        with self.cond:
            if self.cancelled or (self.closed and not self.items):
                return
            self.cancelled = True
            self.cond.notify_all()
            waker, self.waker = self.waker, None
        _resolve(waker)
        self.wake()

    def pop(self, block: bool, timeout: float | None = None) -> Any:
        """The next item, _END when the request is over, None when not blocking and nothing is there."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while not self.items and not self.closed and not self.cancelled:
                if not block:
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self.cond.wait(remaining)
            if self.cancelled or not self.items:
                return _END
            was_full = len(self.items) >= self.buffer
            item = self.items.popleft()
        if was_full:
            self.wake()  # a paused request may step again
        return item

    def peek_ready(self) -> bool:
        with self.cond:
            return bool(self.items) or self.closed or self.cancelled


def _resolve(waker: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None) -> None:
    if waker is None:
        return
    loop, future = waker
    with contextlib.suppress(RuntimeError):  # the loop is closed: its consumer is gone anyway
        loop.call_soon_threadsafe(_set_done, future)


def _set_done(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class Generation:
    """One request's token events, for a thread (`for event in gen`) or asyncio (`async for`).

    `cancel()` (or `close()`, or leaving a `with` block, or dropping the last reference) stops the
    generation; its slot is freed at the next step. Iterating raises QueueTimeout when no slot came
    in time, and the engine's error if the request failed.
    """

    def __init__(self, request: _Request) -> None:
        self._request = request
        self._head: Any = None  # an item taken by wait_started(), given out first
        weakref.finalize(self, request.cancel)

    @property
    def prompt_tokens(self) -> int:
        """The prompt's length in tokens."""
        return len(self._request.prompt)

    @property
    def cancelled(self) -> bool:
        """Whether it was cancelled (by its consumer, or by the scheduler's cancel_all)."""
        return self._request.cancelled

    def cancel(self) -> None:
        """Stop the generation; idempotent."""
        self._request.cancel()

    close = cancel  # contextlib.closing() and generator-like callers

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()

    def wait_started(self, timeout: float | None = None) -> bool:
        """Block until the first event (or the request's failure) is there; True once it is.

        Raises what iteration would raise first (QueueTimeout, an engine error), so a server can
        answer with a proper status before it sends any header.
        """
        if self._head is None:
            self._head = self._request.pop(block=True, timeout=timeout)
        return self._check_head()

    async def await_started(self) -> None:
        """wait_started for asyncio."""
        while self._head is None:
            self._head = self._request.pop(block=False)
            if self._head is None:
                await self._wait_async()
        self._check_head()

    def _check_head(self) -> bool:
        if isinstance(self._head, BaseException):
            error, self._head = self._head, _END
            raise error
        return self._head is not None

    def _take(self, item: Any) -> TokenEvent:
        if item is _END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> TokenEvent:
        item, self._head = self._head, None
        if item is None:
            item = self._request.pop(block=True)
        return self._take(item)

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> TokenEvent:
        item, self._head = self._head, None
        while item is None:
            item = self._request.pop(block=False)
            if item is None:
                await self._wait_async()
        try:
            return self._take(item)
        except StopIteration:
            raise StopAsyncIteration from None

    async def _wait_async(self) -> None:
        request = self._request
        future = asyncio.get_running_loop().create_future()
        with request.cond:
            request.waker = (asyncio.get_running_loop(), future)
        if request.peek_ready():  # an item arrived before the waker was set
            _set_done(future)
        try:
            await future
        except asyncio.CancelledError:
            self.cancel()  # the task was cancelled (client gone): free the slot
            raise


class Scheduler:
    """Owns one engine and its thread; see the module docstring."""

    def __init__(
        self,
        engine: Engine,
        limits: SchedulerLimits,
        *,
        name: str = "engine",
        on_change: Callable[[], None] | None = None,
        arrivals: Arrivals | None = None,
    ) -> None:
        """Start the engine thread. `on_change()` is called (on any thread, no lock held) whenever the
        running or waiting count may have changed; `arrivals` counts requests on their way here
        (see Arrivals)."""
        self.engine = engine
        self._arrivals = arrivals
        self.limits = limits
        self._on_change = on_change or (lambda: None)
        self._cond = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self._pieces: deque[tuple[Generator[None, None, Any], Future]] = deque()
        self._unused: list[tuple[str, Callable[[], Any]]] = []  # see run_when_unused
        self._running: dict[int, _Request] = {}
        self._steps = 0  # engine steps run so far
        # The burst that began at the last idle start: when, how many so far; and how many the one
        # before it had (what an idle engine waits for, see Arrivals).
        self._burst_start = -math.inf
        self._burst_size = 0
        self._expected_burst = 1
        self._closing = False
        self._final: Callable[[], None] | None = None
        self._stopped = False  # the loop has ended: run() would never be answered
        self._context_length: int | None = None
        self._reported = SchedulerCounts(0, 0)
        self._report_lock = threading.Lock()
        if arrivals is not None:
            arrivals.watch(self)
        self._thread = threading.Thread(target=self._loop, name=f"sits-{name}", daemon=True)
        self._thread.start()

    # -- control -------------------------------------------------------------------------------

    def run(self, fn: Callable[[], T]) -> T:
        """`fn()` on the engine thread, between two steps (load, warm-up, unload); its result or error."""
        future: Future = Future()
        with self._cond:
            if self._stopped:
                raise EngineStopped("the engine thread has stopped", hint="reload the model")
            self._calls.append((fn, future))
            self._cond.notify()
        return future.result()

    def run_when_unused(self, adapter: str, fn: Callable[[], Any]) -> None:
        """Run `fn()` on the engine thread once no running or waiting request uses the adapter key
        `adapter` (e.g. unloading an adapter's old version while its requests finish on it). The
        caller makes sure no new request names it. Returns at once; a failure of `fn` is dropped
        (what it unloads goes with the engine anyway)."""
        with self._cond:
            self._unused.append((adapter, fn))
            self._cond.notify()

    def run_in_pieces(self, work: Generator[None, None, T]) -> Future[T]:
        """Run `work` on the engine thread a piece at a time (a piece: up to its next yield); the
        future gets what it returns or raises.

        While requests are decoding, one piece (of all such work, in turn) runs between two decode
        steps; otherwise the pieces run back to back. Cancelling the future drops the work before
        its next piece. Raises EngineStopped once the scheduler is closing."""
        future: Future[T] = Future()
        with self._cond:
            if self._closing or self._stopped:
                raise EngineStopped("this model is being unloaded", hint="retry: a newer model serves")
            self._pieces.append((work, future))
            self._cond.notify()
        return future

    def embed(self, texts: Sequence[str]) -> Future[tuple[list[list[float]], int]]:
        """The engine's `embed_pieces` of `texts`, run in pieces (`run_in_pieces`): what a request
        thread asks for embeddings with, since the engine computes only on its own thread.
        AgentError at once when the engine has no embeddings."""
        return self.run_in_pieces(self.engine.embed_pieces(texts))

    def counts(self) -> SchedulerCounts:
        """Requests running in the batch and waiting for a slot, now."""
        with self._cond:
            return SchedulerCounts(len(self._running), len(self._waiting))

    @property
    def stopped(self) -> bool:
        """The engine thread has ended (closed and drained, or failed)."""
        return self._stopped

    @property
    def capacity(self) -> int:
        """How many requests run at once: the batch size within the engine's slots."""
        return min(self.limits.batch_size, self.engine.max_slots)

    def submit(self, prompt: Sequence[int], params: SamplingParams) -> Generation:
        """Queue a generation from `prompt`; its events come through the returned Generation.

        Raises AgentError for bad parameters or a prompt that does not fit the context, Overloaded
        when the batch and the waiting queue are full, AgentError once the scheduler is closing.
        """
        prompt = list(prompt)
        budget = token_budget(prompt, params, self._context())
        request = _Request(self.engine, prompt, params, budget, self.limits.buffer_events, self._wake)
        with self._cond:
            if self._closing or self._stopped:
                raise EngineStopped("this model is being unloaded", hint="retry: a newer model serves")
            free = self.capacity - len(self._running)
            if len(self._waiting) >= self.limits.queue_length + max(0, free):
                raise Overloaded(
                    f"{len(self._running)} running and {len(self._waiting)} waiting",
                    retry_after_s=max(1, math.ceil(self.limits.queue_timeout_s / 60)),
                )
            self._count_burst(request.submitted)
            self._waiting.append(request)
            self._cond.notify()
        self._report()
        return Generation(request)

    def cancel_all(self) -> None:
        """Cancel every running and waiting request (shutdown); their consumers see them end."""
        with self._cond:
            requests = list(self._waiting) + list(self._running.values())
        for request in requests:
            request.cancel()

    def close(self, final: Callable[[], None] | None = None) -> None:
        """Take no new requests; once the running and waiting ones have finished, run `final()` (e.g.
        the engine's unload) on the engine thread and stop it. Returns at once; see `join`."""
        with self._cond:
            self._closing = True
            self._final = final
            self._cond.notify()

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the engine thread to stop after close(); True when it did within `timeout_s`."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _count_burst(self, submitted: float) -> None:
        """Count a submission into the current burst, or start one on an idle engine (lock held)."""
        if not self._running and not self._waiting:
            self._expected_burst = max(1, self._burst_size)
            self._burst_start, self._burst_size = submitted, 1
        elif submitted - self._burst_start <= self.limits.gather_s:
            self._burst_size += 1

    def _context(self) -> int:
        if self._context_length is None:
            self._context_length = self.engine.describe().context_length
        return self._context_length

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    # -- the engine thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while self._tick():
                pass
        finally:
            self._fail_all(EngineStopped("the engine thread stopped", hint="reload the model"))
            if self._final is not None:
                self._final()

    def _tick(self) -> bool:
        """One round of the loop; False when closed and drained."""
        with self._cond:
            waiting_before = len(self._waiting)
            while True:
                now = time.monotonic()
                calls = list(self._calls)
                self._calls.clear()
                calls += self._take_unused()
                piece = self._next_piece()
                expired = self._expire_waiting(now)
                admitted = [] if self._gathering(now) else self._admit()
                dropped = [r for r in self._running.values() if r.cancelled or self._stalled(r, now)]
                runnable = [r for r in self._running.values() if not r.paused and not r.cancelled]
                # A request cancelled while waiting changes the counts and nothing else.
                cancelled_waiting = len(self._waiting) != waiting_before
                work = calls or piece or expired or admitted or dropped or runnable
                if work or cancelled_waiting:
                    break
                if self._closing and not self._running and not self._waiting:
                    return False
                self._cond.wait(self._next_deadline(now))
        for fn, future in calls:
            _run_call(fn, future)
        if piece is not None:
            self._run_piece(*piece)
        for request in expired:
            request.push(QueueTimeout(f"waited {self.limits.queue_timeout_s:.0f} s for a free slot"))
        for request in dropped:
            self._release(request)
            if request.cancelled:
                request.finish_silently()
            else:  # stalled: a consumer that comes back learns why its answer stopped
                request.push(
                    AgentError(
                        f"dropped: the consumer read nothing for {self.limits.stall_timeout_s:.0f} s",
                        hint="read the stream as it comes",
                    )
                )
        if admitted:
            self._prefill(admitted)
        runnable = [r for r in runnable if self._running.get(r.slot) is r and not r.cancelled]
        if runnable and not (admitted and self._admittable()):
            self._step(self._next_group(runnable))
        if expired or admitted or dropped or runnable or cancelled_waiting:
            self._report()
        return True

    def _report(self) -> None:
        """Call on_change when the counts moved since the last report."""
        with self._report_lock:  # compare and call as one, or a stale count could stick
            counts = self.counts()
            if counts != self._reported:
                self._reported = counts
                self._on_change()

    def _take_unused(self) -> list[tuple[Callable[[], Any], Future]]:
        """The `run_when_unused` calls whose adapter no request uses any more (lock held)."""
        if not self._unused:
            return []
        used = {r.params.adapter for r in (*self._waiting, *self._running.values())}
        ready = [fn for adapter, fn in self._unused if adapter not in used]
        self._unused = [(adapter, fn) for adapter, fn in self._unused if adapter in used]
        return [(fn, Future()) for fn in ready]

    def _next_piece(self) -> tuple[Generator[None, None, Any], Future] | None:
        """The work whose turn it is for a piece, dropping work whose future was cancelled (lock held)."""
        while self._pieces:
            work, future = self._pieces.popleft()
            if not future.cancelled():
                return work, future
            work.close()
        return None

    def _run_piece(self, work: Generator[None, None, Any], future: Future) -> None:
        """One piece of `work`; back in line after the others when it has more to do."""
        try:
            next(work)
        except StopIteration as done:
            _settle(future, result=done.value)
        except Exception as exc:  # handed to whoever waits on the future
            _settle(future, error=exc)
        else:
            with self._cond:
                self._pieces.append((work, future))

    def _expire_waiting(self, now: float) -> list[_Request]:
        """Drop cancelled waiting requests; take out those that waited too long (lock held)."""
        expired: list[_Request] = []
        kept: deque[_Request] = deque()
        for request in self._waiting:
            if request.cancelled:
                request.finish_silently()
            elif now - request.submitted > self.limits.queue_timeout_s:
                expired.append(request)
            else:
                kept.append(request)
        self._waiting = kept
        return expired

    def _admit(self) -> list[_Request]:
        """Move waiting requests into free slots (lock held); their prefill runs after."""
        taken = set(self._running)
        free = [s for s in range(self.capacity) if s not in taken]
        admitted = []
        while free and self._waiting:
            request = self._waiting.popleft()
            # The slot whose cache already holds most of the prompt (a shared system prompt, the
            # earlier turns of a chat) saves that much prefill.
            request.slot = self.engine.choose_slot(free, request.prompt)
            free.remove(request.slot)
            self._running[request.slot] = request
            admitted.append(request)
        return admitted

    def _gathering(self, now: float) -> float:
        """Seconds the idle engine should still wait for requests on their way, or for the rest of a
        burst as big as the last one, before admitting the waiting ones (see Arrivals); 0: admit
        now (lock held)."""
        if self._running or not self._waiting:
            return 0.0
        if len(self._waiting) >= self.capacity:  # nothing more would start with them
            return 0.0
        on_their_way = self._arrivals is not None and self._arrivals.count > 0
        if not on_their_way and len(self._waiting) >= self._expected_burst:
            return 0.0
        return max(0.0, self._waiting[0].submitted + self.limits.gather_s - now)

    def _admittable(self) -> bool:
        """Requests wait and a slot is free for them: admitting them comes before the next step."""
        with self._cond:
            return bool(self._waiting) and len(self._running) < self.capacity

    def _stalled(self, request: _Request, now: float) -> bool:
        if not request.paused:
            request.stalled_since = None
            return False
        if request.stalled_since is None:
            request.stalled_since = now
        return now - request.stalled_since > self.limits.stall_timeout_s

    def _next_deadline(self, now: float) -> float | None:
        """Seconds until a waiting request expires, a paused one is dropped or the idle engine stops
        gathering (see Arrivals); None: nothing to time."""
        deadlines = [r.submitted + self.limits.queue_timeout_s for r in self._waiting]
        if gather := self._gathering(now):
            deadlines.append(now + gather)
        deadlines += [
            r.stalled_since + self.limits.stall_timeout_s
            for r in self._running.values()
            if r.stalled_since is not None
        ]
        return max(0.0, min(deadlines) - now) + 0.001 if deadlines else None

    def _prefill(self, admitted: list[_Request]) -> None:
        """Start the requests admitted this round, their prompts together where the engine batches
        them; each gets its first token or its error."""
        try:
            results = self.engine.prefill_many([(r.slot, r.prompt, r.params) for r in admitted])
        except Exception as exc:  # the call itself failed: every request in it
            results = [exc] * len(admitted)
        self._deliver(admitted, results)

    def _next_group(self, runnable: list[_Request]) -> list[_Request]:
        """The requests the next step advances: `engine.step_group` of them, those whose last token
        is oldest first (all of them by default)."""
        size = self.engine.step_group(len(runnable))
        if size >= len(runnable):
            return runnable
        return sorted(runnable, key=lambda r: r.stepped)[: max(1, size)]

    def _step(self, group: list[_Request]) -> None:
        try:
            results = self.engine.step([r.slot for r in group])
        except Exception as exc:  # the step itself failed (its forward pass): every request in it
            self._deliver(group, [exc] * len(group))
            return
        self._steps += 1
        # A request that failed on its own (its grammar, its slot) ends alone: the engine gave the
        # others their tokens as if it had not been in the batch.
        self._deliver(group, results)

    def _deliver(self, requests: list[_Request], results: Sequence[int | Exception]) -> None:
        """Each request's new token, or its error (which ends it)."""
        for request, result in zip(requests, results, strict=True):
            if isinstance(result, Exception):
                self._fail(request, result)
            else:
                request.stepped = self._steps
                self._advance(request, result)

    def _advance(self, request: _Request, token: int) -> None:
        """Turn the request's new token into its event (text, stop strings, logprobs) and hand it
        over; what fails there fails this request only."""
        request.feed.token = token
        try:
            event = next(request.events)
        except Exception as exc:
            self._fail(request, exc)
            return
        if event.finish_reason is not None:
            # Before the last event: a client that sends its next request on it finds the slot free.
            self._release(request)
        request.push(event)

    def _fail(self, request: _Request, error: Exception) -> None:
        """End the request with `error`, its slot freed."""
        self._release(request)
        request.push(error)

    def _release(self, request: _Request) -> None:
        """Free the request's slot (engine thread)."""
        with self._cond:
            if self._running.get(request.slot) is not request:
                return
            del self._running[request.slot]
        try:
            self.engine.release(request.slot)
        except Exception as exc:  # a failing release must not stop the loop; the next prefill resets
            request.push(exc)

    def _fail_all(self, error: AgentError) -> None:
        with self._cond:
            self._stopped = True
            requests = list(self._waiting) + list(self._running.values())
            self._waiting.clear()
            self._running.clear()
            calls = list(self._calls)
            self._calls.clear()
            pieces = list(self._pieces)
            self._pieces.clear()
        for request in requests:
            request.push(error)
        for _, future in calls:
            future.set_exception(error)
        for work, future in pieces:
            work.close()
            _settle(future, error=error)
        self._report()


def _settle(future: Future, *, result: Any = None, error: BaseException | None = None) -> None:
    """Set a piece-wise work's outcome, unless its future was cancelled meanwhile."""
    with contextlib.suppress(InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


def _run_call(fn: Callable[[], Any], future: Future) -> None:
    try:
        future.set_result(fn())
    except BaseException as exc:  # handed to the caller of run(), which re-raises it
        future.set_exception(exc)
