"""Issue 36, the HTTP part, as an attacker and a careless client would try it: a web page reaching
a keyless agent through DNS rebinding, silent TLS connections, a burst of connections right after
a real request, malformed Content-Length, and 400s that must name the field the client sent.
Real clients (the official openai client) and raw sockets; no sleeps."""

from __future__ import annotations

import json
import secrets
import ssl
import threading

import openai
import pytest

from deployer.agent.http.auth import hash_key
from tests.agent.http.test_auth_tls import _self_signed
from tests.agent.http.test_http_faults import _closed_by_server, _connect, _read_response, _request

MESSAGES = [{"role": "user", "content": "Hi"}]


def _client(port: int, host: str | None = None, key: str = "unused") -> openai.OpenAI:
    headers = {"Host": host} if host is not None else None
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, default_headers=headers
    )


# -- 1. DNS rebinding ------------------------------------------------------------------------------


def test_a_keyless_agent_refuses_foreign_host_names(start_agent, http, model_name):
    agent = start_agent(allowed_hosts=["sits-box.local"])
    port = agent.port
    # A page on attacker.example whose name now resolves to 127.0.0.1: the browser sends its Host.
    rebound = _client(port, host=f"attacker.example:{port}")
    with pytest.raises(openai.PermissionDeniedError) as refused:
        rebound.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=2)
    assert refused.value.status_code == 403
    assert refused.value.code == "host_not_allowed"
    with pytest.raises(openai.PermissionDeniedError):
        rebound.models.list()
    for path in ("/metrics", "/v1/models"):
        status, _, body = http(port, "GET", path, headers={"Host": "attacker.example"})
        assert status == 403 and body["error"]["code"] == "host_not_allowed", path
    for tricky in ("localhost.attacker.example", "127.0.0.1.nip.io", "attacker.example@localhost", "[::1"):
        assert http(port, "GET", "/v1/models", headers={"Host": tricky})[0] == 403, tricky
    # Loopback names with or without a port, and agent.yaml's allowed_hosts, are answered.
    for host in ("localhost", f"localhost:{port}", "127.0.0.1", "127.0.0.2:1", f"[::1]:{port}", "LocalHost."):
        assert http(port, "GET", "/v1/models", headers={"Host": host})[0] == 200, host
    assert _client(port, host=f"sits-box.local:{port}").models.list().data[0].id.startswith(model_name)
    assert _client(port).models.list().data[0].id.startswith(model_name)  # what a client sends by default
    assert agent.metrics.value("sits_auth_failures_total", reason="foreign_host") >= 6


def test_an_agent_with_api_keys_answers_any_host_name_with_a_key(start_agent, short_dir, model_name, http):
    key = secrets.token_urlsafe(32)
    (short_dir / "api-keys").write_text(hash_key(key) + "\n")
    agent = start_agent(load=False, api_keys_file=short_dir / "api-keys")
    # Behind a name nobody listed (a reverse proxy, a DNS name): the key is what protects it.
    assert _client(agent.port, host="agent.example.com", key=key).models.list().object == "list"
    with pytest.raises(openai.AuthenticationError):
        _client(agent.port, host="agent.example.com").models.list()


# -- 3. TLS connections under the connection limits --------------------------------------------------


@pytest.fixture
def tls_files(short_dir):
    return _self_signed(short_dir)


def _tls_client(port: int, cert) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"https://127.0.0.1:{port}/v1",
        api_key="unused",
        max_retries=0,
        timeout=30,
        http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(cert))),
    )


def test_silent_tls_connections_are_capped_from_accept(start_agent, tls_files, model_name, wait_until):
    cert, key = tls_files
    agent = start_agent(
        load=False, tls_certfile=cert, tls_keyfile=key, max_connections=16, header_timeout_s=60
    )
    silent = [_connect(agent.port) for _ in range(100)]  # never a ClientHello
    try:
        # Counted from accept, so the newest push the oldest out, as over plain HTTP.
        wait_until(
            lambda: (
                agent.metrics.value("sits_http_connections_closed_total", reason="evicted") >= 100 - 16
                and agent.metrics.value("sits_http_connections") <= 16
            ),
            "silent TLS connections evicted",
        )
        assert _tls_client(agent.port, cert).models.list().object == "list"
    finally:
        for sock in silent:
            sock.close()


