"""Zero-downtime model swaps: load the new model beside the old, warm it up, smoke-test it within the
latency budget, then swap one reference. Each model has its own scheduler (engine thread, batch); a
request is submitted to the scheduler of the model active when it arrived, so in-flight sequences
finish in the old model's batch while new requests start in the new one's; the old scheduler
drains its running and waiting requests, then unloads its engine on its own thread.

If loading, warm-up or the smoke test fails, the old model keeps serving and the failure is returned
(and logged) with its reason. When memory cannot hold two models, the `unload-first` policy drains and
unloads the old one first; requests meanwhile get 503 + Retry-After, and a failed load brings the old
one back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

from deployer.agent.engines.base import Engine, EngineText
from deployer.agent.notify import lifecycle_event
from deployer.agent.runtime.adapters import AdapterSet, AdapterSource, LoadedAdapter
from deployer.agent.runtime.scheduler import (
    Arrivals,
    Generation,
    Scheduler,
    SchedulerCounts,
    SchedulerLimits,
)
from deployer.agent.runtime.served import ServedModel
from deployer.agent.settings import AgentSettings
from deployer.agent.types import ChatMessage, EngineInfo, SamplingParams
from deployer.core.gguf_io import GGUF_FILE, read_gguf_header
from deployer.core.manifest import INTEGER_SCHEMES, read_manifest
from deployer.core.memory import (
    FLOAT_BYTES,
    ModelShape,
    draft_bytes,
    engine_bytes,
    kv_bytes_per_position,
    torch_cpu_tables_delta,
)
from deployer.errors import AgentError, FormatError

__all__ = ["ModelManager", "SmokeFailed", "SwapResult", "Unavailable"]

Policy = Literal["side-by-side", "unload-first"]
Phase = Literal["load", "warmup", "smoke", "done"]
_DEFAULT_RETRY_AFTER_S = 5


class Unavailable(Exception):
    """No model can take requests now (before the first load, or during an unload-first gap)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class SmokeFailed(Exception):
    """An adapter's smoke prompt was too slow or did not answer as expected (the reason says)."""


class _SwapFailed(Exception):
    def __init__(self, phase: Phase, reason: str) -> None:
        super().__init__(reason)
        self.phase = phase
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class SwapResult:
    """The outcome of one swap: what is active now, and if it failed, where and why."""

    ok: bool
    version: str  # the version asked for
    active_version: str | None  # the version serving afterwards
    previous_version: str | None  # the version that served before
    policy: Policy
    phase: Phase  # "done" on success, else the phase that failed
    reason: str
    duration_s: float
    smoke_ms: tuple[float, ...] = ()
    restored: bool = False  # unload-first only: the old model was loaded again after a failure

    def to_dict(self) -> dict:
        """JSON-ready form (for /admin/reload and `sits-agent reload --output json`)."""
        return dataclasses.asdict(self)


