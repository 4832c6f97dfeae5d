"""The HTTP side of the agent: routing, request bodies, JSON and SSE responses, and error mapping.

Kept apart from server.py (lifecycle, reloads) so that each reads in one sitting. Every failure a
client can cause is answered with an OpenAI-style error body; nothing a client sends can stop the
server.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Literal, Protocol
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployer.agent.engines.base import Engine, EngineInfo, TokenEvent
from deployer.agent.hotswap import ModelManager, SwapResult, Unavailable
from deployer.agent.http.admission import Overloaded, QueueTimeout
from deployer.agent.http.metrics import AgentMetrics
from deployer.agent.http.openai_schemas import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    new_id,
    parse_request,
    usage,
)
from deployer.agent.settings import AgentSettings
from deployer.agent.slot import ModelSlot
from deployer.errors import SitsError

__all__ = ["RequestHandler"]

_log = logging.getLogger("sits.agent")
Kind = Literal["chat", "completion"]
# Errors a socket write raises once the client has gone.
_GONE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError)


class ReloadRequest(BaseModel):
    """Body of POST /admin/reload; empty means "the store's current version"."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: str | None = Field(default=None, min_length=1)
    artifact_dir: Path | None = None
    reason: Literal["reload", "update", "rollback"] = "reload"


class AgentApp(Protocol):
    """What a connection needs of the server it belongs to (the server implements it; routes never
    import the server, so the two modules do not depend on each other)."""

    settings: AgentSettings
    metrics: AgentMetrics
    manager: ModelManager

    def reload(
        self, artifact_dir: Path | None = None, version: str | None = None, *, reason: str = "reload"
    ) -> SwapResult: ...


