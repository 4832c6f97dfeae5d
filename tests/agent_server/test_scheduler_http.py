"""The scheduler end to end over HTTP with the official openai client, on both engines: 1, 4 and 16
concurrent streams batched together answer exactly what each stream alone answers (greedy), the
gauges come back to zero, and hot swaps under 16 streaming clients fail no request."""

from __future__ import annotations

import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from deployer.agent.engines import make_engine
from deployer.agent.scheduler import SchedulerCounts
from tests.agent_server.conftest import metric_is
from tests.llamacpp.conftest import (  # noqa: F401 (fixtures)
    gguf_store,
    needs_llama_cpp,
    smollm2_gguf_dir,
    tiny_gguf_dir,
    tiny_gguf_dir_b,
)

SLOTS = 16
# Plain completions for the random tiny models: they answer every chat prompt alike, these not.
TINY_PROMPTS = [f"{'abcdefghijklmnop'[i]} {i * 7} then {'zyxwvutsrqponmlk'[i]}" for i in range(16)]
QUESTIONS = [
    f"In one sentence, what is {topic}?"
    for topic in (
        "a cat",
        "the sun",
        "rain",
        "a river",
        "bread",
        "music",
        "a bicycle",
        "the moon",
        "snow",
        "a library",
        "coffee",
        "a forest",
        "gravity",
        "a volcano",
        "chess",
        "an island",
    )
]
ENGINES = [pytest.param("llama.cpp", marks=needs_llama_cpp), "torch"]


@dataclass(frozen=True)
class Served:
    """What an agent under test serves: the engine, and how a request names and asks the model."""

    engine: str
    model: str
    chat: bool  # ask with chat messages (the real model) or plain completions (the tiny ones)
    prompts: list[str]


def _factory(engine: str):
    return lambda: make_engine(engine, context_length=256, threads=1, slots=SLOTS)


def _client(agent):
    # No retries: a request that fails must show up as a failure.
    return openai.OpenAI(base_url=f"http://127.0.0.1:{agent.port}/v1", api_key="unused", max_retries=0)


def _stream(client, served: Served, prompt: str, max_tokens: int = 24) -> tuple[str, str | None, str]:
    """(text, finish_reason, model) of one streamed greedy answer."""
    parts, finish, model = [], None, ""
    if served.chat:
        messages = [{"role": "user", "content": prompt}]
        chunks = client.chat.completions.create(
            model=served.model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
        )
    else:
        chunks = client.completions.create(
            model=served.model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
        )
    for chunk in chunks:
        model = chunk.model
        if chunk.choices:
            choice = chunk.choices[0]
            parts.append((choice.delta.content if served.chat else choice.text) or "")
            finish = choice.finish_reason or finish
    return "".join(parts), finish, model


def _start(start_agent, engine: str, directory: Path):
    agent = start_agent(load=False, factory=_factory(engine), max_concurrent=SLOTS, queue_length=SLOTS)
    result = agent.reload(directory, "v1")
    assert result.ok, result
    return agent


@pytest.fixture(params=ENGINES)
def concurrent_agent(request, start_agent, tiny_model_dir):
    """(agent, Served): the llama.cpp engine on SmolLM2 (Q4_1 GGUF), or the torch engine on the
    tiny checkpoint (the real model would take minutes on two cores), 16 slots each."""
    real = request.param == "llama.cpp"
    directory = request.getfixturevalue("smollm2_gguf_dir") if real else tiny_model_dir
    agent = _start(start_agent, request.param, directory)
    model = agent.manager.active_info().model
    return agent, Served(request.param, model, chat=real, prompts=QUESTIONS if real else TINY_PROMPTS)


def test_concurrent_streams_answer_as_one_stream_alone(concurrent_agent, wait_until):
    agent, served = concurrent_agent
    client = _client(agent)
    alone = [_stream(client, served, q) for q in served.prompts]
    assert len({text for text, _, _ in alone}) > 1
    for clients in (1, 4, 16):
        with ThreadPoolExecutor(clients) as pool:
            together = list(pool.map(lambda q: _stream(client, served, q), served.prompts))
        assert together == alone, f"{clients} concurrent streams on {served.engine}"
    wait_until(lambda: agent.manager.counts().running == 0, "every slot returned")
    # The gauges follow the counts at the end of the engine thread's round, a moment later.
    wait_until(metric_is(agent, "sits_requests_running", 0), "the running gauge at 0")
    assert agent.metrics.value("sits_requests_waiting") == 0


@pytest.fixture(params=ENGINES)
def two_versions(request, tiny_model_dir, tiny_model_dir_b, tmp_path):
    """(engine, v1 directory, v2 directory): two versions of one tiny model (the name requests use
    stays), as an update brings."""
    if request.param == "llama.cpp":
        return (
            "llama.cpp",
            request.getfixturevalue("tiny_gguf_dir"),
            request.getfixturevalue("tiny_gguf_dir_b"),
        )
    v2_dir = tmp_path / "v2" / tiny_model_dir.name
    shutil.copytree(tiny_model_dir_b, v2_dir)
    return "torch", tiny_model_dir, v2_dir


def test_swaps_under_16_streaming_clients_fail_no_request(start_agent, two_versions, wait_until):
    engine, v1_dir, v2_dir = two_versions
    agent = _start(start_agent, engine, v1_dir)
    served = Served(engine, agent.manager.active_info().model, chat=False, prompts=TINY_PROMPTS)
    client = _client(agent)
    stop = threading.Event()
    served_by, failures = [], []

    def hammer(i):
        while not stop.is_set():
            try:
                _, finish, model = _stream(client, served, served.prompts[i], max_tokens=12)
                assert finish in ("stop", "length")
                served_by.append(model)
            except (openai.OpenAIError, AssertionError) as exc:
                failures.append(repr(exc))

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    results = []
    try:
        for version, directory in (("v2", v2_dir), ("v1", v1_dir), ("v2", v2_dir)):
            # Each swap waits for a stream to start on the model it replaces, so all three swap
            # under load however slowly the clients come up.
            count = len(served_by)
            wait_until(lambda: len(served_by) > count, "a stream answered before the swap")  # noqa: B023
            result = agent.reload(directory, version)
            results.append((result.ok, result.active_version))
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
    assert failures == []
    assert results == [(True, "v2"), (True, "v1"), (True, "v2")]
    assert {model.rsplit("@", 1)[1] for model in served_by} == {"v1", "v2"}
    assert agent.metrics.value("sits_reloads_total", result="success") == 4  # the first load and 3 swaps
    wait_until(lambda: agent.manager.counts() == SchedulerCounts(0, 0), "every slot returned, none waiting")
