"""Bad input over raw HTTP: each answered with an OpenAI-style error; the server keeps serving."""

from __future__ import annotations

import json
import socket
import time

import pytest

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


def test_unknown_field_is_named(agent, http, chat_body):
    status, error = _error(http(agent.port, "POST", "/v1/chat/completions", chat_body(logit_bias={"1": 2})))
    assert (status, error["code"], error["param"]) == (400, "unknown_parameter", "logit_bias")


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
    status, error = _error(
        http(agent.port, "POST", "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 10**6})
    )
    assert (status, error["param"]) == (400, "max_tokens")


def test_unknown_route_and_wrong_method(agent, http):
    assert _error(http(agent.port, "GET", "/v2/nothing"))[0] == 404
    assert _error(http(agent.port, "GET", "/v1/chat/completions"))[0] == 404


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
    assert int(headers["Retry-After"]) >= 1
    assert http(agent.port, "GET", "/readyz")[0] == 503
    assert http(agent.port, "GET", "/healthz")[0] == 200


def _open_stream(port, max_tokens):
    """Start a streamed chat on a raw socket and read until the first token event arrived."""
    body = json.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": max_tokens,
            "stream": True,
        }
    ).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    seen = b""
    while seen.count(b"data: ") < 2:  # the role chunk, then the first token
        seen += sock.recv(4096)
    return sock


def test_over_capacity_is_429_with_retry_after(start_agent, http, chat_body):
    agent = start_agent(max_concurrent=1, queue_length=0, max_tokens=150)
    sock = _open_stream(agent.port, max_tokens=150)
    try:
        status, headers, body = http(agent.port, "POST", "/v1/chat/completions", chat_body())
    finally:
        sock.close()
    assert (status, body["error"]["code"]) == (429, "overloaded")
    assert int(headers["Retry-After"]) >= 1


def test_client_leaving_mid_stream_frees_its_slot(start_agent, http, chat_body, wait_until):
    agent = start_agent(max_concurrent=1, queue_length=0, max_tokens=150)
    _open_stream(agent.port, max_tokens=150).close()
    statuses = []
    for _ in range(600):  # until the server notices the closed socket and frees the slot
        status, _, _ = http(agent.port, "POST", "/v1/chat/completions", chat_body(max_tokens=1))
        statuses.append(status)
        if status == 200:
            break
        time.sleep(0.05)
    assert statuses[-1] == 200
    assert set(statuses) <= {200, 429}
    left = 'sits_requests_total{endpoint="/v1/chat/completions",status="499"} 1.0'
    wait_until(lambda: left in http(agent.port, "GET", "/metrics")[2].splitlines(), "a 499 counted")
    wait_until(lambda: agent.manager.counts().running == 0, "every slot returned")
