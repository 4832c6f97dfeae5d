"""A request's choices as they are generated: the run of its `n` generations (ids, token counts,
finish reasons, latency metrics) and its server-sent events. A client that stops reading for
`stall_timeout_s` has its generation cancelled (status 499 in the request counter).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from deployer.agent.http.contract import AgentApp
from deployer.agent.http.info import model_id
from deployer.agent.http.middleware import GONE, record_status
from deployer.agent.openai.choices import Choice, Kind, envelope
from deployer.agent.openai.schemas import ApiError, ChatCompletionRequest, CompletionRequest, new_id, usage
from deployer.agent.serving.generate import Cancelled, Generation, Job, Metered, ServedBy
from deployer.agent.types import TokenEvent

__all__ = ["EventStream", "Run", "served_headers", "start_generation"]


async def start_generation(server: AgentApp, job: Job, gone: asyncio.Future) -> Generation:
    """Start the job, or raise Cancelled when the client leaves first (e.g. while queued)."""
    start = asyncio.ensure_future(server.source.start(job))
    await asyncio.wait({start, gone}, return_when=asyncio.FIRST_COMPLETED)
    if start.done():
        return start.result()
    start.cancel()
    with contextlib.suppress(asyncio.CancelledError, ApiError, Cancelled):
        await start
    raise Cancelled()


def served_headers(served: ServedBy) -> dict[str, str]:
    """`x-sits-served-by: edge|upstream`, and for an upstream answer `x-sits-fallback-reason`."""
    headers: dict[str, str] = {"x-sits-served-by": served.by}
    if served.reason:
        headers["x-sits-fallback-reason"] = served.reason
    return headers


_CHOICE_EVENTS = 64  # events of a request's n choices buffered between their readers and the answer


class Run:
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
        # The per-request metrics' label: the LoRA adapter that answers ("" for the base model).
        self.adapter = first.started.adapter or ""
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
        self.metrics.prompt_tokens.labels(adapter=self.adapter).inc(self.prompt_tokens)

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
        self.metrics.e2e.labels(adapter=self.adapter).observe(time.monotonic() - self._started)
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
                self.metrics.ttft.labels(adapter=self.adapter).observe(time.monotonic() - self._started)
            self.tokens += 1
            self.metrics.generation_tokens.labels(adapter=self.adapter).inc()
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
                    generation = await start_generation(self._server, job, self._gone)
                    self._generations.append(generation)
                    if self._cancelled:
                        generation.cancel()
                    self.metrics.prompt_tokens.labels(adapter=self.adapter).inc(
                        generation.started.prompt_tokens
                    )
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


class EventStream(Response):
    """Server-sent events fed by a generation; each write must drain within the stall deadline."""

    media_type = "text/event-stream"

    def __init__(
        self, run: Run, include_usage: bool, gone: asyncio.Future, request: Request, stall_s: float
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
                    record_status(self.request, GONE)
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Cancelled:
            metrics.cancelled.labels(reason="disconnect").inc()
            record_status(self.request, GONE)
        finally:
            self.gone.cancel()
            self.run.cancel()
