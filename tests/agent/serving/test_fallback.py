"""Edge-cloud fallback end to end through the official openai client: an edge agent (tiny model,
seed 0) and, as its upstream, a second agent on loopback serving other weights (seed 1), so that
every token says which model made it. A misbehaving upstream (hostile_upstream.py) stands in only
where a test needs the upstream to fail in a particular way; each such test says so."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from deployer.agent.engines import make_engine
from deployer.agent.http.server import AgentServer
from deployer.agent.settings import FallbackSettings, load_settings
from deployer.errors import AgentError, ConfigError
from tests.agent.conftest import EngineWrapper, metric_is

QUESTION = [{"role": "user", "content": "Hello there"}]
KEY = "sk-upstream-" + "k" * 32
SAMPLED = {"temperature": 1.0, "seed": 7, "max_tokens": 12}  # greedy, both tiny models say only newlines


def _client(agent: AgentServer, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{agent.port}/v1", api_key="x", max_retries=0, timeout=timeout
    )


def _chat(agent: AgentServer, model: str, **extra):
    """(headers, parsed completion) of one greedy chat request."""
    raw = _client(agent).chat.completions.with_raw_response.create(
        **{"model": model, "messages": QUESTION, "max_tokens": 6, "temperature": 0, **extra}
    )
    return raw.headers, raw.parse()


def _stream(agent: AgentServer, model: str, **extra):
    """(headers, chunks) of one greedy streamed chat request."""
    raw = _client(agent).chat.completions.with_raw_response.create(
        **{
            "model": model,
            "messages": QUESTION,
            "max_tokens": 6,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **extra,
        }
    )
    return raw.headers, list(raw.parse())


@pytest.fixture
def upstream(start_agent, tiny_model_dir_b: Path) -> AgentServer:
    """The second local device: a plain agent serving the seed-1 weights."""
    agent = start_agent(load=False)
    assert agent.reload(tiny_model_dir_b, "v1").ok
    return agent


@pytest.fixture
def up_model(tiny_model_dir_b: Path) -> str:
    return tiny_model_dir_b.name


@pytest.fixture
def fallback(upstream: AgentServer, up_model: str) -> Callable[..., FallbackSettings]:
    """`fallback(**fields)`: settings pointing at the upstream agent."""

    def make(**fields: object) -> FallbackSettings:
        base = {"base_url": f"http://127.0.0.1:{upstream.port}/v1", "model": up_model}
        return FallbackSettings(**{**base, **fields})

    return make


class _Holder(threading.Thread):
    """A greedy 100-token request on its own thread: it takes a slot of a gated engine and holds it
    (its greedy first token is no end token, so it reaches a decode step). Whatever ends it is kept,
    so a request refused or failed says so instead of leaving the test waiting."""

    def __init__(self, agent: AgentServer, model: str) -> None:
        super().__init__()
        self._agent, self._model = agent, model
        self.error: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            _client(self._agent).chat.completions.create(
                model=self._model, messages=QUESTION, max_tokens=100, temperature=0
            )
        except Exception as exc:  # kept for wait_generating's message
            self.error = exc

    def wait_generating(self, generating: threading.Event) -> None:
        """Until the engine holds this request mid-generation; fails with what ended it instead."""
        deadline = time.monotonic() + 60
        while not generating.wait(0.05):
            assert self.is_alive(), f"the holding request ended before a decode step: {self.error!r}"
            assert time.monotonic() < deadline, "the holding request never reached a decode step"


def _upstream_answer(upstream: AgentServer, up_model: str, **extra: object) -> str:
    return _chat(upstream, up_model, **extra)[1].choices[0].message.content


class HeldEngine(EngineWrapper):
    """A real engine whose generations wait for `release` before their first token: a device that
    is provably late, whatever the machine's speed."""

    def __init__(self, release: threading.Event, waiting: threading.Event) -> None:
        self._engine = make_engine("torch", context_length=256, threads=1)
        self._release = release
        self._waiting = waiting

    def prefill(self, slot, prompt, params):
        self._waiting.set()
        assert self._release.wait(60), "the test never released the engine"
        return self._engine.prefill(slot, prompt, params)


