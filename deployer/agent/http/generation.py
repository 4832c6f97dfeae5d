"""POST /v1/chat/completions, /v1/completions and /v1/embeddings: parse and check the request,
turn it into one job per choice (`n`), and answer as JSON or as a stream. Generation goes through
the one seam in generate.py. A client that leaves has its generation cancelled (status 499 in the
request counter).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time

from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive

from deployer.agent.http.contract import AgentApp
from deployer.agent.http.embeddings import embed, embedding_body
from deployer.agent.http.info import check_model, model_id
from deployer.agent.http.middleware import GONE, endpoint, read_json, record_status
from deployer.agent.http.streaming import EventStream, Run, served_headers, start_generation
from deployer.agent.openai.choices import Kind, envelope
from deployer.agent.openai.constraints import grammar_for
from deployer.agent.openai.schemas import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ignored_fields,
    parse_request,
)
from deployer.agent.serving.generate import Cancelled, Job
from deployer.agent.settings import AgentSettings
from deployer.agent.types import EngineInfo, SamplingParams, TokenEvent

__all__ = ["generation_routes", "report_ignored"]

_log = logging.getLogger("sits.agent")


def generation_routes(server: AgentApp) -> list[Route]:
    """POST /v1/chat/completions, /v1/completions and /v1/embeddings."""

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
        record_status(request, GONE)
        return Response(status_code=GONE)
    body: ChatCompletionRequest | CompletionRequest = (
        parse_request(ChatCompletionRequest, data)
        if kind == "chat"
        else parse_request(CompletionRequest, data)
    )
    report_ignored(server, body)
    try:
        return await _answer(server, request, kind, body, started)
    except ApiError as exc:
        if exc.status == 400 and exc.param is None:
            exc.param = _constrained_by(body)
        raise


def _constrained_by(body: ChatCompletionRequest | CompletionRequest) -> str | None:
    """The field whose grammar constrains the answer (tools, else response_format), or None.

    Every refusal of a request's other fields names its field where it is raised (here, in the
    schemas, or by the engine for logit_bias and embedding inputs); the grammar's do not: the
    constraints compiler and the engine see a grammar, not where it came from."""
    if not isinstance(body, ChatCompletionRequest):
        return None
    if body.tool_mode() != "none":
        return "tools"
    if body.response_format is not None and body.response_format.type != "text":
        return "response_format"
    return None


async def _answer(
    server: AgentApp,
    request: Request,
    kind: Kind,
    body: ChatCompletionRequest | CompletionRequest,
    started: float,
) -> Response:
    settings = server.settings
    jobs = await _jobs(body, settings, fallback=request.headers.get("x-sits-fallback", "").lower() != "off")
    gone = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        first = await start_generation(server, jobs[0], gone)
    except Cancelled:
        record_status(request, GONE)
        server.metrics.cancelled.labels(reason="disconnect").inc()
        return Response(status_code=GONE)
    except BaseException:
        gone.cancel()
        raise
    run = Run(kind, body, server, jobs, first, started, gone)
    gone.add_done_callback(lambda _: run.cancel())
    if body.stream:
        return EventStream(run, body.include_usage(), gone, request, settings.stall_timeout_s)
    events: list[list[TokenEvent]] = [[] for _ in jobs]
    try:
        async for index, event in run.events():
            events[index].append(event)
    except Cancelled:
        record_status(request, GONE)
        server.metrics.cancelled.labels(reason="disconnect").inc()
        return Response(status_code=GONE)
    finally:
        gone.cancel()
    choices = [c.body(events[c.index], run.finish[c.index]) for c in run.choices]
    answer = envelope(run.rid, kind, run.model, choices, chunk=False, usage=run.usage()) | run.served_field()
    return JSONResponse(answer, headers=served_headers(run.served_by))


async def _jobs(
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
        grammar = await asyncio.to_thread(grammar_for, body)  # compiling takes up to a second
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
    name = request.max_tokens_param()
    if requested > settings.max_tokens:
        raise ApiError(
            400,
            f"{name} {requested} is above this agent's limit of {settings.max_tokens}",
            param=name,
            code="invalid_value",
        )
    if requested > room:
        raise ApiError(
            400,
            f"{name} {requested} plus the prompt's {prompt_len} tokens exceed the model's context "
            f"of {context} tokens",
            param=name,
            code="context_length_exceeded",
        )
    return requested


async def _wait_disconnect(receive: Receive) -> None:
    """Return when the client has gone (uvicorn also says so once the response is complete)."""
    while (await receive())["type"] != "http.disconnect":
        pass
