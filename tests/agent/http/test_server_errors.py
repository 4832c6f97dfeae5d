"""Bad input over HTTP: each answered with an OpenAI-style error; the server keeps serving."""

from __future__ import annotations

import json
import logging
import socket

import pytest

from tests.agent.conftest import metric_is

ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture
def agent(start_agent):
    return start_agent(max_request_bytes=4096, max_prompt_tokens=100)


def _error(response):
    status, _, body = response
    assert set(body["error"]) == ERROR_KEYS
    return status, body["error"]


def test_malformed_json(agent, http):
    status, error = _error(http(agent.port, "POST", "/v1/chat/completions", raw=b'{"model": "x", '))
    assert (status, error["code"]) == (400, "invalid_json")


def test_unknown_fields_are_ignored_logged_once_and_counted(agent, http, chat_body, caplog, monkeypatch):
    # Earlier tests in this process may have hidden the agent's warnings from caplog: an in-process
    # `sits-deployer` run raises the root level above CRITICAL (cli/main.py), an in-process
    # `sits-agent` run (journal logging) stops the agent's logger propagating.
    logger = logging.getLogger("sits.agent")
    monkeypatch.setattr(logger, "propagate", True)
    caplog.set_level(logging.WARNING, logger="sits.agent")
    for _ in range(2):
        status, _, _ = http(agent.port, "POST", "/v1/chat/completions", chat_body(store=True, sits_unknown=1))
        assert status == 200
    assert agent.metrics.value("sits_ignored_request_fields_total", field="sits_unknown") == 2
    assert agent.metrics.value("sits_ignored_request_fields_total", field="store") == 2
    logged = [r.getMessage() for r in caplog.records if "sits_unknown" in r.getMessage()]
    assert len(logged) == 1, (logger.level, logger.handlers, logging.getLogger().handlers)


def test_fields_that_cannot_be_honoured_are_named(agent, http, chat_body):
    status, error = _error(http(agent.port, "POST", "/v1/chat/completions", chat_body(audio={"voice": "x"})))
    assert (status, error["code"], error["param"]) == (400, "unsupported_parameter", "audio")


def test_oversized_body(agent, http, chat_body):
    body = chat_body(messages=[{"role": "user", "content": "x" * 5000}])
    status, error = _error(http(agent.port, "POST", "/v1/chat/completions", body))
    assert (status, error["code"]) == (413, "request_too_large")


def test_oversized_prompt(agent, http, chat_body):
    body = chat_body(messages=[{"role": "user", "content": "Paris is nice. " * 40}])
    status, error = _error(http(agent.port, "POST", "/v1/chat/completions", body))
    assert (status, error["code"], error["param"]) == (400, "context_length_exceeded", "messages")


def test_max_tokens_beyond_limits(agent, http, chat_body):
    status, error = _error(http(agent.port, "POST", "/v1/chat/completions", chat_body(max_tokens=10**6)))
    assert (status, error["param"]) == (400, "max_tokens")
    completion = {"model": chat_body()["model"], "prompt": "x", "max_tokens": 10**6}
    status, error = _error(http(agent.port, "POST", "/v1/completions", completion))
    assert (status, error["param"]) == (400, "max_tokens")


def test_unknown_route_and_wrong_method(agent, http):
    assert _error(http(agent.port, "GET", "/v2/nothing"))[0] == 404
    for method in ("GET", "PUT", "DELETE"):
        status, error = _error(http(agent.port, method, "/v1/chat/completions"))
        assert (status, error["code"]) == (405, "method_not_allowed")


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "invalid_json"),  # deeper than any parser recursion
        (b'{"model": "m", "temperature": NaN}', "invalid_json"),
    ],
)
def test_absurd_bodies_are_400(start_agent, http, raw, code):
    agent = start_agent(max_request_bytes=1 << 20)
    status, error = _error(http(agent.port, "POST", "/v1/chat/completions", raw=raw))
    assert (status, error["code"]) == (400, code)


def test_seed_beyond_64_bits_is_400(agent, http, chat_body):
    status, error = _error(http(agent.port, "POST", "/v1/chat/completions", chat_body(seed=2**70)))
    assert (status, error["param"]) == (400, "seed")