class PacedEngine(EngineWrapper):
    """A real engine that takes at least `pause_s` per token after the first, and holds long
    generations (max_tokens >= 100) after their first token until `gate` is set."""

    def __init__(self, pause_s: float, gate: threading.Event, generating: threading.Event) -> None:
        self._engine = make_engine("torch", context_length=256, threads=1)
        self._pause_s = pause_s
        self._gate = gate
        self._generating = generating
        self._long: set[int] = set()  # slots running a long generation

    def prefill(self, slot, prompt, params):
        (self._long.add if params.max_tokens >= 100 else self._long.discard)(slot)
        return self._engine.prefill(slot, prompt, params)

    def step(self, slots):
        if self._long.intersection(slots):  # a long generation has its first token: hold it
            self._generating.set()
            assert self._gate.wait(60), "the test never opened the gate"
        time.sleep(self._pause_s)  # the slowness under test, not a synchronisation
        return self._engine.step(slots)


# -- policies and triggers ------------------------------------------------------------------------


def test_policy_always_answers_from_the_upstream_and_says_so(
    start_agent, fallback, upstream, up_model, model_name
):
    edge = start_agent(fallback=fallback(policy="always"))
    headers, reply = _chat(edge, model_name)
    assert headers["x-sits-served-by"] == "upstream"
    assert headers["x-sits-fallback-reason"] == "always"
    assert reply.model == f"{up_model}@v1"  # the upstream's own name for itself
    assert reply.model_extra["sits"]["served_by"] == "upstream"
    assert reply.choices[0].message.content == _upstream_answer(upstream, up_model)
    assert reply.usage.completion_tokens >= 1 and reply.usage.prompt_tokens >= 1  # the upstream's count
    assert edge.metrics.value("sits_fallbacks_total", reason="always") == 1
    assert edge.metrics.value("sits_answers_total", served_by="upstream") == 1
    assert edge.metrics.value("sits_fallbacks_last_5m") == 1
    assert edge.metrics.value("sits_upstream_first_token_seconds_count") == 1


def test_policy_off_and_a_quick_device_answer_locally(start_agent, fallback, model_name, wait_until):
    for policy in ("off", "on-trigger"):
        edge = start_agent(fallback=fallback(policy=policy, deadline_ms=60_000))
        headers, reply = _chat(edge, model_name)
        assert headers["x-sits-served-by"] == "edge"
        assert "x-sits-fallback-reason" not in headers
        assert reply.model == f"{model_name}@v1"
        assert reply.model_extra["sits"] == {"served_by": "edge", "fallback_reason": None, "detail": None}
        assert edge.metrics.value("sits_answers_total", served_by="edge") == 1
        # The worker returns its slot just after the answer left: busy until then.
        wait_until(metric_is(edge, "sits_edge_status", 1, status="ready"), "the device is ready again")


def test_a_request_can_insist_on_the_device(start_agent, fallback, model_name):
    edge = start_agent(fallback=fallback(policy="always"))
    headers, reply = _chat(edge, model_name, extra_headers={"x-sits-fallback": "off"})
    assert headers["x-sits-served-by"] == "edge" and reply.model == f"{model_name}@v1"


def test_not_ready_goes_upstream_streamed_and_not(start_agent, fallback, upstream, up_model):
    edge = start_agent(load=False, fallback=fallback())
    assert edge.metrics.value("sits_edge_status", status="offline") == 1
    headers, reply = _chat(edge, "anything")  # no model here to check the name against
    assert (headers["x-sits-served-by"], headers["x-sits-fallback-reason"]) == ("upstream", "not_ready")
    expected = _upstream_answer(upstream, up_model)
    assert reply.choices[0].message.content == expected
    headers, chunks = _stream(edge, "anything")
    assert headers["x-sits-served-by"] == "upstream"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert edge.metrics.value("sits_fallbacks_total", reason="not_ready") == 2


def test_not_ready_without_a_usable_upstream_is_a_503(start_agent, hostile):
    # A hanging upstream (the misbehaving server): the device has no model and the upstream no answer.
    hung = hostile("hang")
    edge = start_agent(
        load=False, fallback=FallbackSettings(base_url=hung.url, model="m", first_token_timeout_s=0.3)
    )
    with pytest.raises(openai.InternalServerError) as info:
        _chat(edge, "m")
    assert info.value.status_code == 503
    assert info.value.code == "upstream_unavailable"
    assert "no model is loaded" in info.value.message and "no token within 0.3 s" in info.value.message
    assert edge.metrics.value("sits_fallback_failures_total", kind="timeout") == 1


