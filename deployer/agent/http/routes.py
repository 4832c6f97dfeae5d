"""The agent's public API as a Starlette app: OpenAI-compatible generation, models, health, metrics.

Every failure a client can cause is answered with an OpenAI-style error body (404 and 405 too);
nothing a client sends can stop the server. Generation goes through the one seam in generate.py;
this module only parses, checks, streams and counts. A client that leaves, or stops reading for
`stall_timeout_s`, has its generation cancelled (status 499 in the request counter).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Literal, Protocol

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deployer.agent.engines.base import EngineInfo, SamplingParams, TokenEvent
from deployer.agent.hotswap import ModelManager, SwapResult
from deployer.agent.http.auth import KeyRing
from deployer.agent.http.generate import Cancelled, Generation, Job, TokenSource
from deployer.agent.http.metrics import CONTENT_TYPE, AgentMetrics
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
from deployer.agent.store import DeviceStore

__all__ = [
    "AgentApp",
    "build_api",
    "endpoint",
    "error_response",
    "http_error",
    "info_routes",
    "model_id",
    "read_json",
]

_log = logging.getLogger("sits.agent")
Kind = Literal["chat", "completion"]
OPEN_PATHS = frozenset({"/healthz", "/readyz"})  # never behind a key: probes and load balancers
API_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/metrics", *OPEN_PATHS})
GONE = 499  # nginx's "client closed request", as counted in sits_requests_total


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


# -- plumbing shared with the admin app ------------------------------------------------------------


def error_response(exc: ApiError) -> JSONResponse:
    """An ApiError as its HTTP response."""
    return JSONResponse(exc.body(), exc.status, headers=exc.headers)


def endpoint(fn: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """Answer ApiError with its body and any other failure with a 500 body, keeping the connection."""

    async def wrapped(request: Request) -> Response:
        try:
            return await fn(request)
        except ApiError as exc:
            return error_response(exc)
        except Exception as exc:
            _log.exception("unhandled error on %s %s", request.method, request.url.path)
            error = ApiError(500, f"internal error: {type(exc).__name__}", type_="server_error")
            return error_response(error)

    return wrapped


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 / 405, in the OpenAI error shape."""
    assert isinstance(exc, HTTPException)
    path = request.url.path
    if exc.status_code == 405:
        error = ApiError(
            405,
            f"{request.method} is not allowed on {path}",
            code="method_not_allowed",
            headers=dict(exc.headers or {}),
        )
    else:
        error = ApiError(exc.status_code, f"no route {request.method} {path}", code="not_found")
    return error_response(error)


def _status_of(request: Request, status: int) -> None:
    """Record the status the request counter should see (a stream's outcome is known only at its end)."""
    request.scope["sits"]["status"] = status


