"""Rate and ETA of a long upload, for the progress `apply` shows (a bar per device on a terminal,
one line per device otherwise).

A `TransferMeter` is a `Progress` callback for `Transport.put`: it turns the (bytes done, total)
it is given into a `TransferStatus` with the rate over the last few seconds (what the link does
now, not since the start: a cut and a resume, or a throttled neighbour, change it) and the time
left at that rate, and passes it on at most every `every_s` seconds, and always at the end.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from deployer.config.quantity import format_bytes, format_rate, format_seconds

__all__ = ["TransferMeter", "TransferStatus"]

WINDOW_S = 5.0  # the rate is measured over this many seconds


@dataclass(frozen=True)
class TransferStatus:
    """Where one file's transfer stands. `rate` (bytes/s) and `eta_s` are None until measurable."""

    name: str
    done: int
    total: int
    rate: float | None
    eta_s: float | None

    def describe(self) -> str:
        """One line for people: 'model.bin 12.0 MiB of 40.0 MiB, 1.9 Mbit/s, ETA 2m10s'."""
        line = f"{self.name} {format_bytes(self.done)} of {format_bytes(self.total)}"
        if self.rate is not None:
            line += f", {format_rate(self.rate)}"
        if self.eta_s is not None and self.done < self.total:
            line += f", ETA {format_seconds(self.eta_s)}"
        return line


class TransferMeter:
    """A `Progress` callback (done, total) that reports a `TransferStatus` to `on_status` at most
    every `every_s` seconds and once at the end. `clock` is a seam for tests."""

    def __init__(
        self,
        name: str,
        on_status: Callable[[TransferStatus], None],
        *,
        every_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.on_status = on_status
        self.every_s = every_s
        self._clock = clock
        self._samples: deque[tuple[float, int]] = deque()
        self._last_report: float | None = None

    def __call__(self, done: int, total: int) -> None:
        now = self._clock()
        if self._samples and done < self._samples[-1][1]:
            self._samples.clear()  # a resume went back to the verified prefix: measure afresh
        self._samples.append((now, done))
        while len(self._samples) > 2 and now - self._samples[1][0] >= WINDOW_S:
            self._samples.popleft()
        finished = done >= total
        if not finished and self._last_report is not None and now - self._last_report < self.every_s:
            return
        self._last_report = now
        self.on_status(self.status(total))

    def status(self, total: int) -> TransferStatus:
        """The transfer's status now, from the samples so far."""
        (t0, d0), (t1, d1) = self._samples[0], self._samples[-1]
        rate = (d1 - d0) / (t1 - t0) if t1 > t0 and d1 > d0 else None
        eta = (total - d1) / rate if rate else None
        return TransferStatus(self.name, d1, total, rate, eta)