def test_overloaded_goes_upstream(start_agent, fallback, gated, model_name):
    factory, gate, generating = gated
    edge = start_agent(
        factory=factory, max_concurrent=1, queue_length=0, max_tokens=150, fallback=fallback(deadline_ms=None)
    )
    holder = _Holder(edge, model_name)
    holder.wait_generating(generating)
    headers, _ = _chat(edge, model_name)
    assert (headers["x-sits-served-by"], headers["x-sits-fallback-reason"]) == ("upstream", "overloaded")
    gate.set()
    holder.join(60)
    assert holder.error is None, holder.error
    assert edge.metrics.value("sits_fallbacks_total", reason="overloaded") == 1


def test_overloaded_trigger_off_keeps_the_429(start_agent, fallback, gated, model_name):
    factory, gate, generating = gated
    settings = fallback(deadline_ms=None, overloaded=False)
    edge = start_agent(factory=factory, max_concurrent=1, queue_length=0, max_tokens=150, fallback=settings)
    holder = _Holder(edge, model_name)
    holder.wait_generating(generating)
    with pytest.raises(openai.RateLimitError):
        _chat(edge, model_name)
    gate.set()
    holder.join(60)
    assert holder.error is None, holder.error


def test_a_late_first_token_goes_upstream_and_a_stream_never_mixes(
    start_agent, fallback, upstream, up_model, model_name, wait_until
):
    release, waiting = threading.Event(), threading.Event()
    release.set()  # the load's smoke test runs on the same engine
    edge = start_agent(factory=lambda: HeldEngine(release, waiting), fallback=fallback(deadline_ms=50))
    edge_alone = _chat(start_agent(), model_name, **SAMPLED)[1].choices[0].message.content
    release.clear()
    waiting.clear()
    headers, chunks = _stream(edge, model_name, **SAMPLED)
    assert waiting.is_set()  # the device did start, and was held before its first token
    assert (headers["x-sits-served-by"], headers["x-sits-fallback-reason"]) == ("upstream", "deadline")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    upstream_alone = _upstream_answer(upstream, up_model, **SAMPLED)
    assert upstream_alone != edge_alone  # the two models are told apart by their words
    assert text == upstream_alone  # every token from the upstream, none from the device
    assert {c.model for c in chunks} == {f"{up_model}@v1"}
    assert {c.model_extra["sits"]["served_by"] for c in chunks} == {"upstream"}
    assert "no first token within 50 ms" in chunks[0].model_extra["sits"]["detail"]
    release.set()  # the device's generation was cancelled: it frees its slot without answering
    wait_until(lambda: edge.manager.counts().running == 0, "the device's cancelled request ends")


def test_the_estimate_sends_a_request_upstream_before_it_starts(start_agent, fallback, model_name):
    gate, generating = threading.Event(), threading.Event()
    edge = start_agent(
        factory=lambda: PacedEngine(0.2, gate, generating),
        max_tokens=150,
        max_concurrent=1,  # the holder below takes the only slot: a newcomer must wait for it
        fallback=fallback(),
    )
    # One timed request (4 tokens, so at least 0.6 s on the engine), then one that holds the engine.
    headers, _ = _chat(edge, model_name, max_tokens=4)
    assert headers["x-sits-served-by"] == "edge"
    holder = _Holder(edge, model_name)
    holder.wait_generating(generating)
    headers, reply = _chat(edge, model_name)
    assert (headers["x-sits-served-by"], headers["x-sits-fallback-reason"]) == ("upstream", "deadline")
    assert reply.model_extra["sits"]["detail"].startswith("estimated first token in ")
    gate.set()
    holder.join(60)
    assert holder.error is None, holder.error


# -- the request the upstream is sent ---------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
        },
    },
}
ROOMY = {"context_length": 512, "max_prompt_tokens": 384, "max_tokens": 128}  # tools make long prompts


@pytest.fixture
def roomy_pair(start_agent, tiny_model_dir_b: Path) -> tuple[AgentServer, AgentServer]:
    """(edge with no model loaded, so that every request goes upstream; its upstream agent)."""
    upstream = start_agent(load=False, **ROOMY)
    assert upstream.reload(tiny_model_dir_b, "v1").ok
    settings = FallbackSettings(base_url=f"http://127.0.0.1:{upstream.port}/v1", model=tiny_model_dir_b.name)
    return start_agent(load=False, fallback=settings, **ROOMY), upstream


