"""The edge-cloud fallback as a TokenSource: per request, the device's own model or the upstream's,
never both in one answer.

    policy off         every request goes to the device's model (so does a request sent with
                       `x-sits-fallback: off`, as the controller's health checks are)
    policy always      every request goes upstream first; the device answers when the upstream cannot
    policy on-trigger  the device answers unless a trigger fires:
      not_ready    no model is loaded (loading, or the load failed), or the source says so (503)
      overloaded   the source refused the request (queue full, out of memory, waited too long)
      deadline     the source's own estimate of the first token (queue position × recent service
                   time + prefill) is past `deadline_ms`, and the upstream's recent P95 is shorter;
                   or, once started, no first token came within `deadline_ms`: then the upstream is
                   asked too and the first of the two to produce a token answers, the other is
                   cancelled (so a late device still answers when the upstream cannot)
      confidence   the mean probability of the device's first `confidence_tokens` tokens is below
                   `min_confidence`: those tokens are discarded and the upstream answers (the device
                   does when the upstream cannot: its answer exists). The device's engine is asked
                   for each token's logprob to judge it (the answer shows them only if the client
                   asked), and the first tokens are read ahead before anything leaves

A request's later choices (`n` > 1) go to whoever answered its first (Job.answerer), without
triggers of their own; when the upstream cannot answer one of them, the answer fails rather than
take it from the device.

`start` returns only once the answerer's first token is in hand (or its tokenless answer is
complete), and with `min_confidence` once the device's first tokens are judged, which is how no
answer mixes two models: the decision falls before anything leaves.
The upstream's failures (unreachable, too slow, error status, not an OpenAI stream) feed a circuit
breaker; when the upstream cannot answer, the device does where it can, else the request fails
with 502 (the upstream answered badly) or 503 (it could not be reached, or its breaker is open).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
import weakref
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Literal

from prometheus_client import CollectorRegistry

from deployer.agent.openai.schemas import ApiError
from deployer.agent.serving.fallback.breaker import CircuitBreaker
from deployer.agent.serving.fallback.metrics import RECENT_WINDOW_S, FallbackMetrics
from deployer.agent.serving.fallback.upstream import UpstreamClient, UpstreamFailure, UpstreamGeneration
from deployer.agent.serving.fallback.window import RecentEvents, RecentLatencies
from deployer.agent.serving.generate import Generation, Job, LoadReport, Started, TokenSource
from deployer.agent.settings import FallbackSettings
from deployer.agent.types import EngineInfo, SamplingParams, TokenEvent
from deployer.errors import AgentError

__all__ = ["FallbackSource", "read_api_key"]

_log = logging.getLogger("sits.agent")

# The source's refusals (codes of generate.api_error) that a trigger covers.
_TRIGGERED_BY = {
    "model_unavailable": "not_ready",
    "overloaded": "overloaded",
    "out_of_memory": "overloaded",
    "queue_timeout": "overloaded",
}


def read_api_key(path: Path | None) -> str | None:
    """The upstream's bearer key: the first line of `path`. Raises AgentError naming the file
    (never its content) when it cannot be read or is empty."""
    if path is None:
        return None
    try:
        lines = path.read_text(encoding="utf-8").strip().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8 text"
        raise AgentError(
            f"cannot read the fallback API key file {path}: {reason}",
            hint="the controller writes it (mode 0600) from deploy.yaml's fallback.upstream.api_key",
        ) from None
    if not lines or not lines[0].strip():
        raise AgentError(f"the fallback API key file {path} is empty", hint="put the key on its first line")
    return lines[0].strip()


class FallbackSource:
    """Wraps the device's own source (`local`, which reports its load through `load`)."""

    def __init__(
        self,
        settings: FallbackSettings,
        local: TokenSource,
        load: LoadReport,
        *,
        active_info: Callable[[], EngineInfo | None],
        max_tokens: int,
        registry: CollectorRegistry,
    ) -> None:
        self.settings = settings
        self._local = local
        self._load = load
        self._active_info = active_info
        self._max_tokens = max_tokens
        self._upstream = UpstreamClient(
            settings.base_url,
            settings.model,
            read_api_key(settings.api_key_file),
            first_token_timeout_s=settings.first_token_timeout_s,
            read_timeout_s=settings.read_timeout_s,
        )
        self.breaker = CircuitBreaker(
            settings.breaker_failures, settings.breaker_backoff_s, settings.breaker_max_backoff_s
        )
        self.latencies = RecentLatencies(settings.latency_window)
        self.recent = RecentEvents(RECENT_WINDOW_S)
        self.metrics = FallbackMetrics(
            registry, load.edge_status, lambda: self.breaker.state, self.recent.count
        )
        self._live: weakref.WeakSet[UpstreamGeneration] = weakref.WeakSet()

    # -- TokenSource ------------------------------------------------------------------------------

    async def start(self, job: Job) -> Generation:
        """See TokenSource.start: decide who answers, and return once its first token is in hand."""
        began = time.monotonic()
        policy = self.settings.policy
        if policy == "off" or not job.fallback or (job.answerer is not None and job.answerer.by == "edge"):
            return self._edge(await self._local.start(job))
        if job.answerer is not None:  # a later choice of an answer the upstream gives
            return await self._upstream_else_fail(
                job, job.answerer.reason or "", job.answerer.detail or "", None
            )
        if policy == "always":
            return await self._upstream_else_local(job, "always", "the policy sends every request upstream")
        if self.settings.not_ready and self._load.edge_status() == "offline":
            return await self._upstream_else_fail(job, "not_ready", "no model is loaded on the device", None)
        deadline_ms = self.settings.deadline_ms
        estimate = self._load.first_token_estimate(job) if deadline_ms else None
        if deadline_ms and estimate is not None and estimate * 1000 > deadline_ms:
            p95 = self.latencies.p95()
            if p95 is None or p95 < estimate:
                detail = f"estimated first token in {estimate * 1000:.0f} ms, deadline {deadline_ms} ms"
                if p95 is not None:
                    detail += f", upstream P95 {p95 * 1000:.0f} ms"
                return await self._upstream_else_local(job, "deadline", detail)
        return await self._local_within_deadline(job, began)

    def cancel_all(self) -> None:
        """See TokenSource.cancel_all; closes the upstream's connections too."""
        self._local.cancel_all()
        for generation in list(self._live):
            generation.cancel()
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().create_task(self._upstream.aclose())

    # -- the paths --------------------------------------------------------------------------------

    async def _local_within_deadline(self, job: Job, began: float) -> Generation:
        """The device's answer, unless its first token misses the deadline and the upstream's first
        token comes before it; a refusal a trigger covers goes upstream."""
        local = asyncio.ensure_future(self._local_first(job))
        upstream: asyncio.Future[UpstreamGeneration] | None = None
        try:
            deadline_ms = self.settings.deadline_ms
            timeout = None if deadline_ms is None else max(0.0, began + deadline_ms / 1000 - time.monotonic())
            await asyncio.wait({local}, timeout=timeout)
            if not local.done():
                upstream = asyncio.ensure_future(self._open_upstream(job))
                await asyncio.wait({local, upstream}, return_when=asyncio.FIRST_COMPLETED)
                if not local.done() and upstream.exception() is None:
                    local.cancel()
                    detail = f"no first token within {deadline_ms} ms"
                    return self._served(upstream.result(), "deadline", detail)
            await asyncio.wait({local})
            error = local.exception()
            if error is None:
                return await self._judged(job, local.result(), upstream)
            reason = _TRIGGERED_BY.get(error.code or "") if isinstance(error, ApiError) else None
            if not isinstance(error, ApiError) or reason is None or not getattr(self.settings, reason):
                raise error
            if upstream is not None:  # already asked: its answer, or its failure
                await asyncio.wait({upstream})
                if upstream.exception() is None:
                    return self._served(upstream.result(), reason, error.message)
                raise _failed(error, upstream.exception())
            return await self._upstream_else_fail(job, reason, error.message, error)
        except BaseException:
            for task in (local, upstream):
                if task is not None:
                    _discard(task)
            raise

    async def _judged(
        self, job: Job, local: _ReadAhead, upstream: asyncio.Future[UpstreamGeneration] | None
    ) -> Generation:
        """The device's answer, unless the confidence trigger finds its first tokens unsure: then the
        upstream's (the one the deadline already asked, or asked now); still the device's when the
        upstream cannot answer."""
        threshold = self.settings.min_confidence
        tokens = self.settings.confidence_tokens
        probabilities = [] if threshold is None else await local.probabilities(tokens)
        confidence = sum(probabilities) / len(probabilities) if probabilities else None
        if confidence is not None:
            self.metrics.confidence.observe(confidence)
        if threshold is None or confidence is None or confidence >= threshold:
            if upstream is not None:
                _discard(upstream)  # the device's first token came first after all
            return self._edge(local)
        detail = (
            f"mean probability {confidence:.3f} of the first {len(probabilities)} tokens, "
            f"below min_confidence {threshold:g}"
        )
        try:
            generation = await upstream if upstream is not None else await self._open_upstream(job)
        except UpstreamFailure as exc:
            _log.warning("fallback (confidence): the upstream failed, the device answers: %s", exc.message)
            return self._edge(local)
        local.cancel()  # its tokens were held back: none has left
        return self._served(generation, "confidence", detail)

    async def _upstream_else_local(self, job: Job, reason: str, detail: str) -> Generation:
        """The upstream's answer; the device's when the upstream cannot give one."""
        try:
            generation = await self._open_upstream(job)
        except UpstreamFailure as exc:
            _log.warning("fallback (%s): the upstream failed, the device answers: %s", reason, exc.message)
            return self._edge(await self._local.start(job))
        return self._served(generation, reason, detail)

    async def _upstream_else_fail(
        self, job: Job, reason: str, detail: str, local_error: ApiError | None
    ) -> Generation:
        """The upstream's answer where the device has none; 502/503 when the upstream cannot."""
        try:
            generation = await self._open_upstream(job)
        except UpstreamFailure as exc:
            raise _failed(local_error or ApiError(503, detail, type_="server_error"), exc) from None
        return self._served(generation, reason, detail)

    # -- the two answerers ------------------------------------------------------------------------

    async def _local_first(self, job: Job) -> _ReadAhead:
        """The device's generation, started and with its first event read ahead (and each token's
        logprob asked for when the confidence trigger will judge them)."""
        judged = self.settings.min_confidence is not None
        generation = await self._local.start(_with_logprobs(job) if judged else job)
        try:
            events = generation.events().__aiter__()
            head: list[TokenEvent] = []
            with contextlib.suppress(StopAsyncIteration):
                head.append(await events.__anext__())
            return _ReadAhead(generation, head, events)
        except BaseException:
            generation.cancel()
            raise

    async def _open_upstream(self, job: Job) -> UpstreamGeneration:
        """The upstream's generation with its first token in hand, through the breaker."""
        params = self._upstream_params(job)  # ApiError (the client's mistake) passes through
        body = _upstream_body(job, params)
        if not self.breaker.allow():
            self._count_failure("open")
            raise UpstreamFailure(
                "open",
                f"the upstream failed repeatedly; its circuit breaker is open for "
                f"{self.breaker.retry_after_s():.0f} s more",
            )
        kind: Literal["chat", "completion"] = "chat" if job.messages is not None else "completion"
        try:
            generation = await self._upstream.open(kind, body, max_tokens=params.max_tokens, stop=params.stop)
        except UpstreamFailure as exc:
            self.breaker.failure()
            self._count_failure(exc.kind)
            raise
        except BaseException:
            self.breaker.release()
            raise
        self.breaker.success()
        self.latencies.add(generation.latency_s)
        self.metrics.upstream_latency.observe(generation.latency_s)
        self._live.add(generation)
        return generation

    def _upstream_params(self, job: Job) -> SamplingParams:
        """The request's sampling; with a model loaded, through the device's own checks (the model
        name, the max_tokens limit), so that a request is refused alike whoever would answer it."""
        info = self._active_info()
        if info is not None:
            return job.plan(1, info)
        request = job.request
        # No grammar: the upstream is sent the request's own constraints (tools, response_format).
        return request.sampling(
            min(request.requested_max_tokens() or self._max_tokens, self._max_tokens), None
        )

    # -- bookkeeping ------------------------------------------------------------------------------

    def _edge(self, generation: Generation) -> Generation:
        self.metrics.answers.labels(served_by="edge").inc()
        return generation

    def _served(self, generation: UpstreamGeneration, reason: str, detail: str) -> Generation:
        generation.served(reason, detail)
        self.recent.add()
        self.metrics.answers.labels(served_by="upstream").inc()
        self.metrics.fallbacks.labels(reason=reason).inc()
        return generation

    def _count_failure(self, kind: str) -> None:
        self.metrics.failures.labels(kind=kind).inc()


