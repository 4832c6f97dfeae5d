"""The scheduler end to end over HTTP with the official openai client, on both engines: 1, 4 and 16
concurrent streams batched together answer exactly what each stream alone answers (greedy), the
gauges come back to zero, a request whose grammar refuses mid-batch fails alone, and hot swaps
under 16 streaming clients fail no request."""

from __future__ import annotations

import dataclasses
import itertools
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from deployer.agent.engines import make_engine
from deployer.agent.engines.base import EMBED_PIECE_TOKENS
from deployer.agent.runtime.scheduler import SchedulerCounts
from tests.agent.conftest import GatedEngine, metric_is
from tests.agent.engines.llamacpp.conftest import (  # noqa: F401 (fixtures)
    gguf_store,
    needs_llama_cpp,
    smollm2_gguf_dir,
    tiny_gguf_dir,
    tiny_gguf_dir_b,
)
from tests.grammars import DEAD_END_SCHEMA as DEAD_END

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


@pytest.mark.parametrize("engine", ENGINES)
def test_a_request_whose_grammar_refuses_fails_alone_beside_streams(
    request, start_agent, tiny_model_dir, engine, wait_until
):
    real = engine == "llama.cpp"
    gate, generating = threading.Event(), threading.Event()
    gate.set()
    factory = _factory(engine)
    agent = start_agent(
        load=False,
        factory=lambda: GatedEngine(factory(), gate, generating),
        max_concurrent=SLOTS,
        max_tokens=GatedEngine.GATED_FROM,
    )
    assert agent.reload(request.getfixturevalue("smollm2_gguf_dir") if real else tiny_model_dir, "v1").ok
    served = Served(engine, agent.manager.active_info().model, real, QUESTIONS if real else TINY_PROMPTS)
    client = _client(agent)
    prompts = served.prompts[:3]
    long = GatedEngine.GATED_FROM  # held after their first token while the gate is closed
    alone = [_stream(client, served, p, max_tokens=long) for p in prompts]
    gate.clear()
    generating.clear()

    def refusing(stream: bool) -> str | None:
        """The error code the client raises for a chat whose schema dead-ends after `{"a":`."""
        try:
            answer = client.chat.completions.create(
                model=served.model,
                messages=[{"role": "user", "content": "Answer in JSON."}],
                response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": DEAD_END}},
                temperature=0,
                stream=stream,
            )
            if stream:
                list(answer)
        except openai.APIError as exc:
            return exc.code
        return None

    with ThreadPoolExecutor(5) as pool:
        others = [pool.submit(_stream, client, served, p, long) for p in prompts]
        assert generating.wait(60)
        bad = [pool.submit(refusing, stream) for stream in (True, False)]
        # Everyone is in before the batch goes on: the refusals come in steps beside the streams.
        wait_until(lambda: sum(dataclasses.astuple(agent.manager.counts())) == 5, "all five submitted")
        gate.set()
        assert [b.result() for b in bad] == ["grammar_dead_end", "grammar_dead_end"]
        assert [o.result() for o in others] == alone
    bad_requests = metric_is(agent, "sits_requests_total", 1, endpoint="/v1/chat/completions", status="400")
    wait_until(bad_requests, "the non-streamed refusal counted as a 400")
    wait_until(lambda: agent.manager.counts() == SchedulerCounts(0, 0), "every slot returned")


class LoggedEngine(GatedEngine):
    """A GatedEngine that logs its admission rounds, its decode steps and the pieces of its
    embeddings (all on the engine thread)."""

    def __init__(self, engine, gate: threading.Event, generating: threading.Event) -> None:
        super().__init__(engine, gate, generating)
        self.log: list[str] = []

    def prefill_many(self, items):
        results = super().prefill_many(items)
        self.log.append("prefill")
        return results

    def step(self, slots):
        tokens = super().step(slots)
        self.log.append("step")
        return tokens

    def embed_pieces(self, texts):
        return self._logged(self._engine.embed_pieces(texts))

    def _logged(self, pieces):
        while True:
            try:
                next(pieces)
            except StopIteration as done:
                self.log.append("piece")
                return done.value
            self.log.append("piece")
            yield


@pytest.mark.parametrize("engine", ENGINES)
def test_an_embedding_runs_in_pieces_between_the_steps_of_streams(
    request, start_agent, tiny_model_dir, engine, wait_until
):
    gate, generating = threading.Event(), threading.Event()
    gate.set()
    engines: list[LoggedEngine] = []
    factory = _factory(engine)

    def logged():
        engines.append(LoggedEngine(factory(), gate, generating))
        return engines[-1]

    directory = request.getfixturevalue("tiny_gguf_dir") if engine == "llama.cpp" else tiny_model_dir
    agent = start_agent(load=False, factory=logged, max_concurrent=SLOTS, max_tokens=GatedEngine.GATED_FROM)
    assert agent.reload(directory, "v1").ok
    served = Served(engine, agent.manager.active_info().model, chat=False, prompts=TINY_PROMPTS)
    client = _client(agent)
    # 16 inputs longer than a piece each: 16 pieces.
    inputs = [f"{i} " + " ".join(["edge devices run small models"] * 8) for i in range(16)]
    alone = client.embeddings.create(model=served.model, input=inputs, encoding_format="float")
    assert alone.usage.prompt_tokens > 16 * EMBED_PIECE_TOKENS
    gate.clear()
    log = engines[-1].log
    log.clear()
    with agent.manager.lease() as slot:
        scheduler = slot.scheduler
    handed, hand = threading.Event(), scheduler.run_in_pieces

    def handing(work):
        future = hand(work)
        handed.set()
        return future

    scheduler.run_in_pieces = handing  # this instance's: tells the test the work is queued
    with ThreadPoolExecutor(5) as pool:
        # Held at their first step until the embedding is queued: it meets them all running.
        streams = [
            pool.submit(_stream, client, served, p, GatedEngine.GATED_FROM) for p in served.prompts[:4]
        ]
        assert generating.wait(60)
        embedded = pool.submit(
            client.embeddings.create, model=served.model, input=inputs, encoding_format="float"
        )
        assert handed.wait(60)
        gate.set()
        together = embedded.result()
        assert all(stream.result()[1] in ("stop", "length") for stream in streams)
    for mine, theirs in zip(together.data, alone.data, strict=True):
        assert mine.embedding == pytest.approx(theirs.embedding, abs=1e-5)
    pieces = [i for i, entry in enumerate(log) if entry == "piece"]
    assert len(pieces) == 16
    # The streams were running throughout (100 tokens each): engine work for them between every two
    # pieces, a decode step, or the admission round of a stream that arrived late (a burst's
    # requests are admitted before the batch steps, so that they start together).
    assert all(b - a > 1 for a, b in itertools.pairwise(pieces)), " ".join(log)
    assert log.count("step") >= 15, " ".join(log)


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