def test_a_tool_calling_request_is_answered_upstream_with_a_tool_call(roomy_pair, up_model):
    edge, upstream = roomy_pair
    ask = {
        "messages": QUESTION,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    direct = _client(upstream).chat.completions.create(model=up_model, temperature=0, max_tokens=96, **ask)
    expected = json.loads(direct.choices[0].message.tool_calls[0].function.arguments)
    raw = _client(edge).chat.completions.with_raw_response.create(
        model="m", temperature=0, max_tokens=96, **ask
    )
    assert raw.headers["x-sits-served-by"] == "upstream"
    answer = raw.parse().choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.content is None
    (call,) = answer.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == expected
    chunks = list(
        _client(edge).chat.completions.create(model="m", temperature=0, max_tokens=96, stream=True, **ask)
    )
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "tool_calls"
    ]


def test_the_upstream_is_sent_the_whole_request(roomy_pair, up_model):
    edge, upstream = roomy_pair
    conversation = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21}'},
    ]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    asks = [
        # Each answer is the upstream's own to the same request: the earlier call and its result
        # reach its prompt (the same prompt, token for token), the schema constrains its answer, it
        # reports the logprobs asked for.
        {"messages": conversation, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 4},
        {
            "messages": QUESTION,
            "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
        },
        {"messages": QUESTION, "logprobs": True, "top_logprobs": 2, "max_tokens": 4},
    ]
    for ask in asks:
        ask = {"temperature": 0, "max_tokens": 32, **ask}
        direct = _client(upstream).chat.completions.create(model=up_model, **ask)
        relayed = _client(edge).chat.completions.create(model="m", **ask)
        assert relayed.usage.prompt_tokens == direct.usage.prompt_tokens
        assert relayed.choices[0].message.content == direct.choices[0].message.content
        if ask.get("logprobs"):
            pairs = _logprob_pairs(relayed.choices[0].logprobs.content)
            assert pairs == _logprob_pairs(direct.choices[0].logprobs.content) and len(pairs) == 4
    text = _client(edge).completions.create(
        model="m", prompt="Hello", max_tokens=3, temperature=0, logprobs=1
    )
    alone = _client(upstream).completions.create(
        model=up_model, prompt="Hello", max_tokens=3, temperature=0, logprobs=1
    )
    relayed_lp, direct_lp = text.choices[0].logprobs, alone.choices[0].logprobs
    assert relayed_lp.tokens == direct_lp.tokens and len(relayed_lp.tokens) == 3
    assert relayed_lp.token_logprobs == pytest.approx(direct_lp.token_logprobs, abs=1e-5)


def _logprob_pairs(entries: list) -> list[tuple[str, object, list[str]]]:
    """(token, logprob, alternatives) of each entry; logprobs to 1e-5 (a prefix reused from the
    cache computes the same prompt in another order)."""
    return [(e.token, pytest.approx(e.logprob, abs=1e-5), [t.token for t in e.top_logprobs]) for e in entries]


# -- upstream failures ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["500-echo", "garbage", "hang"])
def test_a_failing_upstream_leaves_the_answer_to_the_device(start_agent, hostile, model_name, mode):
    # The misbehaving server: an error status, a body that is no OpenAI stream, no answer at all.
    bad = hostile(mode)
    settings = FallbackSettings(base_url=bad.url, model="m", policy="always", first_token_timeout_s=0.5)
    edge = start_agent(fallback=settings)
    headers, reply = _chat(edge, model_name)
    assert headers["x-sits-served-by"] == "edge"
    assert reply.model == f"{model_name}@v1" and reply.choices[0].message.content
    kind = {"500-echo": "status", "garbage": "malformed", "hang": "timeout"}[mode]
    assert edge.metrics.value("sits_fallback_failures_total", kind=kind) == 1


def test_an_upstream_failing_mid_stream_ends_the_stream_with_an_error(start_agent, hostile):
    # The misbehaving server sends one good chunk and drops the connection: the answer is already the
    # upstream's, so it ends with an error event instead of going on with the device's tokens.
    bad = hostile("truncate")
    edge = start_agent(load=False, fallback=FallbackSettings(base_url=bad.url, model="m"))
    with pytest.raises(openai.APIError) as info:
        _stream(edge, "m")
    assert "the upstream failed mid-answer" in str(info.value)


