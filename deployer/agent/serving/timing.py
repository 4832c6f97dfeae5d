"""How long recent requests took on the engine, for the first-token estimate of a new one."""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

__all__ = ["LATENCY_BUCKETS", "ServiceTimes"]

# Latency buckets in seconds, from a fast first token on a GPU to a long answer on a small CPU: the
# histograms of /metrics, the agent's own and its fallback's, share them.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

SAMPLES = 32  # recent requests the means are over: recent enough to follow load and model changes


@dataclass(frozen=True)
class _Sample:
    service_s: float  # from the engine's start to the last token
    prefill_s: float  # from the engine's start to the first token
    prompt_chars: int
    tokens: int


class ServiceTimes:
    """Means over the last SAMPLES completed generations (thread-safe)."""

    def __init__(self) -> None:
        self._samples: collections.deque[_Sample] = collections.deque(maxlen=SAMPLES)
        self._lock = threading.Lock()

    def add(self, began: float, first: float, ended: float, prompt_chars: int, tokens: int) -> None:
        """Record one completed generation (monotonic times of its start, first and last token)."""
        with self._lock:
            self._samples.append(_Sample(ended - began, first - began, prompt_chars, tokens))

    def first_token_estimate(self, ahead: int, prompt_chars: int) -> float | None:
        """Seconds until a request behind `ahead` others gets its first token: `ahead` times the
        mean service time (each one ahead generates its answer, mean tokens × per-token time, after
        its prefill), plus this prompt's prefill at the recent seconds per prompt character."""
        with self._lock:
            samples = list(self._samples)
        if not samples:
            return None
        service = sum(s.service_s for s in samples) / len(samples)
        chars = sum(s.prompt_chars for s in samples)
        prefill = sum(s.prefill_s for s in samples)
        own = prefill / chars * prompt_chars if chars else prefill / len(samples)
        return ahead * service + own
