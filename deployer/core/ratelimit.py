"""Token buckets that cap a transfer's rate: the controller's uploads (push) and the agent's
downloads (pull) both go through them, so both sides share this one implementation.

A bucket fills at `rate` bytes per second up to `burst` bytes. `take(n)` spends n and, when that
leaves the bucket in debt, sleeps until the debt is paid: a caller may take more than `burst` at
once (a whole chunk) and still averages `rate`. Several threads may share one bucket (a fleet-wide
total): each pays its own debt, so together they stay within the rate. A `Throttle` takes from
every bucket it holds (a device's own cap and the fleet's total).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

__all__ = ["Throttle", "TokenBucket"]

# How long a full bucket lets a transfer run at line speed: short, so the cap holds over seconds.
BURST_S = 0.25
MIN_BURST = 16 * 1024


class TokenBucket:
    """A rate cap in bytes per second. `clock` and `sleep` are seams for tests."""

    def __init__(
        self,
        rate: float,
        *,
        burst: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if rate <= 0:
            raise ValueError(f"a token bucket needs a rate above 0, got {rate}")
        self.rate = rate
        self.burst = burst if burst is not None else max(MIN_BURST, rate * BURST_S)
        self._clock = clock
        self._sleep = sleep
        self._tokens = self.burst
        self._stamp = clock()
        self._lock = threading.Lock()

    def take(self, n: int) -> float:
        """Spend `n` bytes' worth; sleep while the bucket is in debt. Returns the seconds slept."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        # Sleep outside the lock: the tokens are already reserved, other takers queue behind them.
        if wait > 0:
            self._sleep(wait)
        return wait


class Throttle:
    """Every bucket of a transfer: each `take` spends from all of them (the slowest one decides)."""

    def __init__(self, buckets: Sequence[TokenBucket]) -> None:
        self.buckets = tuple(buckets)

    @property
    def rate(self) -> float | None:
        """The tightest cap in bytes per second, or None when there is none."""
        return min((b.rate for b in self.buckets), default=None)

    def take(self, n: int) -> None:
        """Spend `n` bytes from every bucket, sleeping as each requires."""
        for bucket in self.buckets:
            bucket.take(n)

    def writer(self, write: Callable[[bytes], object], piece: int = 32 * 1024) -> Callable[[bytes], None]:
        """`write` behind this throttle, fed in pieces of at most `piece` bytes so that a large chunk
        does not go out at line speed and then wait (a smooth rate, not bursts)."""

        def throttled(data: bytes) -> None:
            view = memoryview(data)
            for start in range(0, len(view), piece):
                part = view[start : start + piece]
                self.take(len(part))
                write(bytes(part))

        return throttled
