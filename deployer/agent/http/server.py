"""The agent's HTTP server: the OpenAI-compatible API on TCP, the admin surface on a unix socket,
both served by uvicorn on one event loop thread.

API port (routes.py; bearer API keys beyond loopback, optional TLS)::

    POST /v1/chat/completions   chat, non-streamed or SSE (`data: {chunk}` ... `data: [DONE]`)
    POST /v1/completions        plain-text completion, same options
    GET  /v1/models             the active model and the previous one (version, quantization, kernel)
    GET  /healthz               the process is alive (always 200, no key)
    GET  /readyz                200 when a warmed, smoke-tested model is active, else 503 (no key)
    GET  /metrics               Prometheus text format (key unless metrics_auth: none)

Admin socket (admin.py; `<root>/run/sits/admin.sock`, the agent's user and root only)::

    POST /admin/reload          swap to a verified version of the store (default: `current`);
                                answers the SwapResult, 200 or 409
    and the four GET routes above.

Reloads come from `POST /admin/reload` (what `sits-agent reload` and the updater call, and what
the unit's ExecReload runs) or from SIGHUP, which re-reads the store's `current` pointer in the
background. Each reload re-reads the API key file too, so a rotated key takes effect with it.
uvicorn does the HTTP/1.1 work (keep-alive, chunked bodies, header limits); protocol.py adds
TLS, the connection cap and deadlines, all from accept; generation runs off the loop behind
generate.py's seam.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import ssl
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import uvicorn
from starlette.types import ASGIApp

from deployer.agent.engines.base import Engine
from deployer.agent.http.admin import build_admin
from deployer.agent.http.auth import KeyRing, load_keyring
from deployer.agent.http.metrics import AgentMetrics
from deployer.agent.http.protocol import ConnectionLimits, own_uids, protocol_class
from deployer.agent.http.routes import build_api
from deployer.agent.notify import Notifier, Watchdog, configure_journal_logging, lifecycle_event
from deployer.agent.ota.adapters import AdapterStore
from deployer.agent.ota.store import DeviceStore
from deployer.agent.runtime.adapters import AdapterSource
from deployer.agent.runtime.compile_cache import use_store_caches
from deployer.agent.runtime.hotswap import ModelManager, SwapResult
from deployer.agent.runtime.scheduler import SchedulerCounts
from deployer.agent.serving.fallback.source import FallbackSource
from deployer.agent.serving.generate import SchedulerTokenSource, TokenSource
from deployer.agent.settings import AgentSettings
from deployer.errors import AgentError

__all__ = ["AgentServer", "engine_factory_for", "run_server"]

_log = logging.getLogger("sits.agent")
_UNIX_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL
_LOOP_CHECK_S = 5.0


class AgentServer:
    """The model manager (each loaded model with its scheduler), metrics and the two listeners of
    one agent."""

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
        adapters = AdapterSource(
            AdapterStore(self.store.base),
            self._base_artifact_id,
            int(settings.adapter_memory_mb * 2**20),
        )
        self.manager = ModelManager(
            engine_factory,
            settings,
            on_swap=self._record_swap,
            on_counts=self._record_counts,
            adapters=adapters,
        )
        self.source: TokenSource = self._token_source()
        self.keyring: KeyRing = self._read_keys()
        self._servers: list[uvicorn.Server] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._port: int | None = None

    def _token_source(self) -> TokenSource:
        """The device's own source, behind the edge-cloud fallback when agent.yaml configures one."""
        local = SchedulerTokenSource(self.manager, self.settings.max_concurrent)
        fallback = self.settings.fallback
        if fallback is None:
            return local
        return FallbackSource(
            fallback,
            local,
            local,
            active_info=self.manager.active_info,
            max_tokens=self.settings.max_tokens,
            registry=self.metrics.registry,
        )

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The TCP port listened on (useful with port 0 in tests)."""
        if self._port is None:
            raise AgentError("the agent server is not started", hint="call start() first")
        return self._port

    @property
    def admin_socket(self) -> Path:
        """The admin unix socket's path."""
        return self.settings.admin_socket_path

    def start(self) -> int:
        """Bind both listeners, serve them on a background event loop; return the TCP port.

        Raises AgentError when an address cannot be bound or the TLS files cannot be read."""
        tls = _tls_context(self.settings)
        api_sock = _listen_tcp(self.settings)
        try:
            admin_sock = _listen_unix(self.settings.admin_socket_path, self.settings.listen_backlog)
        except BaseException:
            api_sock.close()
            raise
        self._port = api_sock.getsockname()[1]
        s = self.settings
        api_limits = ConnectionLimits(s.max_connections, s.header_timeout_s, s.keep_alive_timeout_s)
        admin_limits = ConnectionLimits(16, s.header_timeout_s, s.keep_alive_timeout_s, own_uids())
        self._servers = [
            uvicorn.Server(self._config(build_api(self), protocol_class(api_limits, self.metrics, tls))),
            uvicorn.Server(self._config(build_admin(self), protocol_class(admin_limits, self.metrics))),
        ]
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, args=([api_sock], [admin_sock], started), name="sits-http", daemon=True
        )
        self._thread.start()
        started.wait()
        if not self.alive():
            raise AgentError("the HTTP server stopped while starting", hint="see the journal")
        scheme = "https" if s.tls_certfile else "http"
        lifecycle_event("listening", version=None, reason=f"{scheme}://{s.host}:{self.port}")
        return self.port

    def _config(self, app: ASGIApp, protocol: type[asyncio.Protocol]) -> uvicorn.Config:
        s = self.settings
        config = uvicorn.Config(
            app,
            http=protocol,
            lifespan="off",
            log_config=None,
            access_log=False,  # access lines would carry client addresses at INFO; never keys
            server_header=False,
            timeout_keep_alive=int(max(1, s.keep_alive_timeout_s)),
            timeout_graceful_shutdown=int(max(1, s.drain_timeout_s)),
            h11_max_incomplete_event_size=s.max_header_bytes,
            backlog=s.listen_backlog,
        )
        config.load()
        return config

    def _serve(self, api: list[socket.socket], admin: list[socket.socket], started: threading.Event) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            tasks = [
                asyncio.ensure_future(server.serve(sockets=socks))
                for server, socks in zip(self._servers, (api, admin), strict=True)
            ]
            # uvicorn has no start hook for pre-bound sockets: look until both run (or one failed).
            while not all(s.started for s in self._servers) and not any(t.done() for t in tasks):
                await asyncio.sleep(0.005)
            started.set()
            await asyncio.gather(*tasks)

        try:
            asyncio.run(main())
        except BaseException as exc:
            _log.error("the HTTP server stopped: %s: %s", type(exc).__name__, exc)
        finally:
            started.set()

    def alive(self) -> bool:
        """The event loop runs and answers (the watchdog pings only while it does)."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return False
        try:
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(_LOOP_CHECK_S)
        except Exception:
            return False
        return True

    def stop(self, *, drain: bool = True) -> None:
        """Stop listening (in-flight requests get drain_timeout_s to finish) and retire the model;
        `drain=False` when the event loop is known to be stuck: nothing could drain, so waiting
        would only delay the restart."""
        for server in self._servers:
            server.should_exit = True
        if drain and self._loop is not None and self._thread is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self.source.cancel_all)
            self._thread.join(self.settings.drain_timeout_s + 10)
        with contextlib.suppress(FileNotFoundError):
            self.settings.admin_socket_path.unlink()
        self.manager.shutdown()

    # -- reloads -------------------------------------------------------------------------------

    def reload(
        self, artifact_dir: Path | None = None, version: str | None = None, *, reason: str = "reload"
    ) -> SwapResult:
        """Swap to `version` (default: what the store's `current` pointer names), telling systemd.

        `artifact_dir` is for in-process callers (tests, the demo); the admin socket never passes one.
        """
        self.keyring = self._read_keys()
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

    def _base_artifact_id(self, version: str) -> str | None:
        """The artifact id a store version was released as (what an adapter names as its base);
        None for a version the store has no release of."""
        record = self.store.read_state().versions.get(version)
        return record.release.artifact.sha256 if record is not None else None

    def _read_keys(self) -> KeyRing:
        return load_keyring(self.settings.api_keys_path, required=not self.settings.loopback_only)

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
        self.metrics.reloads.labels(result=outcome).inc()
        if reason == "rollback":
            self.metrics.rollbacks.labels(result=outcome).inc()
        if result.restored:  # unload-first put the old model back: a rollback of its own
            self.metrics.rollbacks.labels(result="success").inc()
        info = self.manager.active_info()
        self.metrics.model_info.clear()
        if info is not None:
            self.metrics.model_info.labels(
                model=info.model,
                version=info.version,
                quantization=info.quantization,
                kernel=info.kernel,
                engine=info.engine,
                device=info.device,
            ).set(1)

    def _record_counts(self, counts: SchedulerCounts) -> None:
        self.metrics.running.set(counts.running)
        self.metrics.waiting.set(counts.waiting)


def engine_factory_for(settings: AgentSettings) -> Callable[[], Engine]:
    """What `run_server` makes each model's engine with: the engine agent.yaml names, on its
    device, with its compile, draft and KV cache settings, threads, context length and slots
    (max_concurrent)."""

    def factory() -> Engine:
        # Imported here: the engines pull in torch, which `serve` imports only when it loads.
        from deployer.agent.engines import make_engine

        return make_engine(
            settings.engine,
            context_length=settings.context_length,
            device=settings.device,
            threads=settings.threads,
            slots=settings.max_concurrent,
            compile=settings.compile,
            draft=settings.draft,
            kv_cache_type=settings.kv_cache_type,
        )

    return factory


def run_server(settings: AgentSettings, engine_factory: Callable[[], Engine] | None = None) -> None:
    """`sits-agent serve`: listen, load the store's current version, tell systemd, serve until SIGTERM.

    Raises AgentError when the current version cannot be loaded, so the process exits non-zero and
    systemd's OnFailure= rollback unit can return the device to the previous version; and when the
    server's event loop stops answering, so that Restart=on-failure restarts it. Only SIGTERM (or
    SIGINT) ends it without an error.
    """
    configure_journal_logging()
    # Before any engine loads: torch reads these when it first compiles.
    caches = use_store_caches(settings.state_dir)
    lifecycle_event("compile-caches", version=None, reason="inductor, Triton and CPU kernel caches", **caches)
    server = AgentServer(settings, engine_factory or engine_factory_for(settings))
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
    stuck = not stop.is_set()  # the loop stopped answering (or its thread died), no signal came
    reason = "the event loop stopped answering" if stuck else "signal"
    lifecycle_event("stopping", version=result.active_version, reason=reason)
    server.notifier.stopping("stopping")
    watchdog.stop()
    server.stop(drain=not stuck)
    if stuck:
        # A failure, so that systemd's Restart=on-failure brings the agent back (exit 0 would not).
        raise AgentError(
            f"the HTTP server's event loop stopped answering for {_LOOP_CHECK_S:g} s; stopped",
            hint="systemd restarts the agent; the journal lines before this one say what held the loop",
        )


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


def _tls_context(settings: AgentSettings) -> ssl.SSLContext | None:
    """The API's TLS server context (None: plain HTTP). The protocol does the handshake itself,
    so that a connection in its handshake is already under the connection limits."""
    if settings.tls_certfile is None or settings.tls_keyfile is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(settings.tls_certfile, settings.tls_keyfile)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise AgentError(
            f"cannot load the TLS certificate {settings.tls_certfile} / key {settings.tls_keyfile}: {exc}",
            hint="check the paths and that the agent's user can read them",
        ) from exc
    return context


def _listen_tcp(settings: AgentSettings) -> socket.socket:
    """The API's listening socket, bound here so that port 0 can be read back before serving."""
    host, port = settings.host, settings.port
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(settings.listen_backlog)
        except BaseException:
            sock.close()
            raise
    except OSError as exc:
        raise AgentError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}",
            hint="another process holds the port, or the host is not an address of this device; "
            "change host/port in agent.yaml",
        ) from exc
    sock.setblocking(False)
    return sock


def _listen_unix(path: Path, backlog: int) -> socket.socket:
    """The admin socket: in a directory only the agent's user can enter, itself mode 0600."""
    if len(os.fsencode(path)) > _UNIX_PATH_MAX:
        raise AgentError(
            f"the admin socket path {path} is longer than a unix socket allows ({_UNIX_PATH_MAX} bytes)",
            hint="set a shorter admin_socket in agent.yaml",
        )
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if path.parent.stat().st_uid == os.getuid():
            path.parent.chmod(0o700)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()  # left by a previous run that was killed
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(path))
            path.chmod(0o600)
            sock.listen(backlog)
        except BaseException:
            sock.close()
            raise
    except OSError as exc:
        raise AgentError(
            f"cannot create the admin socket {path}: {exc.strerror or exc}",
            hint="under systemd the unit's RuntimeDirectory=sits provides /run/sits; elsewhere the "
            "agent's user needs write access to its parent directory",
        ) from exc
    sock.setblocking(False)
    return sock
