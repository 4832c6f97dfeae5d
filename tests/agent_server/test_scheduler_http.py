"""The scheduler end to end over HTTP, with the official openai client: 1, 4 and 16 concurrent streams
batched on the llama.cpp engine answer exactly what one stream alone answers, the gauges come back
to zero, and hot swaps under 16 streaming clients fail no request."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from deployer.agent.engines import make_engine
from tests.llamacpp.conftest import (  # noqa: F401 (fixtures)
    gguf_store,
    needs_llama_cpp,
    tiny_gguf_dir,
    tiny_gguf_dir_b,
)

pytestmark = needs_llama_cpp

# Plain completions: the random tiny model answers every chat prompt alike, these differently.
PROMPTS = [f"{'abcdefghijklmnop'[i]} {i * 7} then {'zyxwvutsrqponmlk'[i]}" for i in range(16)]


def _llama_factory(slots):
    return lambda: make_engine("llama.cpp", context_length=256, threads=1, slots=slots)


def _client(agent):
    # No retries: a request that fails must show up as a failure.
    return openai.OpenAI(base_url=f"http://127.0.0.1:{agent.port}/v1", api_key="unused", max_retries=0)


def _stream(client, prompt, max_tokens=24):
    """(text, finish_reason, model) of one streamed completion."""
    parts, finish, model = [], None, None
    for chunk in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    ):
        model = chunk.model
        if chunk.choices:
            parts.append(chunk.choices[0].text or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(parts), finish, model


@pytest.fixture
def llama_agent(start_agent, tiny_gguf_dir):  # noqa: F811
    """An agent serving the tiny GGUF with the llama.cpp engine, 16 slots."""
    agent = start_agent(load=False, factory=_llama_factory(16), max_concurrent=16, queue_length=16)
    result = agent.reload(tiny_gguf_dir, "v1")
    assert result.ok, result
    return agent


def test_concurrent_streams_answer_as_one_stream_alone(llama_agent, wait_until):
    client = _client(llama_agent)
    alone = [_stream(client, q) for q in PROMPTS]
    assert len({text for text, _, _ in alone}) > 1
    for clients in (1, 4, 16):
        with ThreadPoolExecutor(clients) as pool:
            together = list(pool.map(lambda q: _stream(client, q), PROMPTS))
        assert together == alone, f"{clients} concurrent streams"
    wait_until(lambda: llama_agent.manager.counts().running == 0, "every slot returned")
    assert llama_agent.metrics.running.value() == 0
    assert llama_agent.metrics.waiting.value() == 0


def test_swaps_under_16_streaming_clients_fail_no_request(llama_agent, tiny_gguf_dir, tiny_gguf_dir_b, http):  # noqa: F811
    client = _client(llama_agent)
    stop = threading.Event()
    served, failures = [], []

    def hammer(i):
        while not stop.is_set():
            try:
                _, finish, model = _stream(client, PROMPTS[i], max_tokens=12)
                assert finish in ("stop", "length")
                served.append(model)
            except (openai.OpenAIError, AssertionError) as exc:
                failures.append(repr(exc))

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    results = []
    try:
        for version, directory in (("v2", tiny_gguf_dir_b), ("v1", tiny_gguf_dir), ("v2", tiny_gguf_dir_b)):
            status, _, body = http(
                llama_agent.port,
                "POST",
                "/admin/reload",
                {"version": version, "artifact_dir": str(directory)},
            )
            results.append((status, body["ok"], body["active_version"]))
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
    assert failures == []
    assert results == [(200, True, "v2"), (200, True, "v1"), (200, True, "v2")]
    assert {model.rsplit("@", 1)[1] for model in served} == {"v1", "v2"}