class ModelManager:
    """The active model, the previous one's description, and the swap between them."""

    def __init__(
        self,
        engine_factory: Callable[[], Engine],
        settings: AgentSettings,
        on_swap: Callable[[SwapResult, str], None] | None = None,
        on_counts: Callable[[SchedulerCounts], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        adapters: AdapterSource | None = None,
        available_memory: Callable[[], int | None] | None = None,
    ) -> None:
        """`on_counts(counts)` receives the running and waiting requests of every loaded model
        (the serving one and one still draining) whenever they change, e.g. to set gauges. `clock`
        times the readiness deadline and the smoke prompts (tests pass a fake one). `adapters`:
        where each loaded model finds the LoRA adapters it loads (none without).
        `available_memory()` is the memory a new model may take now (default: MemAvailable; None:
        unknown), what swap_policy auto weighs a side-by-side load against."""
        self._adapters = adapters
        self._available_memory = available_memory or _available_memory_bytes
        self._factory = engine_factory
        self._clock = clock
        self._settings = settings
        self._on_swap = on_swap or (lambda result, reason: None)
        self._on_counts = on_counts or (lambda counts: None)
        self._schedulers: list[Scheduler] = []  # every scheduler whose thread has not stopped
        self.arrivals = Arrivals()  # requests on their way to the active model's scheduler
        self._counts_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._swap_lock = threading.Lock()
        self._active: ServedModel | None = None
        self._previous: ServedModel | None = None
        self._in_gap = False  # True while an unload-first swap has no model loaded
        self._last_load_s = float(_DEFAULT_RETRY_AFTER_S)

    # -- serving ---------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """A warmed, smoke-tested model is active."""
        return self._active is not None

    @property
    def swapping(self) -> bool:
        """A swap is in progress."""
        return self._swap_lock.locked()

    def active_info(self) -> EngineInfo | None:
        """The serving model's description."""
        served = self._active
        return served.info if served else None

    def active_status(self) -> EngineInfo | None:
        """The serving model's description as its engine gives it now: what changes while it
        serves (a background compile that ends, the draft's acceptance) shows; the rest equals
        `active_info`."""
        served = self._active
        return served.describe() if served else None

    def active_adapters(self) -> AdapterSet | None:
        """The LoRA adapters of the serving model (None: no model serves)."""
        served = self._active
        return served.adapters if served else None

    def reload_adapter(self, name: str) -> LoadedAdapter | None:
        """Load the store's current version of adapter `name` on the serving model, or unload it
        when none is installed (see AdapterSet.reload); Unavailable when no model serves."""
        with self.lease() as served:
            return served.adapters.reload(name)

    def previous_info(self) -> EngineInfo | None:
        """The description of the model that served before the last swap (no longer loaded)."""
        served = self._previous
        return served.info if served else None

    @contextlib.contextmanager
    def lease(self) -> Iterator[ServedModel]:
        """The active model, held while a request is submitted to its scheduler (which then owns
        it until it ends). Raises Unavailable if there is none."""
        while True:
            with self._state_lock:
                served = self._active
            if served is None:
                raise Unavailable(self._unavailable_reason(), self._retry_after_s())
            if served.acquire():
                break
            # Lost a race with a swap that retired this model: the new one is active now.
        try:
            yield served
        finally:
            served.release()

    def counts(self) -> SchedulerCounts:
        """Requests running and waiting on every loaded model (the active one and any draining)."""
        with self._counts_lock:
            counts = [s.counts() for s in self._schedulers]
        return SchedulerCounts(sum(c.running for c in counts), sum(c.waiting for c in counts))

    def _counts_changed(self) -> None:
        with self._counts_lock:
            self._schedulers = [s for s in self._schedulers if not s.stopped]
            counts = [s.counts() for s in self._schedulers]
            self._on_counts(SchedulerCounts(sum(c.running for c in counts), sum(c.waiting for c in counts)))

    def _unavailable_reason(self) -> str:
        if self._in_gap:
            return "the model is being replaced (unload-first policy); retry shortly"
        if self.swapping:
            return "the model is loading; retry shortly"
        return "no model is loaded: the last load failed; see the agent's journal"

    def _retry_after_s(self) -> int:
        return max(1, math.ceil(self._last_load_s))

    # -- swapping --------------------------------------------------------------------------------

    def swap_to(self, artifact_dir: Path, version: str, *, reason: str = "reload") -> SwapResult:
        """Make `version` (loaded from `artifact_dir`) the active model, or keep the old one and say why.

        One swap runs at a time; a second caller waits for the first to finish.
        """
        with self._swap_lock:
            policy = self._choose_policy(artifact_dir)
            lifecycle_event("swap-started", version=version, reason=reason, policy=policy)
            if policy == "side-by-side":
                result = self._swap_side_by_side(artifact_dir, version)
            else:
                result = self._swap_unload_first(artifact_dir, version)
            lifecycle_event(
                "swap-succeeded" if result.ok else "swap-failed",
                version=version,
                reason=result.reason,
                phase=result.phase,
                active=result.active_version,
                duration_s=round(result.duration_s, 3),
            )
            self._on_swap(result, reason)
            return result

    def cancel_all(self) -> None:
        """Cancel every request of every loaded model (at shutdown)."""
        with self._counts_lock:
            schedulers = list(self._schedulers)
        for scheduler in schedulers:
            scheduler.cancel_all()

    def shutdown(self) -> None:
        """Retire the active model and wait (up to drain_timeout_s) until its engine is unloaded."""
        with self._state_lock:
            served, self._active = self._active, None
        if served is not None:
            served.retire()
            self._await_unloaded(served)

    def _swap_side_by_side(self, artifact_dir: Path, version: str) -> SwapResult:
        started = self._clock()
        # Memory holds at most two models: the one before the last swap must be gone first.
        self._await_unloaded(self._previous)
        old = self._active
        try:
            served, smoke_ms = self._prepare(artifact_dir, version, started)
        except _SwapFailed as failed:
            return self._result(
                False, version, old, old, "side-by-side", failed.phase, failed.reason, started
            )
        self._install(served, old)
        if old is not None:
            old.retire()  # unloads when its in-flight requests have finished
        return self._result(True, version, served, old, "side-by-side", "done", "swapped", started, smoke_ms)

    def _swap_unload_first(self, artifact_dir: Path, version: str) -> SwapResult:
        started = self._clock()
        old = self._active
        with self._state_lock:
            self._in_gap = True
            self._active = None
        try:
            if old is not None:
                old.retire()
                self._await_unloaded(old)
            try:
                served, smoke_ms = self._prepare(artifact_dir, version, started)
            except _SwapFailed as failed:
                restored = self._restore(old)
                return self._result(
                    False,
                    version,
                    restored,
                    old,
                    "unload-first",
                    failed.phase,
                    failed.reason,
                    started,
                    restored=restored is not None,
                )
            self._install(served, old)
            return self._result(
                True, version, served, old, "unload-first", "done", "swapped", started, smoke_ms
            )
        finally:
            with self._state_lock:
                self._in_gap = False

    def _await_unloaded(self, served: ServedModel | None) -> None:
        """Wait (up to drain_timeout_s) for a retired model's last requests to finish and free it."""
        if served is not None and not served.unloaded.wait(self._settings.drain_timeout_s):
            lifecycle_event(
                "drain-timeout",
                version=served.version,
                reason=f"requests still running on it after {self._settings.drain_timeout_s} s",
            )

    def _restore(self, old: ServedModel | None) -> ServedModel | None:
        """Load the model an unload-first swap removed, after the new one failed."""
        if old is None:
            return None
        try:
            served, _ = self._prepare(old.artifact_dir, old.version, self._clock())
        except _SwapFailed as failed:
            lifecycle_event("restore-failed", version=old.version, reason=failed.reason)
            return None
        self._install(served, self._previous)
        lifecycle_event("restored", version=old.version, reason="the new version failed to load")
        return served

    def _install(self, served: ServedModel, previous: ServedModel | None) -> None:
        with self._state_lock:
            self._active = served
            self._previous = previous

    def _prepare(
        self, artifact_dir: Path, version: str, started: float
    ) -> tuple[ServedModel, tuple[float, ...]]:
        """Load, warm up and smoke-test a new engine on its own scheduler; raise _SwapFailed (after
        unloading it) on failure.

        Everything runs on the new engine's thread; the smoke prompts go through the scheduler, the
        very path requests take.
        """
        engine = self._factory()
        scheduler = Scheduler(
            engine,
            self._limits(),
            name=f"engine-{version}",
            on_change=self._counts_changed,
            arrivals=self.arrivals,
        )
        with self._counts_lock:
            self._schedulers.append(scheduler)
        phase: Phase = "load"
        try:
            scheduler.run(lambda: engine.load(artifact_dir))
            _loaded_event(engine, version)
            self._check_deadline(started, phase)
            phase = "warmup"
            scheduler.run(engine.warmup)
            self._check_deadline(started, phase)
            phase = "smoke"
            smoke_ms = self._smoke(engine, scheduler.submit)
            self._check_deadline(started, phase)
            adapters = AdapterSet(scheduler, self._adapters, version)
            adapters.load_installed()  # before it serves: a request may name any of them
            served = ServedModel(engine, scheduler, artifact_dir, version, adapters)
        except Exception as exc:
            # Any failure of a new model (including a crash in foreign code) must leave the old serving.
            scheduler.close(final=lambda: _quietly_unload(engine))
            # Freed before anything loads next: unload-first restores the old model right after.
            scheduler.join(self._settings.drain_timeout_s)
            if isinstance(exc, _SwapFailed):
                raise
            raise _SwapFailed(phase, f"{phase} failed: {type(exc).__name__}: {exc}") from exc
        self._last_load_s = self._clock() - started
        return served, smoke_ms

    def _limits(self) -> SchedulerLimits:
        settings = self._settings
        return SchedulerLimits(
            batch_size=settings.max_concurrent,
            queue_length=settings.queue_length,
            queue_timeout_s=settings.request_timeout_s,
            stall_timeout_s=settings.stall_timeout_s,
        )

    def _check_deadline(self, started: float, phase: Phase) -> None:
        elapsed = self._clock() - started
        if elapsed > self._settings.readiness_timeout_s:
            raise _SwapFailed(
                phase,
                f"not ready after {elapsed:.1f} s (readiness_timeout_s {self._settings.readiness_timeout_s})",
            )

    def smoke_adapter(self, name: str) -> tuple[str, tuple[float, ...]]:
        """Run the smoke prompts through the active model's adapter `name`: (its version, the
        times in ms). AgentError when it is not loaded; SmokeFailed when a prompt fails."""
        with self.lease() as served:
            loaded = served.adapters.get(name)
            if loaded is None:
                raise AgentError(f"no adapter {name!r} is loaded", hint="sits-agent adapter list")

            def submit(prompt: list[int], params: SamplingParams) -> Generation:
                with served.adapters.use(name) as adapter:
                    key = adapter.key if adapter is not None else loaded.key
                    return served.scheduler.submit(prompt, dataclasses.replace(params, adapter=key))

            try:
                return loaded.version, self._smoke(served.engine, submit)
            except _SwapFailed as failed:
                raise SmokeFailed(failed.reason) from None

    def _smoke(
        self, engine: EngineText, submit: Callable[[list[int], SamplingParams], Generation]
    ) -> tuple[float, ...]:
        """Answer each smoke prompt greedily within the latency budget; return the times in ms."""
        budget = self._settings.latency_budget_ms
        times = []
        for smoke in self._settings.smoke_prompts:
            t0 = self._clock()
            prompt = engine.chat_prompt([ChatMessage(role="user", content=smoke.prompt)])
            params = SamplingParams(max_tokens=smoke.max_tokens, temperature=0.0)
            with submit(prompt, params) as generation:
                text = "".join(event.text for event in generation)
            elapsed_ms = (self._clock() - t0) * 1000
            times.append(elapsed_ms)
            if elapsed_ms > budget:
                raise _SwapFailed(
                    "smoke", f"smoke prompt {smoke.prompt!r} took {elapsed_ms:.0f} ms > budget {budget} ms"
                )
            if smoke.expect is not None and smoke.expect not in text:
                raise _SwapFailed(
                    "smoke", f"smoke prompt {smoke.prompt!r} answered {text!r}, no {smoke.expect!r}"
                )
        return tuple(times)

    def _choose_policy(self, artifact_dir: Path) -> Policy:
        """auto: side-by-side where the new model's load fits beside the old one, else unload-first.
        The old model's memory is already out of MemAvailable, so two copies fit exactly when the
        new one's peak (`load_need_bytes`) does not exceed it."""
        policy = self._settings.swap_policy
        if policy != "auto":
            return policy
        if self._active is None:
            return "side-by-side"  # nothing to unload
        need = load_need_bytes(artifact_dir, self._settings)
        available = self._available_memory()
        if need is None or available is None:
            # Unknown either way: side-by-side keeps the old model serving if the load fails.
            return "side-by-side"
        return "side-by-side" if need <= available else "unload-first"

    def _result(
        self,
        ok: bool,
        version: str,
        active: ServedModel | None,
        previous: ServedModel | None,
        policy: Policy,
        phase: Phase,
        reason: str,
        started: float,
        smoke_ms: tuple[float, ...] = (),
        restored: bool = False,
    ) -> SwapResult:
        return SwapResult(
            ok=ok,
            version=version,
            active_version=active.version if active else None,
            previous_version=previous.version if previous else None,
            policy=policy,
            phase=phase,
            reason=reason,
            duration_s=self._clock() - started,
            smoke_ms=smoke_ms,
            restored=restored,
        )


def _loaded_event(engine: EngineText, version: str) -> None:
    """One journal line per load: where the model runs and why (auto may have chosen the CPU on a
    device meant to use its GPU), and whether decode is compiled: what load time and speed hinge on."""
    info = engine.describe()
    compiled = {"compile": info.extra["compile"]} if "compile" in info.extra else {}  # torch only
    reason = info.extra.get("device_choice", info.device)
    lifecycle_event(
        "loaded", version=version, reason=reason, engine=info.engine, device=info.device, **compiled
    )


def _quietly_unload(engine: Engine) -> None:
    with contextlib.suppress(Exception):  # a half-loaded engine may fail to unload; it is dropped anyway
        engine.unload()


def load_need_bytes(artifact_dir: Path, settings: AgentSettings) -> int | None:
    """The memory loading `artifact_dir` takes at its peak with these settings, counted as
    validate's estimate counts it (deployer/core/memory.py): the stored weights (the artifact's
    weight files), the torch engine's int8 head and mapped embedding on a CPU, the KV cache of
    max_concurrent sequences of context_length positions, the int4 draft where asked, and the
    engine's overhead and load transients. None when the artifact's shape (config.json, or a
    GGUF's header) or manifest cannot be read (its load will fail and say why)."""
    try:
        gguf = artifact_dir / GGUF_FILE
        # A safetensors artifact carries the source's config.json; a GGUF its shape in its header.
        if gguf.is_file():
            shape = ModelShape.from_gguf(read_gguf_header(gguf))
        else:
            shape = ModelShape.from_config_json(artifact_dir / "config.json")
        manifest = read_manifest(artifact_dir)
        stored = sum(
            p.stat().st_size for p in artifact_dir.iterdir() if p.suffix in (".safetensors", ".gguf")
        )
    except (OSError, ValueError, KeyError, FormatError):
        return None
    modules = manifest.quantization.modules
    integer = any(m.scheme in INTEGER_SCHEMES for m in modules.values())
    weights = stored
    if settings.engine == "torch" and settings.device != "cuda" and integer:
        table = modules.get("model.embed_tokens") or modules.get("lm_head")
        weights += torch_cpu_tables_delta(shape, FLOAT_BYTES.get(table.scheme if table else "fp16", 2.0))
    kv_per_position = kv_bytes_per_position(shape, settings.engine, settings.kv_cache_type)
    kv_cache = kv_per_position * settings.context_length * settings.max_concurrent
    draft = draft_bytes(shape, kv_per_position * settings.context_length) if settings.draft != "off" else 0
    return weights + kv_cache + draft + engine_bytes(shape, settings.engine, kv_cache)


def _available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where there is no such file."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