class RequestHandler(BaseHTTPRequestHandler):
    """One connection; HTTP/1.1 keep-alive, chunked transfer for streams."""

    protocol_version = "HTTP/1.1"
    server_version = "sits-agent"

    # -- plumbing --------------------------------------------------------------------------------

    @property
    def app(self) -> AgentApp:
        """The AgentApp this connection belongs to."""
        return self.server.app  # type: ignore[attr-defined]

    @property
    def settings(self) -> AgentSettings:
        """The agent's settings."""
        return self.app.settings

    def setup(self) -> None:
        """Bound how long an idle or slow client may hold its connection."""
        self.timeout = self.server.app.settings.request_timeout_s  # type: ignore[attr-defined]
        super().setup()

    def log_message(self, format: str, *args: object) -> None:
        """Access lines go to the debug log, not stderr: the journal keeps lifecycle events."""
        _log.debug("%s %s", self.address_string(), format % args)

    def do_GET(self) -> None:
        """GET routes."""
        self._dispatch(
            {
                "/healthz": self._healthz,
                "/readyz": self._readyz,
                "/metrics": self._metrics,
                "/v1/models": self._models,
            }
        )

    def do_POST(self) -> None:
        """POST routes."""
        self._dispatch(
            {
                "/v1/chat/completions": lambda: self._generate("chat"),
                "/v1/completions": lambda: self._generate("completion"),
                "/admin/reload": self._reload,
            }
        )

    def _dispatch(self, routes: dict[str, Callable[[], int]]) -> None:
        path = urlsplit(self.path).path.rstrip("/") or "/"
        route = routes.get(path)
        try:
            if route is None:
                raise ApiError(404, f"no route {self.command} {path}", code="not_found")
            status = route()
        except ApiError as exc:
            status = self._send_json(exc.status, exc.body(), exc.headers)
        except Exception as exc:
            # A bug or a foreign failure (e.g. a chat template error) answers 500; the server stays up.
            _log.exception("unhandled error on %s %s", self.command, path)
            error = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error")
            status = self._send_json(500, error.body())
        self.app.metrics.requests.inc(endpoint=path if route else "other", status=str(status))

    def _send_json(self, status: int, body: dict, headers: dict[str, str] | None = None) -> int:
        self._send_bytes(status, json.dumps(body).encode(), "application/json", headers)
        return status

    def _send_bytes(
        self, status: int, data: bytes, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)
        except _GONE:
            self.close_connection = True

    def _read_json(self) -> object:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            raise ApiError(411, "send the body with a Content-Length, not chunked", code="length_required")
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = -1
        if length < 0:
            self.close_connection = True
            raise ApiError(400, "the Content-Length header is not a number", code="invalid_request")
        if length > self.settings.max_request_bytes:
            self.close_connection = True  # the body stays unread, so this connection cannot be reused
            raise ApiError(
                413,
                f"the request body has {length} bytes; "
                f"this agent accepts at most {self.settings.max_request_bytes}",
                code="request_too_large",
            )
        raw = self.rfile.read(length) if length else b""
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from exc

    # -- health, metrics, models -----------------------------------------------------------------

    def _healthz(self) -> int:
        return self._send_json(200, {"status": "ok"})

    def _readyz(self) -> int:
        info = self.app.manager.active_info()
        if info is None:
            return self._send_json(503, {"status": "not ready", "swapping": self.app.manager.swapping})
        return self._send_json(200, {"status": "ready", "version": info.version})

    def _metrics(self) -> int:
        data = self.app.metrics.render().encode()
        self._send_bytes(200, data, "text/plain; version=0.0.4; charset=utf-8")
        return 200

    def _models(self) -> int:
        entries = [
            _model_entry(info, status)
            for info, status in (
                (self.app.manager.active_info(), "active"),
                (self.app.manager.previous_info(), "previous"),
            )
            if info is not None
        ]
        return self._send_json(200, {"object": "list", "data": entries})

    # -- control ---------------------------------------------------------------------------------

    def _reload(self) -> int:
        if not _is_loopback(self.client_address[0]):
            raise ApiError(403, "/admin/reload answers loopback clients only", type_="permission_error")
        try:
            body = ReloadRequest.model_validate(self._read_json() or {})
        except ValidationError as exc:
            raise ApiError(
                400, f"invalid reload request: {exc.errors()[0]['msg']}", code="invalid_value"
            ) from exc
        try:
            result = self.app.reload(body.artifact_dir, body.version, reason=body.reason)
        except SitsError as exc:
            raise ApiError(409, exc.message, type_="reload_error", code="no_version") from exc
        return self._send_json(200 if result.ok else 409, result.to_dict())

    # -- generation ------------------------------------------------------------------------------

    def _generate(self, kind: Kind) -> int:
        started = time.monotonic()
        model = ChatCompletionRequest if kind == "chat" else CompletionRequest
        request = parse_request(model, self._read_json())
        timeout = self.settings.request_timeout_s
        try:
            with self.app.manager.lease() as slot:
                prompt = _tokenize(slot.engine, request)
                max_tokens = _max_tokens(request, len(prompt), slot.info.context_length, self.settings)
                self.app.metrics.prompt_tokens.inc(len(prompt))
                with contextlib.closing(slot.stream(prompt, request.sampling(max_tokens), timeout)) as events:
                    run = _Run(
                        kind, new_id("chatcmpl" if kind == "chat" else "cmpl"), _model_id(slot), started
                    )
                    if request.stream:
                        return self._stream(run, events, len(prompt), request.include_usage())
                    return self._complete(run, events, len(prompt))
        except Overloaded as exc:
            raise ApiError(
                429,
                f"the agent is at capacity ({exc}); retry later",
                type_="rate_limit_error",
                code="overloaded",
                headers={"Retry-After": str(exc.retry_after_s)},
            ) from exc
        except QueueTimeout as exc:
            raise ApiError(
                503,
                f"{exc}; retry later",
                type_="server_error",
                code="queue_timeout",
                headers={"Retry-After": str(exc.retry_after_s)},
            ) from exc
        except SitsError as exc:
            # Raised before any token (tokenizing, the engine refusing parameters): the request's fault.
            raise ApiError(400, exc.message, code="invalid_request") from exc
        except Unavailable as exc:
            raise ApiError(
                503,
                str(exc),
                type_="server_error",
                code="model_unavailable",
                headers={"Retry-After": str(exc.retry_after_s)},
            ) from exc

    def _complete(self, run: _Run, events: Iterator[TokenEvent], prompt_tokens: int) -> int:
        try:
            parts = [event.text for event in run.track(events, self.app)]
        except Exception as exc:
            raise _engine_failure(exc) from exc
        usage_ = usage(prompt_tokens, run.tokens)
        text = "".join(parts)
        if run.kind == "chat":
            return self._send_json(200, chat_response(run.rid, run.model, text, run.finish, usage_))
        return self._send_json(200, completion_response(run.rid, run.model, text, run.finish, usage_))

    def _stream(
        self, run: _Run, events: Iterator[TokenEvent], prompt_tokens: int, include_usage: bool
    ) -> int:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunk = _chunk_maker(run)
        try:
            if run.kind == "chat":
                self._sse(chat_chunk(run.rid, run.model, {"role": "assistant", "content": ""}, None))
            try:
                for event in run.track(events, self.app):
                    if event.text:
                        self._sse(chunk(event.text, None))
                self._sse(chunk("", run.finish))
                if include_usage:
                    self._sse(chunk("", None, usage(prompt_tokens, run.tokens)))
            except _GONE:
                raise
            except Exception as exc:
                # Headers are sent: the failure can only travel as an event in the stream.
                self._sse(_engine_failure(exc).body())
            self._write_chunk(b"data: [DONE]\n\n")
            self._write_chunk(b"")
        except _GONE:
            # The client left: closing `events` (by our caller) frees the engine and the slot.
            self.close_connection = True
            _log.debug("client %s left mid-stream after %d tokens", self.address_string(), run.tokens)
            return 499
        return 200

    def _sse(self, body: dict) -> None:
        self._write_chunk(b"data: " + json.dumps(body).encode() + b"\n\n")

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


