"""The agent's Prometheus metrics, on prometheus_client (the reference implementation of the format).

Each AgentMetrics has its own registry, so several agents in one process (tests) do not share
counters; it carries the process collector too (CPU, RSS, open file descriptors), which is what
a soak test and an operator look at first.
"""

from __future__ import annotations

import threading

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

from deployer.agent.serving.timing import LATENCY_BUCKETS

__all__ = ["CONTENT_TYPE", "AgentMetrics"]

# No `_created` series beside every counter: noise on /metrics that nothing here reads.
disable_created_metrics()

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Ignored request fields get a series each up to this many names (clients choose the names, so
# they must not grow /metrics without bound); the rest count as "other".
IGNORED_FIELD_NAMES = 64


class AgentMetrics:
    """The metrics `sits-agent serve` exposes on /metrics."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        self.running = Gauge("sits_requests_running", "Requests generating now.", registry=r)
        self.waiting = Gauge("sits_requests_waiting", "Requests admitted and waiting for a slot.", registry=r)
        self.requests = Counter(
            "sits_requests",
            "Requests answered, by endpoint and HTTP status (499: the client left first).",
            ("endpoint", "status"),
            registry=r,
        )
        self.cancelled = Counter(
            "sits_requests_cancelled",
            "Generations stopped early, by reason (disconnect: the client left; stalled: it stopped "
            "reading for longer than stall_timeout_s).",
            ("reason",),
            registry=r,
        )
        # Per request: labelled by the LoRA adapter that answered ("" for the base model).
        by_adapter = ("adapter",)
        self.prompt_tokens = Counter(
            "sits_prompt_tokens", "Prompt tokens processed, by adapter.", by_adapter, registry=r
        )
        self.generation_tokens = Counter(
            "sits_generation_tokens", "Tokens generated, by adapter.", by_adapter, registry=r
        )
        self.ttft = Histogram(
            "sits_time_to_first_token_seconds",
            "Time from request to first token, by adapter.",
            by_adapter,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "sits_e2e_request_latency_seconds",
            "Time from request to last token, by adapter.",
            by_adapter,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.model_info = Gauge(
            "sits_model_info",
            "The active model (value 1).",
            ("model", "version", "quantization", "kernel", "engine", "device"),
            registry=r,
        )
        self.adapters_loaded = Gauge(
            "sits_adapter_info",
            "LoRA adapters known on the serving model (value 1 loaded, 0 unloaded for the memory budget).",
            ("adapter", "version"),
            registry=r,
        )
        self.reloads = Counter(
            "sits_reloads", "Model reloads (hot swaps), by result.", ("result",), registry=r
        )
        self.rollbacks = Counter(
            "sits_rollbacks", "Returns to a previous model, by result.", ("result",), registry=r
        )
        self.auth_failures = Counter(
            "sits_auth_failures",
            "Requests refused for a missing or wrong API key, by reason.",
            ("reason",),
            registry=r,
        )
        self.ignored_fields = Counter(
            "sits_ignored_request_fields",
            "Request fields the agent does not use and ignored, by name (`other` past the first "
            f"{IGNORED_FIELD_NAMES} names).",
            ("field",),
            registry=r,
        )
        self._ignored_names: set[str] = set()
        self._ignored_lock = threading.Lock()
        self.connections = Gauge("sits_http_connections", "Open HTTP connections.", registry=r)
        self.connections_closed = Counter(
            "sits_http_connections_closed",
            "Connections the server closed itself, by reason (evicted: the longest idle one, to make "
            "room; header_timeout: headers not complete within header_timeout_s; refused: full).",
            ("reason",),
            registry=r,
        )

    def ignored_field(self, name: str) -> bool:
        """Count one ignored request field; True the first time this name is seen (log it then)."""
        with self._ignored_lock:
            new = name not in self._ignored_names and len(self._ignored_names) < IGNORED_FIELD_NAMES
            if new:
                self._ignored_names.add(name)
            known = name in self._ignored_names
        self.ignored_fields.labels(field=name if known else "other").inc()
        return new

    def set_adapters(self, adapters: list[tuple[str, str, bool]]) -> None:
        """Set sits_adapter_info to these (name, version, loaded) adapters, and only these."""
        self.adapters_loaded.clear()
        for name, version, loaded in adapters:
            self.adapters_loaded.labels(adapter=name, version=version).set(1 if loaded else 0)

    def render(self) -> bytes:
        """The /metrics body in the text exposition format."""
        return generate_latest(self.registry)

    def value(self, name: str, **labels: str) -> float:
        """The current value of one sample (0 when it was never recorded), e.g.
        value("sits_requests_total", endpoint="/v1/models", status="200")."""
        found = self.registry.get_sample_value(name, labels)
        return 0.0 if found is None else found
