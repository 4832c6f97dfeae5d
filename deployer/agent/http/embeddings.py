"""/v1/embeddings: the served model's own embeddings (its last hidden states, mean-pooled and
L2-normalised, computed by the engine), as floats or as base64 of little-endian float32 (what the
official client asks for by default).

An embedding runs on the active model's engine thread, so it never races the batch, in pieces
(`Engine.embed_pieces`, the scheduler's `embed`): a decode step of the running batch
comes between two pieces, so streaming clients wait for one piece (inputs of up to
EMBED_PIECE_TOKENS tokens together, or one longer input), not for the whole request. The lease
is held only to hand the work over: the scheduler then keeps the model until it is done.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from deployer.agent.openai.schemas import ApiError, EmbeddingRequest
from deployer.agent.runtime.hotswap import ModelManager
from deployer.agent.serving.generate import api_error
from deployer.agent.types import EngineInfo

__all__ = ["Embedded", "embed", "embedding_body"]


@dataclass(frozen=True)
class Embedded:
    """What the engine computed: one vector per input, the tokens read, and the model."""

    vectors: list[list[float]]
    tokens: int
    info: EngineInfo


async def embed(
    manager: ModelManager,
    texts: list[str],
    check: Callable[[EngineInfo], None],
) -> Embedded:
    """Embed `texts` with the active model after `check` accepts it (it raises ApiError 404 for
    another model's name); ApiError for every failure."""

    try:
        with manager.lease() as served:
            check(served.info)
            done = served.scheduler.embed(texts)
        # A cancelled wait (the client left) cancels the future: the rest of the work is dropped.
        vectors, tokens = await asyncio.wrap_future(done)
    except Exception as exc:
        raise api_error(exc) from exc
    return Embedded(vectors, tokens, served.info)


def embedding_body(request: EmbeddingRequest, done: Embedded, model: str) -> dict:
    """The response body; ApiError 400 for `dimensions` other than the model's (never shortened)."""
    size = len(done.vectors[0]) if done.vectors else 0
    if request.dimensions is not None and request.dimensions != size:
        raise ApiError(
            400,
            f"dimensions {request.dimensions}: this model's embeddings have {size}, and they are not "
            "shortened here",
            param="dimensions",
            code="unsupported_value",
        )
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(v, request.encoding_format)}
        for i, v in enumerate(done.vectors)
    ]
    usage = {"prompt_tokens": done.tokens, "total_tokens": done.tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def _encode(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector
