"""A real agent server on 127.0.0.1 (port 0) with the torch engine on the seeded tiny checkpoints."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from http.client import HTTPConnection
from pathlib import Path

import pytest

from deployer.agent.engines import make_engine
from deployer.agent.http.server import AgentServer
from deployer.agent.settings import AgentSettings, SmokePrompt

# Small limits keep the tiny model fast; tests override what they exercise.
BASE_SETTINGS = {
    "port": 0,
    "context_length": 256,
    "max_prompt_tokens": 128,
    "max_tokens": 64,
    "request_timeout_s": 60.0,
    "smoke_prompts": (SmokePrompt(prompt="Hi", max_tokens=2),),
    "latency_budget_ms": 60_000,
}

StartAgent = Callable[..., AgentServer]


def engine_factory(settings: AgentSettings) -> Callable:
    """The production factory, one torch thread (the CI machine has two cores for everything)."""
    return lambda: make_engine("torch", context_length=settings.context_length, threads=1)


@pytest.fixture
def start_agent(tiny_model_dir: Path) -> Iterator[StartAgent]:
    """Start agents; each loads `tiny_model_dir` as version "v1" unless load=False. Stopped at teardown."""
    servers: list[AgentServer] = []

    def start(load: bool = True, factory: Callable | None = None, **overrides: object) -> AgentServer:
        settings = AgentSettings(**{**BASE_SETTINGS, **overrides})
        server = AgentServer(settings, factory or engine_factory(settings))
        server.start()
        servers.append(server)
        if load:
            result = server.reload(tiny_model_dir, "v1")
            assert result.ok, result
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def broken_model_dir(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """A copy of the tiny checkpoint whose safetensors header is garbage."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    weights = broken / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:64] = b"\xff" * 56
    weights.write_bytes(bytes(data))
    return broken


def _request(
    port: int,
    method: str,
    path: str,
    body: object = None,
    raw: bytes | None = None,
    headers: dict | None = None,
) -> tuple[int, dict, object]:
    """One HTTP request with http.client; returns (status, headers, parsed JSON or text)."""
    conn = HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        payload = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(
            method, path, body=payload, headers={"Content-Type": "application/json", **(headers or {})}
        )
        response = conn.getresponse()
        data = response.read()
        content_type = response.getheader("Content-Type", "")
        parsed = json.loads(data) if content_type.startswith("application/json") else data.decode()
        return response.status, dict(response.getheaders()), parsed
    finally:
        conn.close()


def _chat_body(**extra: object) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, **extra}


@pytest.fixture
def http() -> Callable[..., tuple[int, dict, object]]:
    """`http(port, method, path, body=None, raw=None, headers=None)` -> (status, headers, JSON or text)."""
    return _request


def _wait_until(predicate: Callable[[], bool], what: str) -> None:
    for _ in range(6000):
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


@pytest.fixture
def wait_until() -> Callable[[Callable[[], bool], str], None]:
    """`wait_until(predicate, what)`: poll (up to a minute) for something the server does after it
    has answered, such as returning a slot."""
    return _wait_until


@pytest.fixture
def chat_body() -> Callable[..., dict]:
    """`chat_body(**extra)`: a minimal chat request with a few tokens of answer."""
    return _chat_body
