"""A loaded model as the server uses it: a lease count (so a swap knows when the old model is free)
and a lock that serializes engine calls (engines are not thread-safe)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from deployer.agent.engines.base import Engine, EngineInfo, SamplingParams, TokenEvent
from deployer.agent.http.admission import QueueTimeout
from deployer.agent.notify import lifecycle_event

__all__ = ["FairLock", "LockedStream", "ModelSlot"]

T = TypeVar("T")


class FairLock:
    """A lock granted in arrival order. threading.Lock is not: under steady load a waiter (say, a
    swap's smoke test, or one unlucky request) can lose the race again and again, which shows as
    a long latency tail."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiters: deque[object] = deque()
        self._held = False

    def acquire(self, timeout: float | None = None) -> bool:
        """Wait for our turn (at most `timeout` seconds; None: no limit). False if it did not come."""
        deadline = None if timeout is None else time.monotonic() + timeout
        me = object()
        with self._cond:
            self._waiters.append(me)
            while self._held or self._waiters[0] is not me:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    self._waiters.remove(me)
                    self._cond.notify_all()  # we may have been first in line
                    return False
                self._cond.wait(remaining)
            self._waiters.popleft()
            self._held = True
            return True

    @property
    def waiting(self) -> int:
        """How many threads wait for the lock."""
        with self._cond:
            return len(self._waiters)

    def release(self) -> None:
        """Hand the lock to the longest waiter."""
        with self._cond:
            self._held = False
            self._cond.notify_all()

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class ModelSlot:
    """One loaded engine with a lease count. Engine calls are serialized: engines are not thread-safe."""

    def __init__(self, engine: Engine, artifact_dir: Path, version: str) -> None:
        self.engine = engine
        self.artifact_dir = artifact_dir
        self.version = version
        # The store's version name is the device's truth, whatever the artifact calls itself.
        self.info: EngineInfo = dataclasses.replace(engine.describe(), version=version)
        self._engine_lock = FairLock()
        self._leases_lock = threading.Lock()
        self._leases = 0
        self._retired = False
        self.unloaded = threading.Event()

    def acquire(self) -> bool:
        """Take a lease; False once the slot is retired."""
        with self._leases_lock:
            if self._retired:
                return False
            self._leases += 1
            return True

    def release(self) -> None:
        """Return a lease; the last one returned after retirement unloads the engine."""
        with self._leases_lock:
            self._leases -= 1
            unload = self._retired and self._leases == 0
        if unload:
            self._unload()

    def retire(self) -> None:
        """No new leases; unload now if idle, else when the last lease is returned."""
        with self._leases_lock:
            unload = not self._retired and self._leases == 0
            self._retired = True
        if unload:
            self._unload()

    def _unload(self) -> None:
        try:
            with self._engine_lock:
                self.engine.unload()
        finally:
            self.unloaded.set()
            lifecycle_event("unloaded", version=self.version, reason="no requests left on it")

    @contextlib.contextmanager
    def turn(self, timeout_s: float) -> Iterator[Engine]:
        """Hold the engine lock (wait up to `timeout_s` for the running generation); QueueTimeout if not."""
        if not self._engine_lock.acquire(timeout=timeout_s):
            raise QueueTimeout(f"the model was busy for {timeout_s:.0f} s")
        try:
            yield self.engine
        finally:
            self._engine_lock.release()

    def call(self, fn: Callable[[Engine], T], timeout_s: float) -> T:
        """Run `fn(engine)` (e.g. tokenizing) holding the engine lock."""
        with self.turn(timeout_s) as engine:
            return fn(engine)

    def stream(self, prompt: list[int], params: SamplingParams, timeout_s: float) -> LockedStream:
        """Start a generation holding the engine lock until the stream ends or is closed (client gone).

        Raises QueueTimeout if the engine stays busy for `timeout_s`, and what `Engine.stream` raises.
        """
        if not self._engine_lock.acquire(timeout=timeout_s):
            raise QueueTimeout(f"the model was busy for {timeout_s:.0f} s")
        try:
            return LockedStream(self.engine.stream(prompt, params), self._engine_lock)
        except BaseException:
            self._engine_lock.release()
            raise


class LockedStream:
    """Token events that hold a lock until exhausted or closed.

    A class rather than a generator: closing a generator that never started skips its `finally`,
    which would leak the lock when a request fails before its first token.
    """

    def __init__(self, events: Iterator[TokenEvent], lock: FairLock) -> None:
        self._events = events
        self._lock: FairLock | None = lock

    def __iter__(self) -> LockedStream:
        return self

    def __next__(self) -> TokenEvent:
        if self._lock is None:
            raise StopIteration
        try:
            return next(self._events)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the generation (if running) and release the lock; idempotent."""
        lock, self._lock = self._lock, None
        if lock is None:
            return
        try:
            close = getattr(self._events, "close", None)
            if close is not None:
                close()
        finally:
            lock.release()
