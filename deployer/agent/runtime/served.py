"""A served model: a loaded model as the server uses it, with its engine, the scheduler that owns
the engine, and a lease count, so that a swap knows when the old model is free. ("slot" means only
a sequence's row of an engine's KV cache.)

A request leases the served model while it is tokenized and submitted to the scheduler (and a swap's
smoke test while it runs); from then on the scheduler owns it. A retired one takes no new lease;
once the last is returned its scheduler drains the requests it already has (running and
waiting), then unloads the engine on the engine thread.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

from deployer.agent.engines.base import Engine, EngineText
from deployer.agent.notify import lifecycle_event
from deployer.agent.runtime.adapters import AdapterSet
from deployer.agent.runtime.scheduler import Scheduler
from deployer.agent.types import EngineInfo
from deployer.errors import AgentError

__all__ = ["ServedModel"]


class ServedModel:
    """One loaded engine, its scheduler, and a lease count."""

    def __init__(
        self,
        engine: Engine,
        scheduler: Scheduler,
        artifact_dir: Path,
        version: str,
        adapters: AdapterSet | None = None,
    ) -> None:
        """`adapters`: the LoRA adapters loaded on it (none by default)."""
        self.adapters = adapters if adapters is not None else AdapterSet(scheduler, None, version)
        # Request threads tokenize and describe through it; what computes is the scheduler's.
        self.engine: EngineText = engine
        self.scheduler = scheduler
        self.artifact_dir = artifact_dir
        self.version = version
        # The store's version name is the device's truth, whatever the artifact calls itself.
        self.info: EngineInfo = dataclasses.replace(engine.describe(), version=version)
        self._leases_lock = threading.Lock()
        self._leases = 0
        self._retired = False
        self.unloaded = threading.Event()

    def describe(self) -> EngineInfo:
        """`info` as the engine gives it now; `info` itself once the engine cannot say (unloaded)."""
        try:
            return dataclasses.replace(self.engine.describe(), version=self.version)
        except AgentError:
            return self.info

    def acquire(self) -> bool:
        """Take a lease; False once it is retired."""
        with self._leases_lock:
            if self._retired:
                return False
            self._leases += 1
            return True

    def release(self) -> None:
        """Return a lease; the last one returned after retirement starts the unload."""
        with self._leases_lock:
            self._leases -= 1
            unload = self._retired and self._leases == 0
        if unload:
            self._unload()

    def retire(self) -> None:
        """No new leases; unload once idle (at once if no request holds a lease)."""
        with self._leases_lock:
            unload = not self._retired and self._leases == 0
            self._retired = True
        if unload:
            self._unload()

    def _unload(self) -> None:
        # Does not wait: the caller may be a request's worker thread or a swap. The scheduler lets
        # its last requests finish, then unloads on the engine thread and sets `unloaded`.
        self.scheduler.close(final=self._finish_unload)

    def _finish_unload(self) -> None:
        try:
            self.scheduler.engine.unload()  # on the engine thread: the scheduler's `final`
        finally:
            self.unloaded.set()
            lifecycle_event("unloaded", version=self.version, reason="no requests left on it")
