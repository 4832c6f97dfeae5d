"""Admission control: at most `max_concurrent` requests run, at most `queue_length` wait, the rest are
turned away at once (HTTP 429 + Retry-After) instead of piling up until every client times out.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["Admission", "Overloaded", "QueueTimeout"]


class Overloaded(Exception):
    """Every running slot and every queue place is taken."""


class QueueTimeout(Exception):
    """A request waited in the queue longer than the request timeout."""


@dataclass(frozen=True)
class AdmissionCounts:
    """A snapshot for /metrics and tests."""

    running: int
    waiting: int


class Admission:
    """A bounded queue in front of a bounded set of running slots.

    `on_change(running, waiting)` is called after every change, e.g. to update gauges.
    """

    def __init__(
        self,
        max_concurrent: int,
        queue_length: int,
        on_change: Callable[[int, int], None] | None = None,
    ) -> None:
        self.max_concurrent = max_concurrent
        self.queue_length = queue_length
        self._cond = threading.Condition()
        self._running = 0
        self._waiting = 0
        self._on_change = on_change or (lambda running, waiting: None)

    def counts(self) -> AdmissionCounts:
        """How many requests run and wait now."""
        with self._cond:
            return AdmissionCounts(self._running, self._waiting)

    @contextlib.contextmanager
    def slot(self, timeout_s: float) -> Iterator[None]:
        """Hold a running slot for the duration of the block.

        Raises Overloaded when the queue is full, QueueTimeout after `timeout_s` in the queue.
        """
        self._enter(timeout_s)
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._notify_locked()
                self._cond.notify()

    def _enter(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if self._running < self.max_concurrent:
                self._running += 1
                self._notify_locked()
                return
            if self._waiting >= self.queue_length:
                raise Overloaded(f"{self._running} running and {self._waiting} waiting")
            self._waiting += 1
            self._notify_locked()
            try:
                while self._running >= self.max_concurrent:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise QueueTimeout(f"waited {timeout_s:.0f} s for a free slot")
                    self._cond.wait(remaining)
                self._running += 1
            finally:
                self._waiting -= 1
                self._notify_locked()

    def _notify_locked(self) -> None:
        self._on_change(self._running, self._waiting)
