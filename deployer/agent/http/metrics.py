"""A small Prometheus registry (counters, gauges, histograms) rendering the text exposition format 0.0.4,
and the agent's own set of metrics built on it. No dependency: the device runs only what it must.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

__all__ = ["AgentMetrics", "Counter", "Gauge", "Histogram", "Registry"]

LabelKey = tuple[str, ...]

# Latency buckets in seconds, from a fast first token on a GPU to a long answer on a small CPU.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str]) -> LabelKey:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"metric {self.name} takes labels {self.labelnames}, got {sorted(labels)}")
        return tuple(str(labels[name]) for name in self.labelnames)

    def _labels(self, key: LabelKey, extra: tuple[tuple[str, str], ...] = ()) -> str:
        pairs = [*zip(self.labelnames, key, strict=True), *extra]
        if not pairs:
            return ""
        return "{" + ",".join(f'{name}="{_escape(value)}"' for name, value in pairs) + "}"

    def render(self) -> list[str]:
        """The metric's lines in the text exposition format."""
        head = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        with self._lock:
            return head + self._samples()

    def _samples(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    """A value that only goes up (per label set)."""

    kind = "counter"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labelnames)
        self._values: dict[LabelKey, float] = {} if labelnames else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        """Add `amount` (>= 0) to the counter for these labels."""
        if amount < 0:
            raise ValueError(f"counter {self.name} cannot decrease")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        """The current value for these labels (0 if never incremented)."""
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def _samples(self) -> list[str]:
        return [f"{self.name}{self._labels(k)} {_num(v)}" for k, v in sorted(self._values.items())]


class Gauge(Counter):
    """A value that goes up and down; `clear()` drops every label set (e.g. the old model's info)."""

    kind = "gauge"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        """Add `amount` (may be negative)."""
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        """Subtract `amount`."""
        self.inc(-amount, **labels)

    def set(self, value: float, **labels: str) -> None:
        """Set the value for these labels."""
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)

    def clear(self) -> None:
        """Forget every label set."""
        with self._lock:
            self._values = {} if self.labelnames else {(): 0.0}


class Histogram(_Metric):
    """Observations counted into cumulative buckets, with their sum and count."""

    kind = "histogram"

    def __init__(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> None:
        super().__init__(name, help_text, labelnames)
        self.buckets = tuple(sorted(buckets))
        self._series: dict[LabelKey, tuple[list[int], list[float]]] = {}

    def observe(self, value: float, **labels: str) -> None:
        """Record one observation."""
        key = self._key(labels)
        with self._lock:
            counts, total = self._series.setdefault(key, ([0] * (len(self.buckets) + 1), [0.0]))
            index = next((i for i, bound in enumerate(self.buckets) if value <= bound), len(self.buckets))
            counts[index] += 1
            total[0] += value

    def count(self, **labels: str) -> int:
        """How many observations were recorded for these labels."""
        with self._lock:
            series = self._series.get(self._key(labels))
            return sum(series[0]) if series else 0

    def _samples(self) -> list[str]:
        lines = []
        for key, (counts, total) in sorted(self._series.items()):
            running = 0
            for bound, n in zip((*self.buckets, math.inf), counts, strict=True):
                running += n
                le = (("le", _num(bound)),)
                lines.append(f"{self.name}_bucket{self._labels(key, le)} {running}")
            lines.append(f"{self.name}_sum{self._labels(key)} {_num(total[0])}")
            lines.append(f"{self.name}_count{self._labels(key)} {running}")
        return lines


class Registry:
    """Named metrics, rendered together in registration order."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}

    def counter(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> Counter:
        """Register and return a counter."""
        return self._add(Counter(name, help_text, labelnames))

    def gauge(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> Gauge:
        """Register and return a gauge."""
        return self._add(Gauge(name, help_text, labelnames))

    def histogram(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> Histogram:
        """Register and return a histogram."""
        return self._add(Histogram(name, help_text, labelnames, buckets))

    def _add(self, metric: _Metric) -> _Metric:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} is registered twice")
        self._metrics[metric.name] = metric
        return metric

    def render(self) -> str:
        """Every metric in the Prometheus text format, ending with a newline."""
        return "\n".join(line for metric in self._metrics.values() for line in metric.render()) + "\n"


class AgentMetrics:
    """The metrics `sits-agent serve` exposes on /metrics."""

    def __init__(self) -> None:
        self.registry = r = Registry()
        self.running = r.gauge("sits_requests_running", "Requests generating now.")
        self.waiting = r.gauge("sits_requests_waiting", "Requests admitted and waiting for a slot.")
        self.requests = r.counter(
            "sits_requests_total", "Requests answered, by endpoint and HTTP status.", ("endpoint", "status")
        )
        self.prompt_tokens = r.counter("sits_prompt_tokens_total", "Prompt tokens processed.")
        self.generation_tokens = r.counter("sits_generation_tokens_total", "Tokens generated.")
        self.ttft = r.histogram("sits_time_to_first_token_seconds", "Time from request to first token.")
        self.e2e = r.histogram("sits_e2e_request_latency_seconds", "Time from request to last token.")
        self.model_info = r.gauge(
            "sits_model_info",
            "The active model (value 1).",
            ("model", "version", "quantization", "kernel", "engine", "device"),
        )
        self.reloads = r.counter("sits_reloads_total", "Model reloads (hot swaps), by result.", ("result",))
        self.rollbacks = r.counter(
            "sits_rollbacks_total", "Returns to a previous model, by result.", ("result",)
        )

    def render(self) -> str:
        """The /metrics body."""
        return self.registry.render()


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
