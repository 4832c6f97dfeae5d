"""The agent server with the llama.cpp engine: the OpenAI client, and GGUF hot swaps under load
with no failed request, a refused broken GGUF, and a rollback, exactly as with torch."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator

import openai
import pytest

from deployer.agent.engines import make_engine
from deployer.agent.http.server import AgentServer
from deployer.agent.settings import AgentSettings, SmokePrompt
from deployer.build.gguf_writer import GGUF_NAME
from tests.agent.engines.llamacpp.conftest import needs_llama_cpp

pytestmark = needs_llama_cpp

MESSAGES = [{"role": "user", "content": "Hello"}]
SETTINGS = {
    "port": 0,
    "engine": "llama.cpp",
    "context_length": 256,
    "max_prompt_tokens": 128,
    "max_tokens": 64,
    "max_concurrent": 4,
    "queue_length": 16,
    "smoke_prompts": (SmokePrompt(prompt="Hi", max_tokens=2),),
    "latency_budget_ms": 60_000,
}


@pytest.fixture
def agent(tiny_gguf_dir) -> Iterator[AgentServer]:
    """An agent serving the tiny Q8_0 GGUF as "v1" through llama.cpp (one thread)."""
    settings = AgentSettings(**SETTINGS)
    server = AgentServer(settings, lambda: make_engine("llama.cpp", context_length=256, threads=1))
    server.start()
    try:
        assert server.reload(tiny_gguf_dir, "v1").ok
        yield server
    finally:
        server.stop()


def _client(agent: AgentServer) -> openai.OpenAI:
    # No retries: a request that fails during a swap must show up as a failure.
    return openai.OpenAI(base_url=f"http://127.0.0.1:{agent.port}/v1", api_key="unused", max_retries=0)


def test_the_openai_client_chats_and_streams(agent):
    client = _client(agent)
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0)
    assert answer.model.endswith("@v1") and answer.usage.completion_tokens >= 1
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, stream=True
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == answer.choices[0].message.content
    (model,) = [m for m in client.models.list().data if m.id.endswith("@v1")]
    assert model.model_extra["engine"] == "llama.cpp"


def test_gguf_swaps_under_concurrent_load_fail_no_request(agent, tiny_gguf_dir, tiny_gguf_dir_b):
    client = _client(agent)
    stop = threading.Event()
    served, failures = [], []

    def hammer() -> None:
        while not stop.is_set():
            try:
                answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
                served.append(answer.model.rsplit("@", 1)[1])
            except openai.OpenAIError as exc:
                failures.append(repr(exc))

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for thread in threads:
        thread.start()
    results = []
    try:
        for version, directory in (("v2", tiny_gguf_dir_b), ("v1", tiny_gguf_dir), ("v2", tiny_gguf_dir_b)):
            results.append(agent.reload(directory, version).ok)
            _wait_until_served(served, version)
        rollback = agent.reload(tiny_gguf_dir, "v1", reason="rollback")
        _wait_until_served(served, "v1")
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
    assert failures == []
    assert results == [True, True, True] and rollback.ok
    assert set(served) == {"v1", "v2"}
    assert agent.metrics.value("sits_rollbacks_total", result="success") == 1
    assert agent.manager.active_info().version == "v1"


def _wait_until_served(served: list[str], version: str, timeout_s: float = 60.0) -> None:
    """Let the load reach the new model before the next swap (a swap of the tiny model takes ms)."""
    seen = len(served)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and version not in served[seen:]:
        time.sleep(0.01)


def test_a_corrupt_gguf_is_refused_and_the_old_keeps_serving(agent, tiny_gguf_dir, tmp_path):
    broken = shutil.copytree(tiny_gguf_dir, tmp_path / "broken")
    data = bytearray((broken / GGUF_NAME).read_bytes())
    data[0:4] = b"JUNK"
    (broken / GGUF_NAME).write_bytes(bytes(data))
    result = agent.reload(broken, "v2")
    assert (result.ok, result.phase, result.active_version) == (False, "load", "v1")
    assert "bad magic" in result.reason
    answer = _client(agent).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert answer.model.endswith("@v1")