class _ReadAhead:
    """A generation whose first events were read before the decision, replayed first."""

    def __init__(self, inner: Generation, head: list[TokenEvent], rest: AsyncIterator[TokenEvent]) -> None:
        self._inner = inner
        self._head = head
        self._rest = rest
        self.started: Started = inner.started

    async def events(self) -> AsyncIterator[TokenEvent]:
        """See Generation.events."""
        for event in self._head:
            yield event
        async for event in self._rest:
            yield event

    def cancel(self) -> None:
        """See Generation.cancel."""
        self._inner.cancel()

    async def probabilities(self, tokens: int) -> list[float]:
        """The probabilities of the first `tokens` tokens (fewer when the answer ends before), read
        ahead as far as needed (they are replayed first). Tokens without a logprob (an end id) do not
        count."""

        def judged() -> list[float]:
            return [math.exp(e.logprobs.chosen.logprob) for e in self._head if e.logprobs is not None]

        while len(judged()) < tokens and not (self._head and self._head[-1].finish_reason is not None):
            try:
                self._head.append(await self._rest.__anext__())
            except StopAsyncIteration:
                break
        return judged()[:tokens]


def _with_logprobs(job: Job) -> Job:
    """`job` asking its engine for each token's logprob, which the confidence trigger reads. The
    answer shows them only when the client asked: openai/choices.py formats what the request asked."""

    def plan(prompt_tokens: int, info: EngineInfo) -> SamplingParams:
        params = job.plan(prompt_tokens, info)
        return params if params.logprobs is not None else dataclasses.replace(params, logprobs=0)

    return dataclasses.replace(job, plan=plan)


