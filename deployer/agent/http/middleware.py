"""The ASGI plumbing the API and the admin app share: OpenAI-style error bodies for every failure
a client can cause (404 and 405 too; nothing a client sends can stop the server), the request
counter, the header-size and API-key guard, and the bounded reading of a JSON body.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import re
from collections.abc import Awaitable, Callable

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deployer.agent.http.contract import AgentApp
from deployer.agent.http.metrics import AgentMetrics
from deployer.agent.openai.schemas import ApiError
from deployer.agent.settings import AgentSettings

__all__ = [
    "GONE",
    "OPEN_PATHS",
    "Counted",
    "Guard",
    "endpoint",
    "error_response",
    "http_error",
    "read_json",
    "record_status",
]

_log = logging.getLogger("sits.agent")
OPEN_PATHS = frozenset({"/healthz", "/readyz"})  # never behind a key: probes and load balancers
GONE = 499  # nginx's "client closed request", as counted in sits_requests_total


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


def record_status(request: Request, status: int) -> None:
    """Record the status the request counter should see (a stream's outcome is known only at its end)."""
    request.scope["sits"]["status"] = status


class Counted:
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


# A Host header: a name or IPv4 address, or an IPv6 address in brackets, with an optional port.
_HOST = re.compile(r"^(?:\[(?P<v6>[0-9a-f:.]+)\]|(?P<name>[a-z0-9._-]+))(?::[0-9]{1,5})?$")


def host_names(settings: AgentSettings) -> frozenset[str]:
    """The Host names a keyless agent answers to besides loopback addresses: localhost, agent.yaml's
    `host` and its `allowed_hosts`."""
    names = ("localhost", settings.host, *settings.allowed_hosts)
    return frozenset(name.lower().strip("[]") for name in names)


def host_allowed(header: str, names: frozenset[str]) -> bool:
    """Whether a request's Host header names this agent: one of `names` or a loopback address, with
    any port."""
    match = _HOST.match(header.strip().lower())
    if match is None:
        return False
    name = match["v6"] or match["name"].removesuffix(".")
    if name in names:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class Guard:
    """Header size (h11 bounds only headers still arriving); then, on a keyless agent, the Host
    header (a web page whose name was rebound to 127.0.0.1 must not reach the model: DNS
    rebinding); then bearer keys on every route but the open ones (and /metrics when metrics_auth
    is "none")."""

    def __init__(self, app: ASGIApp, server: AgentApp) -> None:
        self.app = app
        self.server = server
        self.host_names = host_names(server.settings)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        limit = self.server.settings.max_header_bytes
        if scope["type"] == "http" and sum(len(k) + len(v) + 4 for k, v in scope["headers"]) > limit:
            error = ApiError(431, f"the request headers exceed {limit} bytes", code="headers_too_large")
            await error_response(error)(scope, receive, send)
            return
        if scope["type"] == "http" and not self.server.keyring.required:
            host = Headers(scope=scope).get("host")
            # No Host at all (HTTP/1.0) comes from no browser, so it cannot be DNS rebinding.
            if host is not None and not host_allowed(host, self.host_names):
                self.server.metrics.auth_failures.labels(reason="foreign_host").inc()
                error = ApiError(
                    403,
                    f"the Host header {host[:100]!r} does not name this agent: without API keys it "
                    "answers only to localhost, its loopback addresses and agent.yaml's allowed_hosts",
                    type_="permission_error",
                    code="host_not_allowed",
                )
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
