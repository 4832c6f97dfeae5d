"""/healthz, /readyz, /metrics and /v1/models, and the model ids responses carry."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from deployer.agent.http.contract import AgentApp
from deployer.agent.http.metrics import CONTENT_TYPE
from deployer.agent.http.middleware import endpoint
from deployer.agent.openai.schemas import ApiError
from deployer.agent.runtime.adapters import LoadedAdapter
from deployer.agent.types import EngineInfo

__all__ = ["check_model", "info_routes", "model_id"]


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
        adapters = server.manager.active_adapters()
        known = adapters.known() if adapters is not None else []
        server.metrics.set_adapters([(a.name, a.version, loaded) for a, loaded in known])
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    def entries() -> list[dict]:
        active = server.manager.active_status()
        listed = [
            _model_entry(info, status)
            for info, status in ((active, "active"), (server.manager.previous_info(), "previous"))
            if info is not None
        ]
        adapters = server.manager.active_adapters()
        if active is not None and adapters is not None:
            listed += [_adapter_entry(a, loaded, active) for a, loaded in adapters.known()]
        return listed

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


def _adapter_entry(adapter: LoadedAdapter, loaded: bool, base: EngineInfo) -> dict:
    """A LoRA adapter's entry: its id is its name (what a request's `model` names), its parent the
    base model it runs on."""
    return {
        "id": adapter.name,
        "object": "model",
        "created": 0,
        "owned_by": "sits",
        "status": "active",
        "loaded": loaded,
        "parent": model_id(base),
        "version": adapter.version,
        "artifact_id": adapter.artifact_id,
        "kind": "lora",
    }


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