def _discard(task: asyncio.Future) -> None:
    """Cancel a task that lost (or whose request failed), and the generation it may have made."""
    if not task.done():
        task.cancel()
    elif not task.cancelled() and task.exception() is None:
        task.result().cancel()


def _failed(local: ApiError, upstream: BaseException | None) -> ApiError:
    """The error for a request neither the device nor the upstream could answer: 502 when the
    upstream answered badly, 503 when it could not be reached (or its breaker is open)."""
    kind = upstream.kind if isinstance(upstream, UpstreamFailure) else "connect"
    detail = upstream.message if isinstance(upstream, UpstreamFailure) else str(upstream)
    bad_answer = kind in ("status", "malformed")
    return ApiError(
        502 if bad_answer else 503,
        f"{local.message}; the upstream fallback failed too: {detail}",
        type_="server_error",
        code="upstream_error" if bad_answer else "upstream_unavailable",
        headers={"Retry-After": local.headers.get("Retry-After", "1")},
    )


# Request fields not forwarded as the client sent them: set by the upstream client (model, stream,
# stream_options) or here (one choice per job, so n and best_of; the token budget resolved against
# this agent's limits; the choice's own seed), or meaningless to another model (logit_bias names
# token ids of the device's vocabulary), or done here (echo: the agent puts the prompt in front).
_NOT_FORWARDED = frozenset(
    {"model", "stream", "stream_options", "n", "best_of", "max_tokens", "max_completion_tokens", "seed"}
    | {"logit_bias", "echo"}
)


def _upstream_body(job: Job, params: SamplingParams) -> dict[str, object]:
    """The OpenAI request body for the upstream: every field of the request this agent knows that
    the client set (messages with their tool calls, tools, tool_choice, response_format, logprobs,
    the sampling), so that the upstream answers the same request; fields this agent ignores are not
    forwarded either."""
    request = job.request
    sent = request.model_dump(exclude_unset=True, by_alias=True, include=set(type(request).model_fields))
    body = {name: value for name, value in sent.items() if name not in _NOT_FORWARDED}
    budget = "max_completion_tokens" if "max_completion_tokens" in sent else "max_tokens"
    body[budget] = params.max_tokens
    if params.seed is not None:
        body["seed"] = params.seed
    return body
