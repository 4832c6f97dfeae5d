"""A circuit breaker in front of the upstream, so that a dead upstream is not hammered.

closed     calls go through; `failures` failures in a row open it
open       no call goes through for the backoff period, which doubles (up to a cap) each time a
           trial call fails
half-open  the backoff is over: one trial call goes through; success closes the breaker (and
           resets the backoff), failure opens it again
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Literal

__all__ = ["BreakerState", "CircuitBreaker"]

BreakerState = Literal["closed", "open", "half-open"]


class CircuitBreaker:
    """Thread-safe; `clock` is injectable for tests."""

    def __init__(
        self,
        failures: int,
        backoff_s: float,
        max_backoff_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._threshold = failures
        self._base_s = backoff_s
        self._max_s = max(backoff_s, max_backoff_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._backoff_s = backoff_s
        self._open_until: float | None = None
        self._trial = False  # a half-open trial call is out

    @property
    def state(self) -> BreakerState:
        """closed, open (no calls) or half-open (one trial call)."""
        with self._lock:
            return self._state_locked()

    def _state_locked(self) -> BreakerState:
        if self._open_until is None:
            return "closed"
        return "open" if self._clock() < self._open_until or self._trial else "half-open"

    def retry_after_s(self) -> float:
        """Seconds until a call may go through again (0 when one may now)."""
        with self._lock:
            if self._open_until is None:
                return 0.0
            return max(0.0, self._open_until - self._clock())

    def allow(self) -> bool:
        """Whether a call may go through now; in half-open, only the first caller gets True."""
        with self._lock:
            state = self._state_locked()
            if state == "half-open":
                self._trial = True
                return True
            return state == "closed"

    def success(self) -> None:
        """A call went well: close the breaker."""
        with self._lock:
            self._failures = 0
            self._backoff_s = self._base_s
            self._open_until = None
            self._trial = False

    def failure(self) -> None:
        """A call failed: count it; open (again) when the threshold is reached or a trial failed."""
        with self._lock:
            self._failures += 1
            if self._trial:  # the half-open trial failed: a longer pause
                self._backoff_s = min(self._max_s, self._backoff_s * 2)
            elif self._open_until is not None or self._failures < self._threshold:
                return  # already open (a call that began before), or not yet at the threshold
            self._open_until = self._clock() + self._backoff_s
            self._trial = False

    def release(self) -> None:
        """A trial call ended without a verdict (cancelled): let the next caller try."""
        with self._lock:
            self._trial = False
