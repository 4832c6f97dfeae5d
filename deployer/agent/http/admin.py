"""The admin surface: POST /admin/reload (and /admin/adapters/reload, /admin/adapters/smoke for
LoRA adapters) on a unix socket that only the agent's user (and root) can
use, apart from the API port.

A reload names a version already verified and recorded in the device store (or none: the store's
`current` pointer); it never takes a path, so nothing but what `sits-agent install` verified can
be served. Requests a browser could send are refused: any `Origin` or `Sec-Fetch-Site` header
(403), and a POST whose body is not declared as JSON (415), which no cross-site form can declare
without a preflight. The read-only routes (/healthz, /readyz, /metrics, /v1/models) are served
here too, so the device's own commands need no API key.
"""

from __future__ import annotations

import asyncio
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from deployer.agent.http.contract import AgentApp
from deployer.agent.http.info import info_routes
from deployer.agent.http.middleware import endpoint, error_response, http_error, read_json
from deployer.agent.openai.schemas import ApiError
from deployer.agent.runtime.hotswap import SmokeFailed, Unavailable
from deployer.agent.serving.generate import api_error
from deployer.errors import SitsError

__all__ = ["AdapterRequest", "ReloadRequest", "build_admin"]

_Body = TypeVar("_Body", bound=BaseModel)


class ReloadRequest(BaseModel):
    """Body of POST /admin/reload; empty means "the store's current version"."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: str | None = Field(default=None, min_length=1, max_length=128)
    reason: Literal["reload", "update", "rollback"] = "reload"


class AdapterRequest(BaseModel):
    """Body of POST /admin/adapters/reload and /admin/adapters/smoke: an installed adapter's name
    (a reload loads the store's current version of it, never a path)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class _NoBrowsers:
    """Refuses what a web page could make a browser send to a local endpoint."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            error = None
            if "origin" in headers or headers.get("sec-fetch-site", "none") != "none":
                error = ApiError(
                    403, "browser-originated requests are refused here", type_="permission_error"
                )
            elif scope["method"] == "POST" and headers.get("content-type", "").split(";")[0].strip() != (
                "application/json"
            ):
                error = ApiError(415, "send the body as Content-Type: application/json", code="invalid_type")
            if error is not None:
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_admin(server: AgentApp) -> ASGIApp:
    """The admin app served on the unix socket."""

    async def reload(request: Request) -> Response:
        body = await _parse(request, server, ReloadRequest)
        if body.version is not None:
            _check_verified(server, body.version)
        try:
            result = await asyncio.to_thread(server.reload, None, body.version, reason=body.reason)
        except SitsError as exc:
            raise ApiError(409, exc.message, type_="reload_error", code="no_version") from exc
        return JSONResponse(result.to_dict(), 200 if result.ok else 409)

    async def reload_adapter(request: Request) -> Response:
        name = (await _parse(request, server, AdapterRequest)).name
        try:
            loaded = await asyncio.to_thread(server.manager.reload_adapter, name)
        except Unavailable as exc:
            raise api_error(exc) from exc
        except SitsError as exc:
            raise ApiError(409, exc.message, type_="reload_error", code="adapter_not_loaded") from exc
        if loaded is None:
            return JSONResponse({"name": name, "version": None, "status": "unloaded"})
        return JSONResponse({"name": name, "version": loaded.version, "status": "loaded"})

    async def smoke_adapter(request: Request) -> Response:
        name = (await _parse(request, server, AdapterRequest)).name
        try:
            version, times = await asyncio.to_thread(server.manager.smoke_adapter, name)
        except Unavailable as exc:
            raise api_error(exc) from exc
        except SmokeFailed as failed:
            adapters = server.manager.active_adapters()
            loaded = adapters.get(name) if adapters is not None else None
            now = loaded.version if loaded is not None else None
            return JSONResponse({"name": name, "version": now, "ok": False, "detail": str(failed)})
        except SitsError as exc:
            raise ApiError(404, exc.message, param="name", code="model_not_found") from exc
        detail = "smoke prompts answered in " + ", ".join(f"{t:.0f} ms" for t in times)
        return JSONResponse({"name": name, "version": version, "ok": True, "detail": detail})

    app = Starlette(
        routes=[
            *info_routes(server),
            Route("/admin/reload", endpoint(reload), methods=["POST"]),
            Route("/admin/adapters/reload", endpoint(reload_adapter), methods=["POST"]),
            Route("/admin/adapters/smoke", endpoint(smoke_adapter), methods=["POST"]),
        ],
        exception_handlers={HTTPException: http_error},
    )
    return _NoBrowsers(app)


async def _parse(request: Request, server: AgentApp, model: type[_Body]) -> _Body:
    """The request's JSON body as `model` (an empty body: its defaults), or ApiError 400."""
    data = await read_json(request, server.settings)
    try:
        return model.model_validate(data if data is not None else {})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise ApiError(
            400, f"invalid {request.url.path} request: {where}: {first['msg']}", code="invalid_value"
        ) from exc


def _check_verified(server: AgentApp, version: str) -> None:
    """ApiError 409 unless `version` was installed through verification and is not marked failed."""
    state = server.store.read_state()
    record = state.versions.get(version)
    if record is None or not server.store.version_dir(version).is_dir():
        raise ApiError(
            409,
            f"version {version!r} is not a verified version in {server.store.base}",
            type_="reload_error",
            code="not_verified",
        )
    if record.failed:
        raise ApiError(
            409,
            f"version {version!r} is marked failed in {server.store.base}",
            type_="reload_error",
            code="failed_version",
        )