def test_the_breaker_stops_calling_a_failing_upstream(start_agent, hostile, model_name):
    # The misbehaving server answers 500 to everything.
    bad = hostile("500-echo")
    settings = FallbackSettings(
        base_url=bad.url, model="m", policy="always", breaker_failures=2, breaker_backoff_s=600
    )
    edge = start_agent(fallback=settings)
    for _ in range(5):
        assert _chat(edge, model_name)[0]["x-sits-served-by"] == "edge"
    assert bad.requests == 2  # then the breaker opened: three requests never left the device
    assert edge.metrics.value("sits_fallback_failures_total", kind="status") == 2
    assert edge.metrics.value("sits_fallback_failures_total", kind="open") == 3
    assert edge.metrics.value("sits_fallback_breaker_state", state="open") == 1


def test_the_key_reaches_the_upstream_and_nothing_else(start_agent, hostile, short_dir, caplog):
    # The misbehaving server echoes the Authorization header it was sent in its 500 error.
    bad = hostile("500-echo")
    key_file = short_dir / "fallback-key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    settings = FallbackSettings(base_url=bad.url, model="m", api_key_file=key_file)
    edge = start_agent(load=False, fallback=settings)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(openai.APIStatusError) as info:
        _chat(edge, "m")
    assert bad.authorization == [f"Bearer {KEY}"]
    assert info.value.status_code == 502 and info.value.code == "upstream_error"
    assert "[redacted]" in info.value.message
    assert KEY not in info.value.message and KEY not in info.value.response.text
    assert KEY not in caplog.text
    assert KEY not in edge.metrics.render().decode()
    assert KEY not in repr(edge.settings)


def test_an_unreadable_key_file_is_named_not_read(start_agent, short_dir):
    missing = short_dir / "nope"
    with pytest.raises(AgentError, match=r"cannot read the fallback API key file .*nope"):
        start_agent(
            fallback=FallbackSettings(base_url="http://127.0.0.1:9/v1", model="m", api_key_file=missing)
        )


# -- the confidence trigger ------------------------------------------------------------------------

JUDGED = 3  # confidence_tokens in these tests


def _edge_confidence(agent: AgentServer, model: str) -> tuple[str, float]:
    """(answer, mean probability of its first JUDGED tokens) of the SAMPLED request on a plain agent
    serving the edge's model, from the logprobs it reports: the thresholds below are set around it,
    so each test's outcome is decided by the model, not by a guess about it."""
    reply = _chat(agent, model, logprobs=True, **SAMPLED)[1].choices[0]
    first = reply.logprobs.content[:JUDGED]
    assert len(first) == JUDGED
    return reply.message.content, sum(math.exp(t.logprob) for t in first) / JUDGED


def test_a_sure_device_keeps_the_answer_and_shows_no_logprobs_unasked(start_agent, fallback, model_name):
    alone, confidence = _edge_confidence(start_agent(), model_name)
    edge = start_agent(fallback=fallback(min_confidence=confidence / 2, confidence_tokens=JUDGED))
    headers, reply = _chat(edge, model_name, **SAMPLED)
    assert headers["x-sits-served-by"] == "edge" and "x-sits-fallback-reason" not in headers
    assert reply.choices[0].message.content == alone  # asking the engine for logprobs changed no token
    assert reply.choices[0].logprobs is None  # the agent asked for them, the client did not
    headers, chunks = _stream(edge, model_name, **SAMPLED)
    assert headers["x-sits-served-by"] == "edge"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == alone
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)
    # A client that asks gets them as it asked (two alternatives), the judged tokens' among them.
    reply = _chat(edge, model_name, logprobs=True, top_logprobs=2, **SAMPLED)[1].choices[0]
    assert all(len(t.top_logprobs) == 2 for t in reply.logprobs.content)
    assert edge.metrics.value("sits_answers_total", served_by="edge") == 3
    assert edge.metrics.value("sits_edge_confidence_count") == 3
    assert edge.metrics.value("sits_fallbacks_total", reason="confidence") == 0


