"""The fallback's metrics, in the agent's registry beside the others.

    sits_answers_total{served_by}                 generation requests by who answered (edge, upstream)
    sits_fallbacks_total{reason}                  answers the upstream gave, by trigger
    sits_fallback_failures_total{kind}            upstream calls that failed (connect, timeout,
                                                  status, malformed, open: refused by the breaker)
    sits_upstream_first_token_seconds             the upstream's time to first token
    sits_edge_confidence                          the mean probability of the device's first tokens,
                                                  as the confidence trigger judged them
    sits_fallbacks_last_5m                        answers the upstream gave in the last 5 minutes
    sits_edge_status{status}                      1 for the device's state now (ready, busy, offline)
    sits_fallback_breaker_state{state}            1 for the breaker's state now (closed, open, half-open)

The last three are read at scrape time, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from deployer.agent.serving.timing import LATENCY_BUCKETS

__all__ = ["RECENT_WINDOW_S", "FallbackMetrics"]

RECENT_WINDOW_S = 300.0
EDGE_STATES = ("ready", "busy", "offline")
BREAKER_STATES = ("closed", "open", "half-open")
CONFIDENCE_BUCKETS = tuple(i / 10 for i in range(1, 11))  # min_confidence is chosen by tenths


class FallbackMetrics:
    """Counters and a histogram the fallback updates, gauges it answers when scraped."""

    def __init__(
        self,
        registry: CollectorRegistry,
        edge_status: Callable[[], str],
        breaker_state: Callable[[], str],
        recent: Callable[[], int],
    ) -> None:
        self.answers = Counter(
            "sits_answers", "Generation requests, by who answered.", ("served_by",), registry=registry
        )
        self.fallbacks = Counter(
            "sits_fallbacks", "Answers the upstream model gave, by trigger.", ("reason",), registry=registry
        )
        self.failures = Counter(
            "sits_fallback_failures",
            "Upstream calls that failed, by kind (open: refused by the circuit breaker).",
            ("kind",),
            registry=registry,
        )
        self.upstream_latency = Histogram(
            "sits_upstream_first_token_seconds",
            "The upstream model's time to first token.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.confidence = Histogram(
            "sits_edge_confidence",
            "The mean probability of the device's first tokens, as the confidence trigger judged them.",
            buckets=CONFIDENCE_BUCKETS,
            registry=registry,
        )
        registry.register(_Gauges(edge_status, breaker_state, recent))


class _Gauges(Collector):
    def __init__(
        self, edge_status: Callable[[], str], breaker_state: Callable[[], str], recent: Callable[[], int]
    ) -> None:
        self._edge = edge_status
        self._breaker = breaker_state
        self._recent = recent

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "sits_fallbacks_last_5m", "Answers the upstream model gave in the last 5 minutes.", self._recent()
        )
        edge = "The device's state (1 for the current one)."
        yield _one_hot("sits_edge_status", edge, "status", self._edge(), EDGE_STATES)
        yield _one_hot(
            "sits_fallback_breaker_state",
            "The upstream circuit breaker's state (1 for the current one).",
            "state",
            self._breaker(),
            BREAKER_STATES,
        )


def _one_hot(name: str, doc: str, label: str, value: str, states: tuple[str, ...]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=(label,))
    for state in states:
        family.add_metric((state,), 1.0 if state == value else 0.0)
    return family