def test_a_tls_handshake_has_the_header_deadline(start_agent, tls_files):
    cert, key = tls_files
    agent = start_agent(load=False, tls_certfile=cert, tls_keyfile=key, header_timeout_s=1.0)
    sock = _connect(agent.port)
    sock.settimeout(30)  # asyncio's own handshake timeout is 60 s
    try:
        assert _closed_by_server(sock), "a connection that never began its handshake stayed open"
    finally:
        sock.close()
    assert agent.metrics.value("sits_http_connections_closed_total", reason="header_timeout") == 1
    assert _tls_client(agent.port, cert).models.list().object == "list"


# -- 10. a burst of connections does not evict a request that has arrived ---------------------------


def test_a_burst_after_a_request_evicts_the_silent_connections_not_the_request(start_agent):
    agent = start_agent(load=False, max_connections=32)
    loop = agent._loop
    assert loop is not None
    # Hold the event loop while the request and the burst reach the kernel, so that asyncio accepts
    # them all before it reads any: the order a loaded device sees them in, made certain.
    hold, held = threading.Event(), threading.Event()
    loop.call_soon_threadsafe(lambda: (held.set(), hold.wait(60)))
    assert held.wait(60)
    try:
        real = _connect(agent.port)
        real.sendall(_request("GET", "/v1/models"))
        burst = [_connect(agent.port) for _ in range(96)]
    finally:
        hold.set()
    try:
        status, _, body = _read_response(real)
        assert status == 200 and json.loads(body)["object"] == "list"
        assert agent.metrics.value("sits_http_connections_closed_total", reason="evicted") >= 96 - 32
    finally:
        real.close()
        for sock in burst:
            sock.close()


# -- 11. malformed Content-Length ------------------------------------------------------------------


@pytest.mark.parametrize("length", [b"-5", b"abc", b"1, 2"])
def test_a_malformed_content_length_gets_the_openai_error_object(start_agent, length):
    agent = start_agent(load=False)
    sock = _connect(agent.port)
    try:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + length + b"\r\n\r\n{}"
        )
        status, headers, payload = _read_response(sock)
    finally:
        sock.close()
    assert status == 400
    assert headers["content-type"] == "application/json"
    error = json.loads(payload)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"], error["type"]) == (
        "Content-Length",
        "invalid_http",
        "invalid_request_error",
    )


# -- 9. every 400 names the field the client sent ----------------------------------------------------


def _param_of(call) -> str | None:
    with pytest.raises(openai.BadRequestError) as refused:
        call()
    return refused.value.param


def test_400s_name_the_field_the_client_sent(start_agent, model_name):
    agent = start_agent(max_request_bytes=4 << 20)
    client = _client(agent.port)

    def chat(**extra):
        return lambda: client.chat.completions.create(model=model_name, messages=MESSAGES, **extra)

    assert _param_of(chat(max_completion_tokens=10_000)) == "max_completion_tokens"
    assert _param_of(chat(max_tokens=10_000)) == "max_tokens"
    assert _param_of(chat(max_tokens=4, logit_bias={"999999": 5})) == "logit_bias"
    many = {str(i): -1 for i in range(5000)}  # more entries than any vocabulary check should list
    assert _param_of(chat(max_tokens=4, logit_bias=many)) == "logit_bias"
    # Each tool's schema is fine; together they are a grammar too big to compile.
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"f{k}",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "string", "enum": [f"v{k}x{i}" for i in range(40_000)]}},
                },
            },
        }
        for k in range(4)
    ]
    assert _param_of(chat(max_tokens=4, tools=tools)) == "tools"
    too_long = "hello " * 400  # more tokens than the tiny model's context
    assert _param_of(lambda: client.embeddings.create(model=model_name, input=too_long)) == "input"
    assert _param_of(lambda: client.embeddings.create(model=model_name, input=["a", too_long])) == "input"
