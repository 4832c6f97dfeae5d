"""The fallback against an upstream that misbehaves on purpose (hostile_upstream.py), through the
official openai client: what it sends is bounded, its key never comes back, the request's own
limits hold on its answer, and a stream it keeps busy without tokens ends (docs/security-model.md,
"The fallback upstream")."""

from __future__ import annotations

import logging

import openai
import pytest

from deployer.agent.http.server import AgentServer
from deployer.agent.settings import FallbackSettings
from deployer.core.redact import MIN_FRAGMENT

KEY = "sk-9f3b2c71d0e84a65b7c1e2f3a4d5c6b7e8f9a0b1"  # no word of a message in it
QUESTION = [{"role": "user", "content": "Hello there"}]


def _client(agent: AgentServer, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{agent.port}/v1", api_key="x", max_retries=0, timeout=timeout
    )


def _pieces(text: str) -> list[str]:
    """The pieces of KEY (MIN_FRAGMENT characters or more) found in `text`."""
    return [
        KEY[i : i + MIN_FRAGMENT]
        for i in range(len(KEY) - MIN_FRAGMENT + 1)
        if KEY[i : i + MIN_FRAGMENT] in text
    ]


@pytest.mark.parametrize("mode", ["500-echo", "error-echo"])
def test_no_piece_of_the_key_comes_back_where_the_quote_is_cut(start_agent, hostile, short_dir, caplog, mode):
    # The error text is quoted up to 300 characters: the key starts 290 characters in, so a cut
    # before the scrub would leave its first 10 characters, and a scrub of the whole key alone
    # would miss them.
    bad = hostile(mode, pad=300 - len("bad auth Bearer ") - 10)
    key_file = short_dir / "fallback-key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    edge = start_agent(
        load=False, fallback=FallbackSettings(base_url=bad.url, model="m", api_key_file=key_file)
    )
    caplog.set_level(logging.DEBUG)
    client = _client(edge)
    with pytest.raises(openai.APIError) as info:
        if mode == "500-echo":  # before the first token: the answer is a 502
            client.chat.completions.create(model="m", messages=QUESTION, max_tokens=4)
        else:  # mid-stream: an error event ends the stream
            list(client.chat.completions.create(model="m", messages=QUESTION, max_tokens=4, stream=True))
    assert bad.authorization == [f"Bearer {KEY}"]  # it was sent, and echoed
    assert "[redacted]" in info.value.message
    shown = info.value.message + str(info.value.body) + caplog.text
    assert _pieces(shown) == []


def test_an_endless_line_fails_the_upstream_and_the_device_answers(start_agent, hostile, model_name):
    # 8 MiB of one SSE line, then silence: read whole, it stays in memory until the first-token
    # timeout; bounded, the upstream fails as malformed at once and the device answers.
    bad = hostile("endless-line")
    settings = FallbackSettings(base_url=bad.url, model="m", policy="always", first_token_timeout_s=20)
    edge = start_agent(fallback=settings)
    raw = _client(edge).chat.completions.with_raw_response.create(
        model=model_name, messages=QUESTION, max_tokens=4, temperature=0
    )
    assert raw.headers["x-sits-served-by"] == "edge"
    assert raw.parse().choices[0].message.content
    assert edge.metrics.value("sits_fallback_failures_total", kind="malformed") == 1
    assert edge.metrics.value("sits_fallback_failures_total", kind="timeout") == 0


@pytest.mark.parametrize("mode", ["keep-alive", "empty-chunks", "drip"])
def test_bytes_without_tokens_do_not_hold_a_stream_open(start_agent, hostile, mode):
    # After one token the upstream keeps the connection busy (comments, tokenless chunks, a line
    # growing a byte at a time) but sends no token: read_timeout_s ends the stream. The client's
    # own timeout (15 s) is what would end it otherwise.
    bad = hostile(mode)
    settings = FallbackSettings(base_url=bad.url, model="m", read_timeout_s=1)
    edge = start_agent(load=False, fallback=settings)
    deltas = []
    with pytest.raises(openai.APIError) as info:
        for chunk in _client(edge, timeout=15).chat.completions.create(
            model="m", messages=QUESTION, max_tokens=4, stream=True
        ):
            deltas += [c.delta.content for c in chunk.choices if c.delta.content]
    assert deltas == ["UP"]
    assert "the upstream failed mid-answer: the upstream sent no token for 1 s" in info.value.message


def test_an_upstream_ignoring_max_tokens_is_cut_at_the_requests_budget(start_agent, hostile):
    bad = hostile("ignore-limits")  # 3000 tokens whatever it is asked
    edge = start_agent(load=False, fallback=FallbackSettings(base_url=bad.url, model="m"))
    client = _client(edge)
    reply = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=8)
    assert bad.bodies[0]["max_tokens"] == 8  # it was told
    assert reply.choices[0].message.content == "tok " * 8
    assert (reply.choices[0].finish_reason, reply.usage.completion_tokens) == ("length", 8)
    chunks = list(
        client.chat.completions.create(
            model="m", messages=QUESTION, max_tokens=8, stream=True, stream_options={"include_usage": True}
        )
    )
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert deltas == ["tok "] * 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8


def test_the_requests_stop_strings_hold_on_an_upstream_answer(start_agent, hostile):
    # The upstream ignores `stop`: the device cuts before it, and never shows a part of it.
    bad = hostile("ignore-limits", tokens=("Hello", " wor", "ld", " ST", "OP", " and", " more"))
    edge = start_agent(load=False, fallback=FallbackSettings(base_url=bad.url, model="m"))
    client = _client(edge)
    reply = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=20, stop=["STOP"])
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == ("Hello world ", "stop")
    chunks = list(
        client.chat.completions.create(
            model="m", messages=QUESTION, max_tokens=20, stop=["STOP"], stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello world "
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
