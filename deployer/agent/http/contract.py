"""What the routes need of the server: the AgentApp protocol (the server implements it; no route
module imports the server)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from deployer.agent.http.auth import KeyRing
from deployer.agent.http.metrics import AgentMetrics
from deployer.agent.ota.store import DeviceStore
from deployer.agent.runtime.hotswap import ModelManager, SwapResult
from deployer.agent.serving.generate import TokenSource
from deployer.agent.settings import AgentSettings

__all__ = ["AgentApp"]


class AgentApp(Protocol):
    """What the routes need of the server (the server implements it; routes never import it)."""

    settings: AgentSettings
    metrics: AgentMetrics
    manager: ModelManager
    source: TokenSource
    store: DeviceStore
    keyring: KeyRing

    def reload(
        self, artifact_dir: Path | None = None, version: str | None = None, *, reason: str = "reload"
    ) -> SwapResult: ...