class _Run:
    """Bookkeeping of one generation: id, model, tokens, finish reason, and its latency metrics."""

    def __init__(self, kind: Kind, rid: str, model: str, started: float) -> None:
        self.kind = kind
        self.rid = rid
        self.model = model
        self.started = started
        self.tokens = 0
        self.finish = "stop"

    def track(self, events: Iterator[TokenEvent], app: AgentApp) -> Iterator[TokenEvent]:
        """Pass events through, counting tokens and observing TTFT and end-to-end latency."""
        for event in events:
            if event.token_id is not None:
                if self.tokens == 0:
                    app.metrics.ttft.observe(time.monotonic() - self.started)
                self.tokens += 1
                app.metrics.generation_tokens.inc()
            if event.finish_reason is not None:
                self.finish = event.finish_reason
            yield event
        app.metrics.e2e.observe(time.monotonic() - self.started)


def _chunk_maker(run: _Run) -> Callable[..., dict]:
    """`chunk(text, finish_reason, usage=None)` in the run's wire form (chat delta or completion text)."""
    if run.kind == "chat":
        return lambda text, finish, usage_=None: chat_chunk(
            run.rid, run.model, {"content": text} if text else {}, finish, usage_
        )
    return lambda text, finish, usage_=None: completion_chunk(run.rid, run.model, text, finish, usage_)


def _tokenize(engine: Engine, request: ChatCompletionRequest | CompletionRequest) -> list[int]:
    if isinstance(request, ChatCompletionRequest):
        return engine.chat_prompt([m.to_chat_message() for m in request.messages])
    return engine.encode(request.prompt_text())


def _max_tokens(
    request: ChatCompletionRequest | CompletionRequest, prompt_len: int, context: int, settings: AgentSettings
) -> int:
    """The number of tokens to generate, or ApiError 400 when the request cannot fit."""
    param = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    if prompt_len > settings.max_prompt_tokens:
        raise ApiError(
            400,
            f"the prompt has {prompt_len} tokens; this agent accepts at most {settings.max_prompt_tokens}",
            param=param,
            code="context_length_exceeded",
        )
    room = context - prompt_len
    requested = request.requested_max_tokens()
    if requested is None:
        return max(1, min(settings.max_tokens, room))
    if requested > settings.max_tokens:
        raise ApiError(
            400,
            f"max_tokens {requested} is above this agent's limit of {settings.max_tokens}",
            param="max_tokens",
            code="invalid_value",
        )
    if requested > room:
        raise ApiError(
            400,
            f"max_tokens {requested} plus the prompt's {prompt_len} tokens exceed the model's context "
            f"of {context} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def _engine_failure(exc: Exception) -> ApiError:
    _log.error("generation failed: %s: %s", type(exc).__name__, exc)
    return ApiError(500, f"generation failed: {exc}", type_="server_error", code="engine_error")


def _model_id(slot: ModelSlot) -> str:
    return model_id(slot.info)


def model_id(info: EngineInfo) -> str:
    """The id /v1/models lists and responses carry: `<model>@<version>`."""
    return f"{info.model}@{info.version}"


def _model_entry(info: EngineInfo, status: str) -> dict:
    return {
        "id": model_id(info),
        "object": "model",
        "created": 0,
        "owned_by": "sits",
        "status": status,
        "loaded": status == "active",
        "version": info.version,
        "quantization": info.quantization,
        "kernel": info.kernel,
        "engine": info.engine,
        "device": info.device,
        "context_length": info.context_length,
    }


def _is_loopback(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback
