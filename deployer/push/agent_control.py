"""The executor's seam to a device's agent: start or reload it, the health gate, metrics samples.

`AgentControl` is everything the executor asks of a running agent, behind one narrow interface,
so that tests drive the executor with a simulated fleet (tests/push/simulator.py) instead of
patching its internals. `RemoteAgent` is the real one: the agent's HTTP API called on the device
over its transport (deployer.push.health) and its process started by deployer.push.bootstrap.

Every method raises AgentError when the agent fails a check and TransportError when the device
cannot be reached.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from deployer.config.models import Health
from deployer.push.bootstrap import agent_running, ensure_serving, start_agent
from deployer.push.facts import DeviceSite
from deployer.push.health import health_gate, sample, scrape_metrics, serving_version
from deployer.push.rollout import MetricsSnapshot, Sample
from deployer.transport import Transport

__all__ = ["AgentControl", "RemoteAgent"]


class AgentControl(Protocol):
    """What the executor asks of one device's agent."""

    def serving_version(self, site: DeviceSite, transport: Transport) -> str | None:
        """The version it serves now, or None when it is not ready."""
        ...

    def ensure_serving(self, site: DeviceSite, transport: Transport, version: str, *, systemd: bool) -> None:
        """Start it, or have it reload, until it serves `version`."""
        ...

    def restart_if_running(self, site: DeviceSite, transport: Transport, *, systemd: bool) -> None:
        """Restart it when it runs (it reads its files only at start)."""
        ...

    def health_gate(self, site: DeviceSite, transport: Transport, version: str) -> float:
        """Ready on `version`, then the smoke prompts within budget; the slowest latency in ms."""
        ...

    def scrape(self, site: DeviceSite, transport: Transport) -> MetricsSnapshot:
        """Its request counters now (zeros when it does not answer)."""
        ...

    def sample(self, site: DeviceSite, transport: Transport, before: MetricsSnapshot) -> Sample:
        """What a canary analysis window that began with `before` judges."""
        ...


@dataclass(frozen=True)
class RemoteAgent:
    """The agent of a real device, through its HTTP API on the device (loopback only)."""

    health: Health
    sleep: Callable[[float], None] = time.sleep

    @property
    def _timeout_s(self) -> float:
        return self.health.readiness_timeout.total_seconds()

    def serving_version(self, site: DeviceSite, transport: Transport) -> str | None:
        """See AgentControl."""
        return serving_version(site, transport)

    def ensure_serving(self, site: DeviceSite, transport: Transport, version: str, *, systemd: bool) -> None:
        """See AgentControl."""
        ensure_serving(site, transport, version, systemd=systemd, timeout_s=self._timeout_s)

    def restart_if_running(self, site: DeviceSite, transport: Transport, *, systemd: bool) -> None:
        """See AgentControl."""
        if agent_running(site, transport):
            start_agent(site, transport, systemd=systemd, timeout_s=self._timeout_s)

    def health_gate(self, site: DeviceSite, transport: Transport, version: str) -> float:
        """See AgentControl."""
        return health_gate(self.health, site, transport, version, self.sleep)

    def scrape(self, site: DeviceSite, transport: Transport) -> MetricsSnapshot:
        """See AgentControl."""
        return scrape_metrics(site, transport)

    def sample(self, site: DeviceSite, transport: Transport, before: MetricsSnapshot) -> Sample:
        """See AgentControl."""
        return sample(self.health, site, transport, before)