class _Counted:
    """Counts every request in sits_requests_total{endpoint, status}."""

    def __init__(self, app: ASGIApp, metrics: AgentMetrics, known: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.known = known

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        holder: dict[str, int] = {}
        scope["sits"] = holder

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                holder.setdefault("status", message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            path = scope["path"]
            endpoint = path if path in self.known else "other"
            self.metrics.requests.labels(endpoint=endpoint, status=str(holder.get("status", GONE))).inc()


class _Guard:
    """Header size (h11 bounds only headers still arriving), then bearer keys on every route but
    the open ones (and /metrics when metrics_auth is "none")."""

    def __init__(self, app: ASGIApp, server: AgentApp) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        limit = self.server.settings.max_header_bytes
        if scope["type"] == "http" and sum(len(k) + len(v) + 4 for k, v in scope["headers"]) > limit:
            error = ApiError(431, f"the request headers exceed {limit} bytes", code="headers_too_large")
            await error_response(error)(scope, receive, send)
            return
        exempt = path in OPEN_PATHS or (path == "/metrics" and self.server.settings.metrics_auth == "none")
        if scope["type"] == "http" and not exempt:
            verdict = self.server.keyring.check(Headers(scope=scope).get("authorization"))
            if verdict != "ok":
                self.server.metrics.auth_failures.labels(reason=verdict).inc()
                message = (
                    "missing API key: send `Authorization: Bearer <key>`"
                    if verdict == "missing"
                    else "invalid API key"
                )
                error = ApiError(
                    401,
                    message,
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def read_json(request: Request, settings: AgentSettings) -> object:
    """The request body as JSON: 413 past max_request_bytes, 408 past request_timeout_s, 400 when it
    is not JSON (including NaN, Infinity and nesting too deep to parse)."""
    limit = settings.max_request_bytes
    declared = request.headers.get("content-length")
    if declared is not None and int(declared) > limit:  # h11 has checked it is a number
        raise _too_large(int(declared), limit)
    body = bytearray()
    try:
        async with asyncio.timeout(settings.request_timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise _too_large(len(body), limit)
    except TimeoutError:
        raise ApiError(
            408, f"the body did not arrive within {settings.request_timeout_s:g} s", code="request_timeout"
        ) from None
    try:
        return json.loads(body or b"null", parse_constant=_no_constants)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply", code="invalid_json") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body has {size} bytes or more; this agent accepts at most {limit}",
        code="request_too_large",
    )


async def _wait_disconnect(receive: Receive) -> None:
    """Return when the client has gone (uvicorn also says so once the response is complete)."""
    while (await receive())["type"] != "http.disconnect":
        pass


# -- health, metrics, models -----------------------------------------------------------------------


def info_routes(server: AgentApp) -> list[Route]:
    """/healthz, /readyz, /metrics and /v1/models (the admin socket serves them too)."""

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        info = server.manager.active_info()
        if info is None:
            return JSONResponse({"status": "not ready", "swapping": server.manager.swapping}, 503)
        return JSONResponse({"status": "ready", "version": info.version})

    async def metrics(request: Request) -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    async def models(request: Request) -> Response:
        entries = [
            _model_entry(info, status)
            for info, status in (
                (server.manager.active_info(), "active"),
                (server.manager.previous_info(), "previous"),
            )
            if info is not None
        ]
        return JSONResponse({"object": "list", "data": entries})

    return [
        Route("/healthz", endpoint(healthz)),
        Route("/readyz", endpoint(readyz)),
        Route("/metrics", endpoint(metrics)),
        Route("/v1/models", endpoint(models)),
    ]


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


# -- generation ------------------------------------------------------------------------------------


def _generation_routes(server: AgentApp) -> list[Route]:
    async def chat(request: Request) -> Response:
        return await _generate(server, request, "chat")

    async def completions(request: Request) -> Response:
        return await _generate(server, request, "completion")

    return [
        Route("/v1/chat/completions", endpoint(chat), methods=["POST"]),
        Route("/v1/completions", endpoint(completions), methods=["POST"]),
    ]


async def _generate(server: AgentApp, request: Request, kind: Kind) -> Response:
    started = time.monotonic()
    settings = server.settings
    try:
        data = await read_json(request, settings)
    except ClientDisconnect:
        _status_of(request, GONE)
        return Response(status_code=GONE)
    schema: type[ChatCompletionRequest | CompletionRequest] = (
        ChatCompletionRequest if kind == "chat" else CompletionRequest
    )
    body = parse_request(schema, data)
    job = Job(
        messages=tuple(m.to_chat_message() for m in body.messages)
        if isinstance(body, ChatCompletionRequest)
        else None,
        text=body.prompt_text() if isinstance(body, CompletionRequest) else None,
        plan=lambda prompt_len, info: _plan(body, prompt_len, info, settings),
    )
    gone = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        generation = await _start(server, job, gone)
    except Cancelled:
        _status_of(request, GONE)
        server.metrics.cancelled.labels(reason="disconnect").inc()
        return Response(status_code=GONE)
    except BaseException:
        gone.cancel()
        raise
    gone.add_done_callback(lambda _: generation.cancel())
    server.metrics.prompt_tokens.inc(generation.started.prompt_tokens)
    run = _Run(kind, new_id("chatcmpl" if kind == "chat" else "cmpl"), generation, started, server.metrics)
    if body.stream:
        return _EventStream(run, body.include_usage(), gone, request, settings.stall_timeout_s)
    try:
        text = "".join([event.text async for event in run.events()])
    except Cancelled:
        _status_of(request, GONE)
        server.metrics.cancelled.labels(reason="disconnect").inc()
        return Response(status_code=GONE)
    finally:
        gone.cancel()
    usage_ = usage(run.prompt_tokens, run.tokens)
    make = chat_response if kind == "chat" else completion_response
    return JSONResponse(make(run.rid, run.model, text, run.finish, usage_))


async def _start(server: AgentApp, job: Job, gone: asyncio.Future) -> Generation:
    """Start the job, or raise Cancelled when the client leaves first (e.g. while queued)."""
    start = asyncio.ensure_future(server.source.start(job))
    await asyncio.wait({start, gone}, return_when=asyncio.FIRST_COMPLETED)
    if start.done():
        return start.result()
    start.cancel()
    with contextlib.suppress(asyncio.CancelledError, ApiError, Cancelled):
        await start
    raise Cancelled()


def _plan(
    request: ChatCompletionRequest | CompletionRequest,
    prompt_len: int,
    info: EngineInfo,
    settings: AgentSettings,
) -> SamplingParams:
    """Check the model name and the token budget against the model that will answer."""
    if request.model not in {info.model, model_id(info)}:
        raise ApiError(
            404,
            f"the model {request.model!r} does not exist here; this agent serves {model_id(info)!r} "
            f"(also accepted: {info.model!r})",
            param="model",
            code="model_not_found",
        )
    return request.sampling(_max_tokens(request, prompt_len, info.context_length, settings))


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


class _Run:
    """One generation's bookkeeping: id, model, tokens, finish reason, and its latency metrics."""

    def __init__(
        self, kind: Kind, rid: str, generation: Generation, started: float, metrics: AgentMetrics
    ) -> None:
        self.kind = kind
        self.rid = rid
        self.generation = generation
        self.model = model_id(generation.started.info)
        self.prompt_tokens = generation.started.prompt_tokens
        self.started = started
        self.metrics = metrics
        self.tokens = 0
        self.finish = "stop"

    async def events(self) -> AsyncIterator[TokenEvent]:
        """The generation's events, counting tokens and observing TTFT and end-to-end latency."""
        async for event in self.generation.events():
            if event.token_id is not None:
                if self.tokens == 0:
                    self.metrics.ttft.observe(time.monotonic() - self.started)
                self.tokens += 1
                self.metrics.generation_tokens.inc()
            if event.finish_reason is not None:
                self.finish = event.finish_reason
            yield event
        self.metrics.e2e.observe(time.monotonic() - self.started)

    def chunk(self, text: str, finish: str | None, usage_: dict | None = None) -> dict:
        """One stream chunk in the run's wire form (chat delta or completion text)."""
        if self.kind == "chat":
            return chat_chunk(self.rid, self.model, {"content": text} if text else {}, finish, usage_)
        return completion_chunk(self.rid, self.model, text, finish, usage_)


def _sse(body: dict) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class _EventStream(Response):
    """Server-sent events fed by a generation; each write must drain within the stall deadline."""

    media_type = "text/event-stream"

    def __init__(
        self, run: _Run, include_usage: bool, gone: asyncio.Future, request: Request, stall_s: float
    ) -> None:
        super().__init__()
        # Chunked: no Content-Length (Response would write 0 for an empty body).
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
        ]
        self.run = run
        self.include_usage = include_usage
        self.gone = gone
        self.request = request
        self.stall_s = stall_s

    async def _chunks(self) -> AsyncIterator[bytes]:
        run = self.run
        if run.kind == "chat":
            yield _sse(chat_chunk(run.rid, run.model, {"role": "assistant", "content": ""}, None))
        try:
            async for event in run.events():
                if event.text:
                    yield _sse(run.chunk(event.text, None))
            yield _sse(run.chunk("", run.finish))
            if self.include_usage:
                yield _sse(run.chunk("", None, usage(run.prompt_tokens, run.tokens)))
        except ApiError as exc:
            # Headers are sent: the failure can only travel as an event in the stream.
            yield _sse(exc.body())
        yield b"data: [DONE]\n\n"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        metrics = self.run.metrics
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for data in self._chunks():
                try:
                    async with asyncio.timeout(self.stall_s):
                        await send({"type": "http.response.body", "body": data, "more_body": True})
                except TimeoutError:
                    # The client stopped reading: free the engine; the server closes the connection.
                    self.run.generation.cancel()
                    metrics.cancelled.labels(reason="stalled").inc()
                    _status_of(self.request, GONE)
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Cancelled:
            metrics.cancelled.labels(reason="disconnect").inc()
            _status_of(self.request, GONE)
        finally:
            self.gone.cancel()
            self.run.generation.cancel()


# -- the app ---------------------------------------------------------------------------------------


def build_api(server: AgentApp) -> ASGIApp:
    """The public API app: routes, OpenAI-shaped errors, API keys, the request counter."""

    async def admin_elsewhere(request: Request) -> Response:
        raise ApiError(
            403,
            "the admin surface is not on the API port; on the device, use `sits-agent reload` "
            f"(it talks to the unix socket {server.settings.admin_socket_path})",
            type_="permission_error",
            code="admin_not_here",
        )

    app = Starlette(
        routes=[
            *info_routes(server),
            *_generation_routes(server),
            Route("/admin/{rest:path}", endpoint(admin_elsewhere), methods=["GET", "POST", "PUT", "DELETE"]),
        ],
        exception_handlers={HTTPException: http_error},
    )
    return _Counted(_Guard(app, server), server.metrics, API_PATHS)
