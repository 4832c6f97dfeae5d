"""The agent's HTTP server: OpenAI-compatible inference, health, metrics, and the reload control.

Endpoints::

    POST /v1/chat/completions   chat, non-streamed or SSE (`data: {chunk}` ... `data: [DONE]`)
    POST /v1/completions        plain-text completion, same options
    GET  /v1/models             the active model and the previous one (version, quantization, kernel)
    GET  /healthz               the process is alive (always 200)
    GET  /readyz                200 when a warmed, smoke-tested model is active, else 503
    GET  /metrics               Prometheus text format
    POST /admin/reload          loopback clients only: swap to a version (default: the store's
                                `current` pointer); answers the SwapResult, 200 or 409

Reloads come from `POST /admin/reload` (what `sits-agent reload` and the updater call, and what
the unit's ExecReload runs) or from SIGHUP, which re-reads the store's `current` pointer in the
background. Runs on the standard library's ThreadingHTTPServer: one thread per connection; each model's
scheduler batches their generations and bounds how many wait.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from pathlib import Path

from deployer.agent.engines.base import Engine
from deployer.agent.hotswap import ModelManager, SwapResult
from deployer.agent.http.metrics import AgentMetrics
from deployer.agent.http.routes import RequestHandler
from deployer.agent.notify import Notifier, Watchdog, configure_journal_logging, lifecycle_event
from deployer.agent.scheduler import SchedulerCounts
from deployer.agent.settings import AgentSettings
from deployer.agent.store import DeviceStore
from deployer.errors import AgentError

__all__ = ["AgentServer", "run_server"]

_log = logging.getLogger("sits.agent")


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # a stuck client connection must not block shutdown
    allow_reuse_address = True
    app: AgentServer


class AgentServer:
    """The model manager, admission control, metrics and HTTP listener of one agent."""

    def __init__(
        self,
        settings: AgentSettings,
        engine_factory: Callable[[], Engine],
        *,
        notifier: Notifier | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = AgentMetrics()
        self.notifier = notifier or Notifier()
        self.store = DeviceStore(settings.root)
        self.manager = ModelManager(
            engine_factory, settings, on_swap=self._record_swap, on_counts=self._record_counts
        )
        self._http: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The port listened on (useful with port 0 in tests)."""
        if self._http is None:
            raise AgentError("the agent server is not started", hint="call start() first")
        return self._http.server_address[1]

    def start(self) -> int:
        """Listen and serve in a background thread; return the port."""
        try:
            self._http = _HTTPServer((self.settings.host, self.settings.port), RequestHandler)
        except OSError as exc:
            raise AgentError(
                f"cannot listen on {self.settings.host}:{self.settings.port}: {exc.strerror}",
                hint="another process holds the port, or the host is not an address of this device; "
                "change host/port in agent.yaml",
            ) from exc
        self._http.app = self
        self._thread = threading.Thread(target=self._http.serve_forever, name="sits-http", daemon=True)
        self._thread.start()
        lifecycle_event("listening", version=None, reason=f"{self.settings.host}:{self.port}")
        return self.port

    def alive(self) -> bool:
        """The HTTP loop is running (the watchdog pings only while it is)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Stop listening and retire the model (in-flight requests finish first)."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        self.manager.shutdown()

    # -- reloads -------------------------------------------------------------------------------

    def reload(
        self, artifact_dir: Path | None = None, version: str | None = None, *, reason: str = "reload"
    ) -> SwapResult:
        """Swap to `version` (default: what the store's `current` pointer names), telling systemd."""
        artifact_dir, version = self._resolve(artifact_dir, version)
        self.notifier.reloading(f"loading {version}")
        result = self.manager.swap_to(artifact_dir, version, reason=reason)
        info = self.manager.active_info()
        status = f"serving {info.version}" if info else "no model loaded"
        if result.ok or info is not None:
            self.notifier.ready(status if result.ok else f"{status}; {version} refused: {result.reason}")
        else:
            self.notifier.status(f"{status}; {version} refused: {result.reason}")
        return result

    def _resolve(self, artifact_dir: Path | None, version: str | None) -> tuple[Path, str]:
        if artifact_dir is not None:
            return artifact_dir, version or artifact_dir.name
        if version is not None:
            return self.store.version_dir(version), version
        current = self.store.current_version()
        if current is None:
            raise AgentError(
                f"no version is installed under {self.store.base} (no `current` pointer)",
                hint="install one with `sits-agent install`",
            )
        return self.store.version_dir(current), current

    def _record_swap(self, result: SwapResult, reason: str) -> None:
        outcome = "success" if result.ok else "failure"
        self.metrics.reloads.inc(result=outcome)
        if reason == "rollback":
            self.metrics.rollbacks.inc(result=outcome)
        if result.restored:  # unload-first put the old model back: a rollback of its own
            self.metrics.rollbacks.inc(result="success")
        info = self.manager.active_info()
        self.metrics.model_info.clear()
        if info is not None:
            self.metrics.model_info.set(
                1,
                model=info.model,
                version=info.version,
                quantization=info.quantization,
                kernel=info.kernel,
                engine=info.engine,
                device=info.device,
            )

    def _record_counts(self, counts: SchedulerCounts) -> None:
        self.metrics.running.set(counts.running)
        self.metrics.waiting.set(counts.waiting)


def run_server(settings: AgentSettings, engine_factory: Callable[[], Engine] | None = None) -> None:
    """`sits-agent serve`: listen, load the store's current version, tell systemd, serve until SIGTERM.

    Raises AgentError when the current version cannot be loaded, so the process exits non-zero and
    systemd's OnFailure= rollback unit can return the device to the previous version.
    """
    configure_journal_logging()
    if engine_factory is None:
        from deployer.agent.engines import make_engine

        def engine_factory() -> Engine:
            return make_engine(
                settings.engine,
                context_length=settings.context_length,
                device=settings.device,
                threads=settings.threads,
                slots=settings.max_concurrent,
            )

    server = AgentServer(settings, engine_factory)
    server.start()
    result = server.reload(reason="start")
    if not result.ok:
        server.stop()
        raise AgentError(
            f"version {result.version} failed to start ({result.phase}): {result.reason}",
            hint="`sits-agent rollback` returns to the previous version",
        )
    stop = threading.Event()
    _install_signal_handlers(server, stop)
    watchdog = Watchdog(server.notifier, healthy=server.alive)
    watchdog.start()
    while not stop.wait(1.0):
        if not server.alive():
            break
    lifecycle_event("stopping", version=result.active_version, reason="signal")
    server.notifier.stopping("stopping")
    watchdog.stop()
    server.stop()


def _install_signal_handlers(server: AgentServer, stop: threading.Event) -> None:
    def on_hup(signum: int, frame: object) -> None:
        # Swapping takes seconds: never inside a signal handler.
        threading.Thread(target=_reload_from_signal, args=(server,), name="sits-sighup", daemon=True).start()

    def on_term(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGHUP, on_hup)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)


def _reload_from_signal(server: AgentServer) -> None:
    try:
        result = server.reload(reason="sighup")
    except AgentError as exc:
        lifecycle_event("swap-failed", version=None, reason=exc.message)
        return
    _log.info("sits-agent reload %s", json.dumps(result.to_dict(), sort_keys=True))
