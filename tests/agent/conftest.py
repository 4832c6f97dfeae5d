"""A real agent server on 127.0.0.1 (port 0, admin socket under tmp) with the torch engine on the
seeded tiny checkpoints."""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from http.client import HTTPConnection
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deployer.agent.engines import make_engine
from deployer.agent.engines.base import Engine
from deployer.agent.http.server import AgentServer
from deployer.agent.ota.store import VersionRecord
from deployer.agent.settings import AgentSettings, SmokePrompt
from deployer.agent.types import SamplingParams
from deployer.core.release import ArtifactRef, FileHash, ModelRef, Release

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
def short_dir() -> Iterator[Path]:
    """A directory with a short path: a unix socket's path must fit in 107 bytes, pytest's tmp_path
    may not."""
    with tempfile.TemporaryDirectory(prefix="sits-") as name:
        yield Path(name)


@pytest.fixture
def start_agent(tiny_model_dir: Path, short_dir: Path) -> Iterator[StartAgent]:
    """Start agents; each loads `tiny_model_dir` as version "v1" unless load=False. Stopped at teardown.

    Each gets its own root and admin socket under `short_dir`."""
    servers: list[AgentServer] = []

    def start(load: bool = True, factory: Callable | None = None, **overrides: object) -> AgentServer:
        n = len(servers)
        defaults = {"root": short_dir / f"root{n}", "admin_socket": short_dir / f"admin{n}.sock"}
        settings = AgentSettings(**{**BASE_SETTINGS, **defaults, **overrides})
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


class UnixHTTPConnection(HTTPConnection):
    """http.client over a unix socket (the agent's admin surface)."""

    def __init__(self, path: Path, timeout: float = 60) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


def _request(
    port: int | Path,
    method: str,
    path: str,
    body: object = None,
    raw: bytes | None = None,
    headers: dict | None = None,
) -> tuple[int, dict, object]:
    """One HTTP request with http.client to a TCP port on 127.0.0.1, or to a unix socket's path;
    returns (status, headers, parsed JSON or text)."""
    conn = (
        UnixHTTPConnection(port) if isinstance(port, Path) else HTTPConnection("127.0.0.1", port, timeout=60)
    )
    try:
        payload = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(
            method, path, body=payload, headers={"Content-Type": "application/json", **(headers or {})}
        )
        response = conn.getresponse()
        data = response.read()
        content_type = response.getheader("Content-Type", "")
        parsed = json.loads(data) if content_type.startswith("application/json") else data.decode()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, parsed
    finally:
        conn.close()


def _chat_body(model: str, **extra: object) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, **extra}


@pytest.fixture
def http() -> Callable[..., tuple[int, dict, object]]:
    """`http(port, method, path, body=None, raw=None, headers=None)` -> (status, headers, JSON or text)."""
    return _request


def _wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"never happened within {timeout_s} s: {what}")


@pytest.fixture
def wait_until() -> Callable[[Callable[[], bool], str], None]:
    """`wait_until(predicate, what, timeout_s=60)`: poll, up to a deadline, for something the server
    does after it has answered, such as returning a slot."""
    return _wait_until


@pytest.fixture
def model_name(tiny_model_dir: Path) -> str:
    """The name the tiny model is served under (an artifact without a manifest: its folder's name)."""
    return tiny_model_dir.name


@pytest.fixture
def chat_body(model_name: str) -> Callable[..., dict]:
    """`chat_body(**extra)`: a minimal chat request for the tiny model with a few tokens of answer."""
    return lambda **extra: _chat_body(**{"model": model_name, **extra})


def parse_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics text as {(sample name, sorted label pairs): value}, through prometheus_client's parser."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


class EngineWrapper:
    """Base of the test wrappers around a real engine: what a wrapper does not define is the
    engine's, except `prefill_many`, which runs the wrapper's own `prefill` for each request."""

    _engine: Engine

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)

    def prefill_many(
        self, items: Sequence[tuple[int, Sequence[int], SamplingParams]]
    ) -> list[int | Exception]:
        return Engine.prefill_many(self, items)


class GatedEngine(EngineWrapper):
    """A real engine whose long generations (max_tokens >= GATED_FROM) pause after their first token
    until `gate` is set: a test can then act while a request is provably mid-generation. The pause
    is the first decode step that includes a long generation's slot (the engine thread waits in it,
    so the whole batch does). A wrapper, not a fake: every token still comes from the real engine."""

    GATED_FROM = 100

    def __init__(self, engine: Engine, gate: threading.Event, generating: threading.Event) -> None:
        self._engine = engine
        self._gate = gate
        self._generating = generating
        self._long: set[int] = set()

    def prefill(self, slot: int, prompt: Sequence[int], params: SamplingParams) -> int:
        (self._long.add if params.max_tokens >= self.GATED_FROM else self._long.discard)(slot)
        return self._engine.prefill(slot, prompt, params)

    def step(self, slots: Sequence[int]) -> list[int]:
        if self._long.intersection(slots):
            self._generating.set()
            assert self._gate.wait(60), "the test never opened the gate"
        return self._engine.step(slots)


@pytest.fixture
def gated(tiny_model_dir: Path) -> Iterator[tuple[Callable, threading.Event, threading.Event]]:
    """(factory, gate, generating): engines from `factory` hold long generations after one token
    (`generating` is set then) until `gate` is set; the gate opens at teardown."""
    gate, generating = threading.Event(), threading.Event()

    def factory() -> GatedEngine:
        return GatedEngine(make_engine("torch", context_length=512, threads=1), gate, generating)

    yield factory, gate, generating
    gate.set()


def version_record(version: str) -> VersionRecord:
    """A store record for `version`, as a verified install leaves it (tests that skip signing)."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    release = Release(
        model=ModelRef(name="tiny", version=version),
        counter=1,
        artifact=ArtifactRef(
            sha256="0" * 64, files={"sits-manifest.json": FileHash(sha256="0" * 64, size=1)}
        ),
        created=now,
        expires=now,
    )
    return VersionRecord(release=release, installed_at=now)


def metric_is(agent: AgentServer, name: str, value: float, **labels: str) -> Callable[[], bool]:
    """A wait_until predicate: the agent's metric sample `name{labels}` equals `value`."""
    return lambda: agent.metrics.value(name, **labels) == value
