"""The edge-cloud fallback's decisions on a scripted device (tests/agent/scripted.py), in
milliseconds: each trigger (deadline, min_confidence, not_ready, overloaded), the always and off
policies, and the circuit breaker opening, backing off and closing on a fake clock.

FallbackSource runs for real over the real local source (SchedulerTokenSource, ModelManager,
Scheduler); its upstream client speaks HTTP, so the upstream is a small OpenAI-compatible stream
on loopback (ScriptedUpstream below). test_fallback.py runs the same paths end to end through the
openai client, with a second real agent as the upstream."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from deployer.agent.openai.schemas import ApiError, ChatCompletionRequest
from deployer.agent.runtime.hotswap import ModelManager
from deployer.agent.runtime.scheduler import SchedulerCounts
from deployer.agent.serving.fallback.breaker import CircuitBreaker
from deployer.agent.serving.fallback.source import FallbackSource
from deployer.agent.serving.generate import EdgeStatus, Job, LoadReport, SchedulerTokenSource, ServedBy
from deployer.agent.settings import AgentSettings, FallbackSettings
from deployer.agent.types import ChatMessage, EngineInfo, SamplingParams
from tests.agent.scripted import FakeClock, Gate, Reply, ScriptedEngine

UPSTREAM_MODEL = "big-model"
UPSTREAM_TEXT = "from upstream"
EDGE_TEXT = "on edge"  # within the jobs' 8 tokens, with its end


class ScriptedUpstream:
    """An OpenAI-compatible /v1/chat/completions on 127.0.0.1: streams UPSTREAM_TEXT (one chunk,
    then the finish and the usage), or answers `status` with an OpenAI error body while it is set.
    Counts the requests it was sent; answers only once `after` is set, when given."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.after: threading.Event | None = None
        self.requests = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                outer.requests += 1
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if outer.after is not None:
                    assert outer.after.wait(30), "what the upstream waits for never happened"
                if outer.status is not None:
                    self._send(outer.status, "application/json", {"error": {"message": "upstream broke"}})
                    return
                chunks = [
                    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": UPSTREAM_TEXT}}]},
                    {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                    {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
                ]
                body = "".join(f"data: {json.dumps({'model': UPSTREAM_MODEL, **c})}\n\n" for c in chunks)
                self._send(200, "text/event-stream", body + "data: [DONE]\n\n")

            def _send(self, status: int, content_type: str, body: object) -> None:
                data = (body if isinstance(body, str) else json.dumps(body)).encode()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.01,), daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """The base URL FallbackSettings takes."""
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()


class Edge:
    """A device: a ModelManager on one scripted engine, its local source, and the FallbackSource
    in front of them (the wiring of AgentServer)."""

    def __init__(
        self, engine: ScriptedEngine, fallback: FallbackSettings, *, load: bool, **settings: object
    ) -> None:
        self.engine = engine
        self.settings = AgentSettings(port=0, **settings)
        self.manager = ModelManager(lambda: engine, self.settings)
        if load:
            assert self.manager.swap_to(Path("/nonexistent/v1"), "v1").ok
        self.local = SchedulerTokenSource(self.manager, self.settings.max_concurrent)
        self.source = self.fallback_source(fallback, self.local)

    def fallback_source(self, fallback: FallbackSettings, load: LoadReport) -> FallbackSource:
        """A FallbackSource over this device's local source, told about its load by `load` (its
        metrics in a registry of its own: `registry`)."""
        self.registry = CollectorRegistry()
        return FallbackSource(
            fallback,
            self.local,
            load,
            active_info=self.manager.active_info,
            max_tokens=self.settings.max_tokens,
            registry=self.registry,
        )

    def metric(self, name: str, **labels: str) -> float | None:
        """A sample of the fallback's metrics."""
        return self.registry.get_sample_value(name, labels)

    def close(self) -> None:
        """Cancel what runs and unload the model."""
        self.manager.cancel_all()
        self.manager.shutdown()


MakeEdge = Callable[..., Edge]


@pytest.fixture
def upstream() -> Iterator[ScriptedUpstream]:
    server = ScriptedUpstream()
    yield server
    server.close()


@pytest.fixture
def edge(upstream: ScriptedUpstream) -> Iterator[MakeEdge]:
    """`edge(engine=None, load=True, fallback={...}, **agent_settings)`: a device whose fallback
    points at `upstream` (deadline_ms off unless given); closed at teardown."""
    made: list[Edge] = []

    def make(
        engine: ScriptedEngine | None = None,
        load: bool = True,
        fallback: dict | None = None,
        **settings: object,
    ) -> Edge:
        fields = {"base_url": upstream.url, "model": UPSTREAM_MODEL, "deadline_ms": None, **(fallback or {})}
        made.append(
            Edge(
                engine or ScriptedEngine(default=Reply(text=EDGE_TEXT)),
                FallbackSettings(**fields),
                load=load,
                **settings,
            )
        )
        return made[-1]

    yield make
    for device in made:
        device.close()


def _job(content: str = "question", *, fallback: bool = True) -> Job:
    """A chat job as the routes make one (8 tokens at most, greedy)."""
    request = ChatCompletionRequest.model_validate(
        {
            "model": "scripted",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 8,
            "temperature": 0,
        }
    )

    def plan(prompt_tokens: int, info: EngineInfo) -> SamplingParams:
        return request.sampling(8, None)

    return Job(
        messages=(ChatMessage("user", content),), text=None, plan=plan, request=request, fallback=fallback
    )


async def _answer(source: FallbackSource, job: Job) -> tuple[ServedBy, str]:
    """(who answered and why, the answer's text)."""
    generation = await source.start(job)
    text = "".join([event.text async for event in generation.events()])
    return generation.started.served_by, text


def _ask(source: FallbackSource, job: Job | None = None) -> tuple[ServedBy, str]:
    return asyncio.run(_answer(source, job or _job()))


def _by(served: ServedBy) -> tuple[str, str | None]:
    return served.by, served.reason


# -- policies -------------------------------------------------------------------------------------


def test_policy_always_asks_the_upstream_first(edge, upstream):
    device = edge(fallback={"policy": "always"})
    served, text = _ask(device.source)
    assert (served, text) == (
        ServedBy("upstream", "always", "the policy sends every request upstream", UPSTREAM_MODEL),
        UPSTREAM_TEXT,
    )
    assert upstream.requests == 1
    assert len(device.engine.params) == 1  # the load's smoke prompt only: the device never ran it
    assert device.metric("sits_fallbacks_total", reason="always") == 1
    assert device.metric("sits_upstream_first_token_seconds_count") == 1


def test_policy_always_leaves_the_answer_to_the_device_when_the_upstream_fails(edge, upstream):
    upstream.status = 500
    device = edge(fallback={"policy": "always"})
    assert _ask(device.source) == (ServedBy("edge"), EDGE_TEXT)
    assert device.metric("sits_fallback_failures_total", kind="status") == 1
    assert device.metric("sits_answers_total", served_by="edge") == 1


def test_policy_off_and_a_request_that_insists_stay_on_the_device(edge, upstream):
    off = edge(fallback={"policy": "off"})
    assert _ask(off.source) == (ServedBy("edge"), EDGE_TEXT)
    always = edge(fallback={"policy": "always"})
    assert _ask(always.source, _job(fallback=False)) == (ServedBy("edge"), EDGE_TEXT)  # x-sits-fallback: off
    assert upstream.requests == 0


# -- triggers -------------------------------------------------------------------------------------


def test_not_ready_goes_upstream(edge, upstream):
    device = edge(load=False)
    served, text = _ask(device.source)
    assert (_by(served), served.detail, text) == (
        ("upstream", "not_ready"),
        "no model is loaded on the device",
        UPSTREAM_TEXT,
    )
    assert device.metric("sits_fallbacks_total", reason="not_ready") == 1


def test_not_ready_with_a_failing_upstream_is_a_502(edge, upstream):
    upstream.status = 500
    device = edge(load=False)
    with pytest.raises(ApiError) as failed:
        _ask(device.source)
    assert (failed.value.status, failed.value.code) == (502, "upstream_error")
    assert "no model is loaded" in failed.value.message and "upstream broke" in failed.value.message


def test_not_ready_trigger_off_keeps_the_503(edge, upstream):
    device = edge(load=False, fallback={"not_ready": False})
    with pytest.raises(ApiError) as failed:
        _ask(device.source)
    assert (failed.value.status, failed.value.code) == (503, "model_unavailable")
    assert upstream.requests == 0


@pytest.mark.parametrize("trigger", [True, False])
def test_a_full_device_goes_upstream_unless_the_overloaded_trigger_is_off(edge, upstream, trigger):
    gate = Gate()
    engine = ScriptedEngine({"hold": Reply(text="held", hold=gate)})
    device = edge(engine, fallback={"overloaded": trigger}, max_concurrent=1, queue_length=0)

    async def main() -> tuple[ServedBy, str] | ApiError:
        holder = await device.source.start(_job("hold"))  # its first token came; its next step waits
        gate.wait_reached()
        try:
            return await _answer(device.source, _job())
        except ApiError as refused:
            return refused
        finally:
            gate.open()
            assert "".join([e.text async for e in holder.events()]) == "held"

    outcome = asyncio.run(main())
    if trigger:
        assert isinstance(outcome, tuple) and (_by(outcome[0]), outcome[1]) == (
            ("upstream", "overloaded"),
            UPSTREAM_TEXT,
        )
        assert "1 running and 0 waiting" in (outcome[0].detail or "")
    else:
        assert isinstance(outcome, ApiError) and (outcome.status, outcome.code) == (429, "overloaded")
        assert upstream.requests == 0


def test_a_device_out_of_memory_goes_upstream_as_overloaded(edge, upstream):
    engine = ScriptedEngine({"question": Reply(error=MemoryError("no room for its cache"), error_at=0)})
    served, text = _ask(edge(engine).source)
    assert (_by(served), text) == (("upstream", "overloaded"), UPSTREAM_TEXT)
    assert served.detail == "the engine ran out of memory; retry later"


class FixedEstimate:
    """A LoadReport whose first-token estimate is fixed (the status is the local source's)."""

    def __init__(self, local: LoadReport, seconds: float) -> None:
        self._local = local
        self._seconds = seconds

    def edge_status(self) -> EdgeStatus:
        return self._local.edge_status()

    def first_token_estimate(self, job: Job) -> float | None:
        return self._seconds


def test_an_estimate_past_the_deadline_goes_upstream_unless_the_upstream_is_slower(edge, upstream):
    device = edge()
    source = device.fallback_source(
        FallbackSettings(base_url=upstream.url, model=UPSTREAM_MODEL, deadline_ms=60_000),
        FixedEstimate(device.local, 100.0),
    )
    served, text = _ask(source)
    assert (_by(served), served.detail, text) == (
        ("upstream", "deadline"),
        "estimated first token in 100000 ms, deadline 60000 ms",
        UPSTREAM_TEXT,
    )
    assert len(device.engine.params) == 1  # the smoke prompt only: the device never started it
    source.latencies.add(200.0)  # the upstream's P95 is now past the device's estimate
    assert _ask(source) == (ServedBy("edge"), EDGE_TEXT)


def test_a_late_first_token_goes_upstream_and_the_device_request_is_cancelled(edge, upstream, wait_until):
    gate = Gate()
    engine = ScriptedEngine({"question": Reply(text="too late", hold=gate, hold_at=0)})
    device = edge(engine, fallback={"deadline_ms": 1})
    upstream.after = gate.reached  # the upstream answers once the device is provably late
    try:
        served, text = _ask(device.source)
    finally:
        gate.open()
    assert (_by(served), served.detail, text) == (
        ("upstream", "deadline"),
        "no first token within 1 ms",
        UPSTREAM_TEXT,
    )
    assert gate.reached.is_set()  # the device did start it
    wait_until(
        lambda: device.manager.counts() == SchedulerCounts(0, 0), "the device's cancelled request ends"
    )
    assert ("release", (0,)) in engine.calls


@pytest.mark.parametrize(("probability", "by"), [(0.2, "upstream"), (0.9, "edge")])
def test_min_confidence_judges_the_first_tokens(edge, upstream, probability, by):
    engine = ScriptedEngine(default=Reply(text="maybe", probability=probability))
    device = edge(engine, fallback={"min_confidence": 0.5, "confidence_tokens": 2})
    served, text = _ask(device.source)
    assert (served.by, text) == (by, UPSTREAM_TEXT if by == "upstream" else "maybe")
    if by == "upstream":
        assert served.detail == "mean probability 0.200 of the first 2 tokens, below min_confidence 0.5"
    assert engine.params[-1].logprobs == 0  # asked of the engine although the client did not
    assert device.metric("sits_edge_confidence_count") == 1


def test_an_unsure_device_answers_when_the_upstream_fails(edge, upstream):
    upstream.status = 503
    engine = ScriptedEngine(default=Reply(text="maybe", probability=0.2))
    device = edge(engine, fallback={"min_confidence": 0.5, "confidence_tokens": 2})
    assert _ask(device.source) == (ServedBy("edge"), "maybe")  # what it held back, all of it
    assert device.metric("sits_fallback_failures_total", kind="status") == 1


# -- the circuit breaker --------------------------------------------------------------------------


def test_the_breaker_opens_backs_off_and_closes(edge, upstream):
    clock = FakeClock()
    device = edge(
        fallback={
            "policy": "always",
            "breaker_failures": 2,
            "breaker_backoff_s": 10,
            "breaker_max_backoff_s": 40,
        }
    )
    settings = device.source.settings
    # The source's own breaker, on a fake clock.
    device.source.breaker = CircuitBreaker(
        settings.breaker_failures, settings.breaker_backoff_s, settings.breaker_max_backoff_s, clock=clock
    )
    upstream.status = 500

    def ask() -> str:
        served, _ = _ask(device.source)
        return served.by

    assert [ask(), ask()] == ["edge", "edge"]  # two failures: open
    assert (upstream.requests, device.source.breaker.state) == (2, "open")
    assert ask() == "edge" and upstream.requests == 2  # refused by the breaker, never sent
    assert device.metric("sits_fallback_failures_total", kind="open") == 1
    clock.advance(10)  # the backoff is over: one trial, which fails: 20 s now
    assert ask() == "edge" and upstream.requests == 3
    clock.advance(10)
    assert ask() == "edge" and upstream.requests == 3
    assert device.metric("sits_fallback_breaker_state", state="open") == 1
    clock.advance(10)
    upstream.status = None  # the upstream is back: the trial succeeds and closes the breaker
    assert ask() == "upstream" and upstream.requests == 4
    assert device.source.breaker.state == "closed"
    assert device.metric("sits_fallback_breaker_state", state="closed") == 1