def test_an_unsure_device_is_answered_for_by_the_upstream_and_a_stream_never_mixes(
    start_agent, fallback, upstream, up_model, model_name
):
    alone, confidence = _edge_confidence(start_agent(), model_name)
    threshold = (1 + confidence) / 2  # above the device's confidence, below 1
    edge = start_agent(fallback=fallback(min_confidence=threshold, confidence_tokens=JUDGED))
    upstream_alone = _upstream_answer(upstream, up_model, **SAMPLED)
    assert upstream_alone != alone  # the two models are told apart by their words
    headers, reply = _chat(edge, model_name, **SAMPLED)
    assert (headers["x-sits-served-by"], headers["x-sits-fallback-reason"]) == ("upstream", "confidence")
    assert reply.choices[0].message.content == upstream_alone
    detail = reply.model_extra["sits"]["detail"]
    assert f"mean probability {confidence:.3f} of the first {JUDGED} tokens" in detail
    assert f"below min_confidence {threshold:g}" in detail
    headers, chunks = _stream(edge, model_name, **SAMPLED)
    assert (headers["x-sits-served-by"], headers["x-sits-fallback-reason"]) == ("upstream", "confidence")
    # The device's held-back tokens were discarded: every token is the upstream's, none the device's.
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == upstream_alone
    assert {c.model for c in chunks} == {f"{up_model}@v1"}
    assert {c.model_extra["sits"]["fallback_reason"] for c in chunks} == {"confidence"}
    assert edge.metrics.value("sits_fallbacks_total", reason="confidence") == 2
    assert edge.metrics.value("sits_answers_total", served_by="upstream") == 2


def test_an_unsure_device_answers_when_the_upstream_is_down(start_agent, model_name):
    alone, confidence = _edge_confidence(start_agent(), model_name)
    settings = FallbackSettings(  # nothing listens on port 9: connection refused
        base_url="http://127.0.0.1:9/v1",
        model="m",
        min_confidence=(1 + confidence) / 2,
        confidence_tokens=JUDGED,
    )
    edge = start_agent(fallback=settings)
    headers, reply = _chat(edge, model_name, **SAMPLED)
    assert headers["x-sits-served-by"] == "edge"
    assert reply.choices[0].message.content == alone  # the answer the device had held back
    headers, chunks = _stream(edge, model_name, **SAMPLED)
    assert headers["x-sits-served-by"] == "edge"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == alone
    assert edge.metrics.value("sits_fallback_failures_total", kind="connect") == 2
    assert edge.metrics.value("sits_fallbacks_total", reason="confidence") == 0


def test_the_choices_of_one_answer_come_from_one_model(start_agent, fallback, upstream, up_model, model_name):
    # n=2: the choices sample with seeds 7 and 8, and the threshold lies between their confidences,
    # so judged one by one, one choice would stay on the device and the other go upstream.
    plain = _chat(start_agent(), model_name, n=2, logprobs=True, **SAMPLED)[1]
    confidences = [
        sum(math.exp(t.logprob) for t in c.logprobs.content[:JUDGED]) / JUDGED for c in plain.choices
    ]
    assert confidences[0] != confidences[1]
    edge = start_agent(fallback=fallback(min_confidence=sum(confidences) / 2, confidence_tokens=JUDGED))
    headers, reply = _chat(edge, model_name, n=2, **SAMPLED)
    first_on_edge = confidences[0] > confidences[1]
    assert headers["x-sits-served-by"] == ("edge" if first_on_edge else "upstream")
    direct = _chat(upstream, up_model, n=2, **SAMPLED)[1] if not first_on_edge else plain
    # Every choice is the first's answerer's, each with its own seed.
    assert [c.message.content for c in reply.choices] == [c.message.content for c in direct.choices]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("min_confidence: 1", "less than 1"),
        ("min_confidence: 0", "greater than 0"),
        ("confidence_tokens: 0", "greater than or equal to 1"),
    ],
)
def test_the_confidence_settings_are_range_checked_where_they_are_written(tmp_path, line, message):
    path = tmp_path / "agent.yaml"
    path.write_text(f"fallback:\n  base_url: http://10.0.0.5:8080/v1\n  model: m\n  {line}\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert f"{path}:4: fallback.{line.split(':')[0]}:" in info.value.message
    assert message in info.value.message
    path.write_text("fallback:\n  base_url: http://10.0.0.5:8080/v1\n  model: m\n  min_confidence: 0.6\n")
    assert load_settings(path).fallback.min_confidence == 0.6
