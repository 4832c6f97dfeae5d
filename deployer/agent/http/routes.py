"""The agent's public API as a Starlette app: OpenAI-compatible generation (generation.py, its
choices streamed by streaming.py), models, health and metrics (info.py), behind the error
plumbing, API keys and request counter of middleware.py.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from deployer.agent.http.contract import AgentApp
from deployer.agent.http.generation import generation_routes
from deployer.agent.http.info import info_routes
from deployer.agent.http.middleware import OPEN_PATHS, Counted, Guard, endpoint, http_error
from deployer.agent.openai.schemas import ApiError

__all__ = ["AgentApp", "build_api"]

API_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/metrics", *OPEN_PATHS}
)


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
            *generation_routes(server),
            Route("/admin/{rest:path}", endpoint(admin_elsewhere), methods=["GET", "POST", "PUT", "DELETE"]),
        ],
        exception_handlers={HTTPException: http_error},
    )
    return Counted(Guard(app, server), server.metrics, API_PATHS)
