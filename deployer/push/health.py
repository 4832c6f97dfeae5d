"""Health checks of one device's agent, run on the device over its transport (the agent listens on
loopback only): readiness on a version, smoke prompts within the latency budget, and the samples
the canary analysis judges (`deployer.push.rollout.judge`).

Raises AgentError when a device fails a check; TransportError when it cannot be reached.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from deployer.config.models import Health
from deployer.errors import AgentError, SitsError
from deployer.push.facts import DeviceSite, HttpReply, agent_request
from deployer.push.rollout import MetricsSnapshot, Sample
from deployer.transport import Transport

__all__ = [
    "health_gate",
    "parse_metrics",
    "sample",
    "scrape_metrics",
    "serving_version",
    "smoke",
    "wait_ready",
]

SMOKE_MAX_TOKENS = 4
_POLL_S = 0.5


def serving_version(site: DeviceSite, transport: Transport) -> str | None:
    """The version the agent serves now, or None when it is not ready (or not running)."""
    reply = agent_request(site, transport, "GET", "/readyz", timeout=5)
    return reply.json().get("version") if reply.status == 200 else None


def wait_ready(
    site: DeviceSite,
    transport: Transport,
    version: str,
    timeout_s: float,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Wait until the agent is ready on `version`. Raises AgentError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        reply = agent_request(site, transport, "GET", "/readyz", timeout=5)
        if reply.status == 200 and reply.json().get("version") == version:
            return
        if time.monotonic() > deadline:
            raise AgentError(
                f"{site.name}: not ready on {version} within {timeout_s:g}s "
                f"(/readyz said {reply.status} {reply.body.strip()[:120]})",
                hint=f"see `sits-deployer logs {site.name}`",
            )
        sleep(_POLL_S)


def smoke(site: DeviceSite, transport: Transport, prompt: str, budget_ms: int) -> HttpReply:
    """Send one smoke prompt (greedy, a few tokens) to the active model; return the reply and time."""
    models = agent_request(site, transport, "GET", "/v1/models", timeout=10).json().get("data") or [{}]
    body = {
        "model": models[0].get("id", ""),
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": SMOKE_MAX_TOKENS,
        "temperature": 0,
    }
    timeout = max(10.0, budget_ms / 1000 * 2)
    return agent_request(site, transport, "POST", "/v1/chat/completions", body, timeout=timeout)


def health_gate(
    health: Health,
    site: DeviceSite,
    transport: Transport,
    version: str,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Ready on `version` within the readiness timeout, then every smoke prompt answered within the
    latency budget. Returns the slowest smoke latency in ms. Raises AgentError."""
    wait_ready(site, transport, version, health.readiness_timeout.total_seconds(), sleep)
    slowest = 0.0
    for prompt in health.smoke_prompts:
        reply = smoke(site, transport, prompt, health.latency_budget_ms)
        if reply.status != 200:
            raise AgentError(
                f"{site.name}: smoke prompt {prompt!r} answered {reply.status}: {reply.body[:200]}"
            )
        if reply.elapsed_ms > health.latency_budget_ms:
            raise AgentError(
                f"{site.name}: smoke prompt {prompt!r} took {reply.elapsed_ms:.0f} ms, "
                f"over the {health.latency_budget_ms} ms budget",
                hint="raise health.latency_budget_ms or look at the device's load",
            )
        slowest = max(slowest, reply.elapsed_ms)
    return slowest


def scrape_metrics(site: DeviceSite, transport: Transport) -> MetricsSnapshot:
    """The request counters from the agent's /metrics (zeros when it does not answer)."""
    try:
        reply = agent_request(site, transport, "GET", "/metrics", timeout=10)
    except SitsError:
        return MetricsSnapshot()
    return parse_metrics(reply.body) if reply.status == 200 else MetricsSnapshot()


def parse_metrics(text: str) -> MetricsSnapshot:
    """The agent's /metrics, through prometheus_client's parser: all requests and those answered 5xx
    (`sits_requests_total{endpoint,status}`), and the fallback's answers, recent fallbacks and edge
    status (`sits_answers_total{served_by}`, `sits_fallbacks_last_5m`, `sits_edge_status{status}`).
    Text that does not parse counts as no data."""
    requests = errors = answers = fallbacks = 0.0
    recent: float | None = None
    edge: str | None = None
    try:
        for family in text_string_to_metric_families(text):
            for sample_ in family.samples:
                name, labels, value = sample_.name, sample_.labels, sample_.value
                if name == "sits_requests_total":
                    requests += value
                    errors += value if labels.get("status", "").startswith("5") else 0.0
                elif name == "sits_answers_total":
                    answers += value
                    fallbacks += value if labels.get("served_by") == "upstream" else 0.0
                elif name == "sits_fallbacks_last_5m":
                    recent = value
                elif name == "sits_edge_status" and value == 1:
                    edge = labels.get("status")
    except ValueError:
        return MetricsSnapshot()
    return MetricsSnapshot(requests, errors, answers, fallbacks, recent, edge)


def sample(health: Health, site: DeviceSite, transport: Transport, before: MetricsSnapshot) -> Sample:
    """What the analysis judges at the end of a window that started with the `before` scrape."""
    try:
        ready = serving_version(site, transport) is not None
        reply = smoke(site, transport, health.smoke_prompts[0], health.latency_budget_ms)
        smoke_ms = reply.elapsed_ms if reply.status == 200 else None
    except SitsError:
        ready, smoke_ms = False, None
    return Sample(site.name, ready, smoke_ms, before, scrape_metrics(site, transport))
