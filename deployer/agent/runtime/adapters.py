"""The LoRA adapters loaded on one served model: by name, each a version of the device's adapter
store (ota/adapters.py), loaded and unloaded at runtime on the engine thread, the base untouched.

A request names an adapter by its model id (its name); `use` gives the engine key it runs under,
and the request is submitted inside `use`, under the set's lock. A reload loads the new version
under a new key first, then points the name at it under the same lock, so a request is either
submitted on the old key before the switch or on the new one after it; the old key is unloaded
once no running or waiting request uses it (`Scheduler.run_when_unused`): in-flight requests
finish on the version they started with.

An adapter version whose load killed the agent CRASH_LOOP_LOADS times (a crash loop: each
start-up loads it again) is refused at the next start and rolled back like one that fails to load,
so the base comes up serving; the store counts loads begun and never finished (ota/adapters.py).
Two, not one: a power cut mid-load is no reason to roll back, and two fit systemd's
StartLimitBurst=3, before its OnFailure= would roll back the base, which is not at fault.

Loaded adapters fit a memory budget (agent.yaml's `adapter_memory_mb`): loading one past it
unloads the least recently used others first. An unloaded adapter stays known (listed, and
loaded again by the next request that names it) while the store still has it installed.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from deployer.agent.notify import lifecycle_event
from deployer.agent.ota.adapters import AdapterRecord, AdapterStore
from deployer.agent.runtime.scheduler import Scheduler
from deployer.core.lora import LoraAdapter, read_adapter
from deployer.core.memory import lora_bytes
from deployer.errors import AgentError, SitsError

__all__ = [
    "CRASH_LOOP_LOADS",
    "AdapterSet",
    "AdapterSource",
    "LoadedAdapter",
    "OtherBase",
    "adapter_memory_bytes",
]

_log = logging.getLogger("sits.agent")
CRASH_LOOP_LOADS = 2  # loads of one adapter version that killed the agent before it is refused


class OtherBase(AgentError):
    """The adapter was made for another base artifact than the model served (after a base update,
    until its version for the new base is installed): not a fault of the adapter's own."""


@dataclass(frozen=True)
class AdapterSource:
    """Where a served model finds its adapters: the device's adapter store, the id of the base
    artifact a version of the model was released as (None: not known, e.g. served from a bare
    directory; then only the engine's shape checks guard the load), and the memory budget."""

    store: AdapterStore
    base_artifact_id: Callable[[str], str | None]
    budget_bytes: int


@dataclass(frozen=True)
class LoadedAdapter:
    """One adapter version loaded on the engine under `key` (unique per load)."""

    name: str
    version: str
    artifact_id: str
    key: str
    nbytes: int


def adapter_memory_bytes(adapter: LoraAdapter) -> int:
    """What an adapter holds on the engine: its factors in fp32 (the torch engine's low-rank path)."""
    return lora_bytes(sum(a.size + b.size for a, b in adapter.tensors.values()))


