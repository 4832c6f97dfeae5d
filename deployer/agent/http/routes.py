"""The agent's public API as a Starlette app: OpenAI-compatible generation, models, health, metrics.

Every failure a client can cause is answered with an OpenAI-style error body (404 and 405 too);
nothing a client sends can stop the server. Generation goes through the one seam in generate.py;
this module only parses, checks, streams and counts. A client that leaves, or stops reading for
`stall_timeout_s`, has its generation cancelled (status 499 in the request counter).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deployer.agent.http.auth import KeyRing
from deployer.agent.http.embeddings import embed, embedding_body
from deployer.agent.http.metrics import CONTENT_TYPE, AgentMetrics
from deployer.agent.openai.choices import Choice, Kind, envelope
from deployer.agent.openai.constraints import grammar_for
from deployer.agent.openai.schemas import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ignored_fields,
    new_id,
    parse_request,
    usage,
)
from deployer.agent.ota.store import DeviceStore
from deployer.agent.runtime.hotswap import ModelManager, SwapResult
from deployer.agent.serving.generate import (
    Cancelled,
    Generation,
    Job,
    Metered,
    ServedBy,
    TokenSource,
)
from deployer.agent.settings import AgentSettings
from deployer.agent.types import EngineInfo, SamplingParams, TokenEvent

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
OPEN_PATHS = frozenset({"/healthz", "/readyz"})  # never behind a key: probes and load balancers
API_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/metrics", *OPEN_PATHS}
)
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

    def entries() -> list[dict]:
        return [
            _model_entry(info, status)
            for info, status in (
                (server.manager.active_status(), "active"),
                (server.manager.previous_info(), "previous"),
            )
            if info is not None
        ]

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": entries()})

    async def model(request: Request) -> Response:
        wanted = request.path_params["model"]
        listed = entries()
        # The bare name is the active model's (the one a request of that name gets).
        found = [e for e in listed if wanted == e["id"]] or [
            e for e in listed if e["status"] == "active" and wanted == e["id"].rsplit("@", 1)[0]
        ]
        if not found:
            raise ApiError(
                404,
                f"the model {wanted!r} does not exist here; GET /v1/models lists those that do",
                param="model",
                code="model_not_found",
            )
        return JSONResponse(found[0])

    return [
        Route("/healthz", endpoint(healthz)),
        Route("/readyz", endpoint(readyz)),
        Route("/metrics", endpoint(metrics)),
        Route("/v1/models", endpoint(models)),
        Route("/v1/models/{model:path}", endpoint(model)),
    ]


def model_id(info: EngineInfo) -> str:
    """The id /v1/models lists and responses carry: `<model>@<version>`."""
    return f"{info.model}@{info.version}"


def check_model(name: str, info: EngineInfo) -> None:
    """ApiError 404 unless `name` is the model that answers: its bare name or `name@version`."""
    if name not in {info.model, model_id(info)}:
        raise ApiError(
            404,
            f"the model {name!r} does not exist here; this agent serves {model_id(info)!r} "
            f"(also accepted: {info.model!r})",
            param="model",
            code="model_not_found",
        )


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
        # How the engine runs it (device choice, compile, kernels, cache): what an operator asks
        # after a load; names and values are strings, none of them a secret.
        "extra": dict(info.extra),
    }


# -- generation ------------------------------------------------------------------------------------


def _generation_routes(server: AgentApp) -> list[Route]:
    async def chat(request: Request) -> Response:
        return await _generate(server, request, "chat")

    async def completions(request: Request) -> Response:
        return await _generate(server, request, "completion")

    async def embeddings(request: Request) -> Response:
        body = parse_request(EmbeddingRequest, await read_json(request, server.settings))
        report_ignored(server, body)
        done = await embed(server.manager, body.texts(), lambda info: check_model(body.model, info))
        return JSONResponse(embedding_body(body, done, model_id(done.info)))

    return [
        Route("/v1/chat/completions", endpoint(chat), methods=["POST"]),
        Route("/v1/completions", endpoint(completions), methods=["POST"]),
        Route("/v1/embeddings", endpoint(embeddings), methods=["POST"]),
    ]


def report_ignored(server: AgentApp, body: BaseModel) -> None:
    """Count (and log, once per name) the request fields nothing here reads."""
    for name in ignored_fields(body):
        if server.metrics.ignored_field(name):
            _log.warning("ignoring the request field %r, which this agent does not use", name)


async def _generate(server: AgentApp, request: Request, kind: Kind) -> Response:
    started = time.monotonic()
    settings = server.settings
    try:
        data = await read_json(request, settings)
    except ClientDisconnect:
        _status_of(request, GONE)
        return Response(status_code=GONE)
    body: ChatCompletionRequest | CompletionRequest = (
        parse_request(ChatCompletionRequest, data)
        if kind == "chat"
        else parse_request(CompletionRequest, data)
    )
    report_ignored(server, body)
    jobs = _jobs(body, settings, fallback=request.headers.get("x-sits-fallback", "").lower() != "off")
    gone = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        first = await _start(server, jobs[0], gone)
    except Cancelled:
        _status_of(request, GONE)
        server.metrics.cancelled.labels(reason="disconnect").inc()
        return Response(status_code=GONE)
    except BaseException:
        gone.cancel()
        raise
    run = _Run(kind, body, server, jobs, first, started, gone)
    gone.add_done_callback(lambda _: run.cancel())
    if body.stream:
        return _EventStream(run, body.include_usage(), gone, request, settings.stall_timeout_s)
    events: list[list[TokenEvent]] = [[] for _ in jobs]
    try:
        async for index, event in run.events():
            events[index].append(event)
    except Cancelled:
        _status_of(request, GONE)
        server.metrics.cancelled.labels(reason="disconnect").inc()
        return Response(status_code=GONE)
    finally:
        gone.cancel()
    choices = [c.body(events[c.index], run.finish[c.index]) for c in run.choices]
    answer = envelope(run.rid, kind, run.model, choices, chunk=False, usage=run.usage()) | run.served_field()
    return JSONResponse(answer, headers=served_headers(run.served_by))


def _jobs(
    body: ChatCompletionRequest | CompletionRequest, settings: AgentSettings, *, fallback: bool
) -> list[Job]:
    """One job per choice (`n`), or ApiError 400 for what cannot be honoured. `fallback`: whether
    the upstream may answer (False under `x-sits-fallback: off`)."""
    if body.n > settings.max_concurrent:
        raise ApiError(
            400,
            f"n {body.n} is above the {settings.max_concurrent} sequences this agent generates at once",
            param="n",
            code="invalid_value",
        )
    if isinstance(body, ChatCompletionRequest):
        grammar = grammar_for(body)
        tools = (
            None
            if body.tool_mode() == "none"
            else [t.model_dump(exclude_none=True) for t in body.tools or ()]
        )
        messages = tuple(m.to_chat_message() for m in body.messages)
        text = suffix = None
    else:
        if body.echo and body.logprobs is not None:
            raise ApiError(
                400,
                "echo with logprobs needs the prompt's logprobs, which this agent does not compute",
                param="echo",
                code="unsupported_parameter",
            )
        grammar, tools, messages, text, suffix = None, None, None, body.prompt_text(), body.suffix
    return [
        Job(
            messages=messages,
            text=text,
            plan=functools.partial(_plan, body, settings=settings, grammar=grammar, index=i),
            tools=tuple(tools) if tools else None,
            suffix=suffix,
            request=body,
            fallback=fallback,
        )
        for i in range(body.n)
    ]


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
    *,
    settings: AgentSettings,
    grammar: str | None,
    index: int,
) -> SamplingParams:
    """Check the model name and the token budget against the model that will answer; choice
    `index` of a seeded request gets seed + index (n samples, not n copies)."""
    check_model(request.model, info)
    params = request.sampling(_max_tokens(request, prompt_len, info.context_length, settings), grammar)
    if params.seed is not None and index:
        params = dataclasses.replace(params, seed=(params.seed + index) % 2**64)
    return params


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


def served_headers(served: ServedBy) -> dict[str, str]:
    """`x-sits-served-by: edge|upstream`, and for an upstream answer `x-sits-fallback-reason`."""
    headers: dict[str, str] = {"x-sits-served-by": served.by}
    if served.reason:
        headers["x-sits-fallback-reason"] = served.reason
    return headers


_CHOICE_EVENTS = 64  # events of a request's n choices buffered between their readers and the answer


class _Run:
    """One request's generations, one per choice: id, model, tokens, finish reasons, and the
    latency metrics. The first generation is started by the route (so its errors are the HTTP
    answer); the others start as the events are read."""

    def __init__(
        self,
        kind: Kind,
        body: ChatCompletionRequest | CompletionRequest,
        server: AgentApp,
        jobs: list[Job],
        first: Generation,
        started: float,
        gone: asyncio.Future,
    ) -> None:
        self.kind = kind
        self.rid = new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.served_by = first.started.served_by
        self.model = self.served_by.model or model_id(first.started.info)
        self.prompt_tokens = first.started.prompt_tokens
        self.metrics = server.metrics
        self.tokens = 0
        self.finish = ["stop"] * len(jobs)
        names = None
        if isinstance(body, ChatCompletionRequest) and body.tool_mode() != "none":
            names = {t.function.name for t in body.tools or ()}
        echo = body.prompt_text() if isinstance(body, CompletionRequest) and body.echo else ""
        logprobs = body.top_logprobs_count() is not None
        self.choices = [Choice(i, kind, tools=names, logprobs=logprobs, echo=echo) for i in range(len(jobs))]
        self._server, self._jobs, self._started, self._gone = server, jobs, started, gone
        self._generations = [first]
        self._cancelled = False
        self.metrics.prompt_tokens.inc(self.prompt_tokens)

    def usage(self) -> dict:
        """The `usage` object: the prompt once, every choice's tokens."""
        return usage(self.prompt_tokens, self.tokens)

    def cancel(self) -> None:
        """Cancel every generation started so far (and those that start later)."""
        self._cancelled = True
        for generation in self._generations:
            generation.cancel()

    async def events(self) -> AsyncIterator[tuple[int, TokenEvent]]:
        """(choice index, event) until every generation has ended, counting tokens and observing
        TTFT and end-to-end latency."""
        if len(self._jobs) == 1:
            async for event in self._generations[0].events():
                yield 0, self._count(0, event)
        else:
            async for index, event in self._merged():
                yield index, self._count(index, event)
        self.metrics.e2e.observe(time.monotonic() - self._started)
        only = self._generations[0] if len(self._jobs) == 1 else None
        reported = only.usage() if isinstance(only, Metered) else None
        if reported is not None:  # an upstream's own count of its tokens
            self.prompt_tokens, self.tokens = reported

    def served_field(self) -> dict:
        """The extension field every answer and chunk carries: who answered, and why."""
        served = self.served_by
        return {"sits": {"served_by": served.by, "fallback_reason": served.reason, "detail": served.detail}}

    def _count(self, index: int, event: TokenEvent) -> TokenEvent:
        if event.token_id is not None:
            if self.tokens == 0:
                self.metrics.ttft.observe(time.monotonic() - self._started)
            self.tokens += 1
            self.metrics.generation_tokens.inc()
        if event.finish_reason is not None:
            self.finish[index] = event.finish_reason
        return event

    async def _merged(self) -> AsyncIterator[tuple[int, TokenEvent]]:
        queue: asyncio.Queue[tuple[int, TokenEvent | BaseException | None]] = asyncio.Queue(_CHOICE_EVENTS)

        async def pump(index: int) -> None:
            try:
                if index == 0:
                    generation = self._generations[0]
                else:
                    # The first choice's answerer answers this one too: one model per answer.
                    job = dataclasses.replace(self._jobs[index], answerer=self.served_by)
                    generation = await _start(self._server, job, self._gone)
                    self._generations.append(generation)
                    if self._cancelled:
                        generation.cancel()
                    self.metrics.prompt_tokens.inc(generation.started.prompt_tokens)
                async for event in generation.events():
                    await queue.put((index, event))
                await queue.put((index, None))
            except Exception as exc:  # ApiError, Cancelled: the reader raises it
                await queue.put((index, exc))

        pumps = [asyncio.ensure_future(pump(i)) for i in range(len(self._jobs))]
        try:
            running = len(pumps)
            while running:
                index, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            self.cancel()
            for task in pumps:
                task.cancel()


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
            *((k.encode(), v.encode()) for k, v in served_headers(run.served_by).items()),
        ]
        self.run = run
        self.include_usage = include_usage
        self.gone = gone
        self.request = request
        self.stall_s = stall_s

    async def _chunks(self) -> AsyncIterator[bytes]:
        run = self.run

        def chunk(*choices: dict, **extra: Any) -> bytes:
            body = envelope(run.rid, run.kind, run.model, list(choices), chunk=True, **extra)
            return _sse(body | run.served_field())

        if run.kind == "chat":
            for choice in run.choices:
                yield chunk(choice.opening())
        try:
            async for index, event in run.events():
                choice = run.choices[index]
                part = choice.add(event)
                if part is not None:
                    yield chunk(part)
                if event.finish_reason is not None:
                    yield chunk(choice.close(event.finish_reason))
            if self.include_usage:
                yield chunk(usage=run.usage())
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
                    self.run.cancel()
                    metrics.cancelled.labels(reason="stalled").inc()
                    _status_of(self.request, GONE)
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Cancelled:
            metrics.cancelled.labels(reason="disconnect").inc()
            _status_of(self.request, GONE)
        finally:
            self.gone.cancel()
            self.run.cancel()


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
