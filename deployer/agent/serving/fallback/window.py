"""Two small sliding windows: the upstream's latency over its last calls (for its P95) and the
fallbacks of the last minutes (what `sits-deployer status` shows)."""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable

__all__ = ["RecentEvents", "RecentLatencies"]


class RecentLatencies:
    """The last `size` latencies, in seconds."""

    def __init__(self, size: int) -> None:
        self._values: collections.deque[float] = collections.deque(maxlen=size)
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        """Record one call's latency."""
        with self._lock:
            self._values.append(seconds)

    def p95(self) -> float | None:
        """The 95th percentile (nearest rank) of the recorded latencies; None before the first."""
        with self._lock:
            ordered = sorted(self._values)
        if not ordered:
            return None
        return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


class RecentEvents:
    """How many events happened in the last `window_s` seconds."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._window_s = window_s
        self._clock = clock
        self._times: collections.deque[float] = collections.deque()
        self._lock = threading.Lock()

    def add(self) -> None:
        """Record one event now."""
        with self._lock:
            self._times.append(self._clock())
            self._expire()

    def count(self) -> int:
        """Events within the window."""
        with self._lock:
            self._expire()
            return len(self._times)

    def _expire(self) -> None:
        horizon = self._clock() - self._window_s
        while self._times and self._times[0] < horizon:
            self._times.popleft()