def test_model_names(agent, http, chat_body, model_name):
    for name in (model_name, f"{model_name}@v1"):
        assert http(agent.port, "POST", "/v1/chat/completions", chat_body(model=name))[0] == 200
    listed = http(agent.port, "GET", "/v1/models")[2]["data"][0]["id"]
    assert http(agent.port, "POST", "/v1/chat/completions", chat_body(model=listed))[0] == 200
    for wrong in ("gpt-4o", f"{model_name}@v0", ""):
        status, error = _error(http(agent.port, "POST", "/v1/chat/completions", chat_body(model=wrong)))
        assert status in {400, 404}
        if wrong:
            assert (status, error["code"], error["param"]) == (404, "model_not_found", "model")


def test_server_still_answers_after_bad_input(agent, http, chat_body):
    http(agent.port, "POST", "/v1/chat/completions", raw=b"\xff\xfe not json")
    http(agent.port, "POST", "/v1/chat/completions", raw=b"[1, 2]")
    status, _, body = http(agent.port, "POST", "/v1/chat/completions", chat_body())
    assert status == 200
    assert body["choices"][0]["message"]["role"] == "assistant"


def test_no_model_loaded_is_503_with_retry_after(start_agent, http, chat_body):
    agent = start_agent(load=False)
    status, headers, body = http(agent.port, "POST", "/v1/chat/completions", chat_body())
    assert (status, body["error"]["code"]) == (503, "model_unavailable")
    assert int(headers["retry-after"]) >= 1
    assert http(agent.port, "GET", "/readyz")[0] == 503
    assert http(agent.port, "GET", "/healthz")[0] == 200


def _open_stream(port, body):
    """Start a streamed chat on a raw socket and read until its first chunk (the assistant role)
    arrived: the request has its slot and its first token then. Not until a token's text: a token
    may hold part of a character only (the tiny model's byte tokens often do), which sends no chunk,
    and a gated engine would hold the next one back until its gate's timeout."""
    body = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    seen = b""
    while b"data: " not in seen:
        seen += sock.recv(4096)
    return sock


def test_over_capacity_is_429_with_retry_after(start_agent, gated, http, chat_body):
    factory, gate, generating = gated
    agent = start_agent(factory=factory, max_concurrent=1, queue_length=0, max_tokens=150)
    sock = _open_stream(agent.port, chat_body(max_tokens=150, temperature=0, stream=True))
    try:
        assert generating.wait(60)  # the stream holds the only slot until the gate opens
        status, headers, body = http(agent.port, "POST", "/v1/chat/completions", chat_body())
    finally:
        gate.set()
        sock.close()
    assert (status, body["error"]["code"]) == (429, "overloaded")
    assert int(headers["retry-after"]) >= 1


def test_client_leaving_mid_stream_frees_its_slot(start_agent, gated, http, chat_body, wait_until):
    factory, gate, generating = gated
    agent = start_agent(factory=factory, max_concurrent=1, queue_length=0, max_tokens=150)
    sock = _open_stream(agent.port, chat_body(max_tokens=150, temperature=0, stream=True))
    assert generating.wait(60)
    sock.close()
    wait_until(metric_is(agent, "sits_requests_cancelled_total", 1, reason="disconnect"), "cancel")
    gate.set()
    wait_until(lambda: agent.manager.counts().running == 0, "every slot returned")
    status, _, _ = http(agent.port, "POST", "/v1/chat/completions", chat_body(max_tokens=1))
    assert status == 200
    wait_until(
        lambda: (
            agent.metrics.value("sits_requests_total", endpoint="/v1/chat/completions", status="499") == 1
        ),
        "a 499 counted",
    )
    assert agent.metrics.value("sits_generation_tokens_total", adapter="") < 150


def test_an_empty_completion_prompt_names_prompt(agent, http, chat_body):
    # Found by test_fuzz_requests: the engine's refusal carried no param.
    completion = {"model": chat_body()["model"], "prompt": "", "max_tokens": 1}
    status, error = _error(http(agent.port, "POST", "/v1/completions", completion))
    assert (status, error["param"]) == (400, "prompt")