class AdapterSet:
    """The adapters of one served model (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, source: AdapterSource | None, base_version: str) -> None:
        self._scheduler = scheduler
        self._source = source
        self._base_version = base_version
        self._lock = threading.Lock()  # the name -> key map, and submissions under a key
        self._load_lock = threading.Lock()  # one load (and its evictions) at a time
        self._loaded: OrderedDict[str, LoadedAdapter] = OrderedDict()  # least recently used first
        self._evicted: dict[str, LoadedAdapter] = {}  # unloaded for the budget; loaded again on use
        self._serial = itertools.count(1)

    def loaded(self) -> list[LoadedAdapter]:
        """The adapters loaded now, by name."""
        with self._lock:
            return sorted(self._loaded.values(), key=lambda a: a.name)

    def known(self) -> list[tuple[LoadedAdapter, bool]]:
        """Every adapter a request may name, with whether it is loaded now (False: unloaded for
        the memory budget, loaded again by the next request naming it)."""
        with self._lock:
            listed = [(a, True) for a in self._loaded.values()] + [(a, False) for a in self._evicted.values()]
        return sorted(listed, key=lambda pair: pair[0].name)

    def get(self, name: str) -> LoadedAdapter | None:
        """The adapter loaded under `name`, or None."""
        with self._lock:
            return self._loaded.get(name)

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[LoadedAdapter | None]:
        """The adapter a request naming `name` runs with (None: `name` is no adapter here), held
        while the request is submitted: submit inside the block. An adapter unloaded for the
        memory budget is loaded again first."""
        with self._lock:
            evicted = name in self._evicted and name not in self._loaded
        if evicted:
            self._load_again(name)
        with self._lock:
            adapter = self._loaded.get(name)
            if adapter is not None:
                self._loaded.move_to_end(name)
            yield adapter

    def reload(self, name: str) -> LoadedAdapter | None:
        """Load the store's current version of `name` (its previous version keeps serving the
        requests that started on it), or unload it when the store has none; the adapter loaded
        now (None: unloaded). AgentError (the old version still loaded) when it cannot load."""
        record = self._source.store.record(name) if self._source is not None else None
        if record is None:
            self.unload(name)
            return None
        return self.load(record)

    def load(self, record: AdapterRecord) -> LoadedAdapter:
        """Load one installed adapter version (see `reload`)."""
        source = self._require_source()
        engine = self._scheduler.engine
        if not engine.serves_adapters:
            raise AgentError(
                f"the {type(engine).__name__} serves no LoRA adapters",
                hint="serve the model with the torch or llama.cpp engine (docs/openai-api.md, LoRA adapters)",
            )
        adapter = read_adapter(record.path)
        if adapter.name != record.name:
            raise AgentError(
                f"{record.path}: holds adapter {adapter.name!r}, installed as {record.name!r}",
                hint="reinstall the adapter",
            )
        crashed = source.store.crashed_loads(record.name, record.artifact_id)
        if crashed >= CRASH_LOOP_LOADS:
            raise AgentError(
                f"adapter {record.name} {record.version}: the agent died {crashed} times while "
                "loading it (a crash loop); refused",
                hint="release a fixed version of the adapter; the base keeps serving",
            )
        base = source.base_artifact_id(self._base_version)
        if base is not None and adapter.base_artifact_id != base:
            raise OtherBase(
                f"adapter {record.name} {record.version} was made for base artifact "
                f"{adapter.base_artifact_id[:16]}..., but model version {self._base_version} "
                f"is {base[:16]}...",
                hint="install the adapter version released for this base model",
            )
        nbytes = adapter_memory_bytes(adapter)
        if nbytes > source.budget_bytes:
            raise AgentError(
                f"adapter {record.name} {record.version} needs {nbytes / 2**20:.1f} MiB, above "
                f"adapter_memory_mb ({source.budget_bytes / 2**20:.1f} MiB)",
                hint="raise adapter_memory_mb in agent.yaml",
            )
        key = f"{record.name}@{record.artifact_id[:16]}#{next(self._serial)}"
        loaded = LoadedAdapter(record.name, record.version, record.artifact_id, key, nbytes)
        with self._load_lock:
            self._make_room(record.name, nbytes, source.budget_bytes)
            source.store.begin_load(record.name, record.artifact_id)
            try:
                self._scheduler.run(lambda: engine.load_adapter(key, adapter, record.path))
            finally:
                source.store.end_load(record.name, record.artifact_id)
            with self._lock:
                old = self._loaded.pop(record.name, None)
                self._evicted.pop(record.name, None)
                self._loaded[record.name] = loaded
            if old is not None:
                self._retire(old)
        lifecycle_event(
            "adapter-loaded", version=self._base_version, reason=f"{record.name} {record.version}"
        )
        return loaded

    def load_installed(self) -> None:
        """Load every adapter the store has installed (at start-up and after a swap). One that fails
        to load is rolled back to its previous version in the store, which is loaded instead, except
        one made for another base (kept as it is); the base serves whatever happens."""
        if self._source is None:
            return
        store = self._source.store
        installed = store.installed()
        if installed and not self._scheduler.engine.serves_adapters:
            # Not the adapters' fault: no rollback; they load once an engine that serves them does.
            engine = type(self._scheduler.engine).__name__
            lifecycle_event(
                "adapters-skipped", version=self._base_version, reason=f"the {engine} serves no LoRA adapters"
            )
            return
        for name in installed:
            # Any failure of one adapter (foreign code included) must leave the base serving.
            try:
                self.reload(name)
            except OtherBase as exc:
                self._failed(name, exc)  # kept installed: its version for this base comes later
                continue
            except Exception as exc:
                self._failed(name, exc)
                restored = store.rollback(name)
                if restored is None:
                    continue
                try:
                    self.load(restored)
                except Exception as again:
                    self._failed(name, again)

    def unload(self, name: str) -> bool:
        """Unload `name` (its running requests finish on it first); False when it was not loaded."""
        with self._lock:
            old = self._loaded.pop(name, None)
            evicted = self._evicted.pop(name, None)
        if old is not None:
            self._retire(old)
            lifecycle_event("adapter-unloaded", version=self._base_version, reason=name)
        return old is not None or evicted is not None

    def nbytes(self) -> int:
        """Bytes the loaded adapters hold (by the budget's count)."""
        with self._lock:
            return sum(a.nbytes for a in self._loaded.values())

    def _make_room(self, name: str, nbytes: int, budget: int) -> None:
        """Unload the least recently used other adapters until `nbytes` more fit (load lock held)."""
        with self._lock:
            used = sum(a.nbytes for n, a in self._loaded.items() if n != name)
            victims = []
            for other, adapter in self._loaded.items():
                if used + nbytes <= budget:
                    break
                if other != name:
                    victims.append(adapter)
                    used -= adapter.nbytes
            for adapter in victims:
                del self._loaded[adapter.name]
                self._evicted[adapter.name] = adapter
        for adapter in victims:
            _log.info("adapter %s unloaded: least recently used past adapter_memory_mb", adapter.name)
            self._retire(adapter)

    def _load_again(self, name: str) -> None:
        """Load an evicted adapter from the store (its current version there)."""
        try:
            self.reload(name)
        except Exception as exc:
            with self._lock:
                self._evicted.pop(name, None)  # gone or broken: requests naming it get 404
            self._failed(name, exc)

    def _failed(self, name: str, exc: Exception) -> None:
        why = exc.message if isinstance(exc, SitsError) else f"{type(exc).__name__}: {exc}"
        lifecycle_event("adapter-failed", version=self._base_version, reason=f"{name}: {why}")

    def _retire(self, adapter: LoadedAdapter) -> None:
        """Unload `adapter`'s key once no request uses it."""
        engine = self._scheduler.engine
        self._scheduler.run_when_unused(adapter.key, lambda: engine.unload_adapter(adapter.key))

    def _require_source(self) -> AdapterSource:
        if self._source is None:
            raise AgentError("this agent has no adapter store", hint="serve from a device store (--root)")
        return self._source
