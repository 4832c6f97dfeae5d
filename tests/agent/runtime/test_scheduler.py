"""The scheduler on real engines, each test on both: continuous batching (the llama.cpp engine on the
tiny GGUF, the torch engine on the tiny checkpoint), bounded queues, cancellation, stalled and
abandoned consumers, asyncio consumers, draining, and the engine thread's own torch settings."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import itertools
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from deployer.agent.engines import make_engine
from deployer.agent.runtime.scheduler import (
    Arrivals,
    EngineStopped,
    Overloaded,
    QueueTimeout,
    Scheduler,
    SchedulerCounts,
    SchedulerLimits,
)
from deployer.agent.types import SamplingParams
from deployer.errors import AgentError, GrammarError
from tests.agent.conftest import EngineWrapper
from tests.agent.engines.llamacpp.conftest import gguf_store, needs_llama_cpp, tiny_gguf_dir  # noqa: F401 (fixtures)
from tests.grammars import dead_end_grammar

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
LONG = SamplingParams(max_tokens=200, temperature=0.0)
PROMPTS = ([5, 17, 33, 101, 7, 250], [9, 9, 40, 300, 12], [77, 3, 180, 64, 200, 15, 6], [150, 151, 152])


def _scheduler(
    engine_name: str,
    directory: Path,
    slots: int = 4,
    wrap: Callable | None = None,
    arrivals: Arrivals | None = None,
    **limits: object,
) -> Scheduler:
    engine = make_engine(engine_name, context_length=256, threads=1, slots=slots)
    served = wrap(engine) if wrap else engine
    scheduler = Scheduler(served, SchedulerLimits(**{"batch_size": slots, **limits}), arrivals=arrivals)
    scheduler.run(lambda: engine.load(directory))  # on the engine thread, as the model manager does
    return scheduler


def _stop(scheduler: Scheduler) -> None:
    scheduler.close(final=scheduler.engine.unload)
    assert scheduler.join(60)


@pytest.fixture(params=[pytest.param("llama.cpp", marks=needs_llama_cpp), "torch"])
def make(request, tiny_model_dir):
    """`make(slots=4, wrap=None, arrivals=None, **limits)`: schedulers on the tiny model of the
    engine the test runs with (served through `wrap(engine)` when given); closed and unloaded at
    teardown."""
    name = request.param
    directory = request.getfixturevalue("tiny_gguf_dir") if name == "llama.cpp" else tiny_model_dir
    made = []

    def start(slots=4, wrap=None, arrivals=None, **limits) -> Scheduler:
        made.append(_scheduler(name, directory, slots, wrap, arrivals, **limits))
        return made[-1]

    yield start
    for scheduler in made:
        _stop(scheduler)


def _tokens(generation):
    return [event.token_id for event in generation]


def test_requests_in_one_batch_answer_as_they_do_alone(make):
    # Announced on their way, the four start together, in one prefill. Counting running requests
    # instead raced: a loaded machine can pause this thread for the first one's 16 tokens (CI).
    arrivals = Arrivals()
    scheduler = make(wrap=PrefillRecorder, arrivals=arrivals, gather_s=600.0)
    alone = [_tokens(scheduler.submit(p, GREEDY)) for p in PROMPTS]
    for _ in PROMPTS:
        arrivals.coming()
    generations = []
    for p in PROMPTS:
        generations.append(scheduler.submit(p, GREEDY))
        arrivals.came()
    assert [_tokens(g) for g in generations] == alone
    assert [len(r) for r in scheduler.engine.rounds] == [1, 1, 1, 1, 4]  # all four at once
    assert all(len(tokens) == 16 for tokens in alone)
    assert len({tuple(t) for t in alone}) > 1


def test_a_request_whose_grammar_refuses_fails_alone(make, wait_until):
    scheduler = make()
    alone = [_tokens(scheduler.submit(p, GREEDY)) for p in PROMPTS[:3]]
    dead_end = SamplingParams(max_tokens=16, temperature=0.0, grammar=dead_end_grammar())
    refusing = scheduler.submit(PROMPTS[3], dead_end)
    others = [scheduler.submit(p, GREEDY) for p in PROMPTS[:3]]
    for generation in (refusing, *others):
        generation.wait_started()
    assert scheduler.counts() == SchedulerCounts(4, 0)  # its first token came in the batch of four
    written = []
    with pytest.raises(GrammarError, match="allows no token here after 5 generated tokens"):
        for event in refusing:
            written.append(event.text)
    assert "".join(written) == '{"a":'  # the refusal came in a step, beside the others
    assert [_tokens(g) for g in others] == alone
    wait_until(lambda: scheduler.counts() == SchedulerCounts(0, 0), "every slot freed")


def test_work_in_pieces_runs_a_piece_between_two_decode_steps(make):
    scheduler = make()
    engine = scheduler.engine
    log: list[str] = []  # written on the engine thread only
    queued = threading.Event()
    step = engine.step

    def logged_step(slots):
        assert queued.wait(60)  # hold the batch until the work is handed over
        log.append("step")
        return step(slots)

    engine.step = logged_step  # the scheduler's engine, on this instance only

    def work(n):
        for _ in range(n):
            log.append("piece")
            yield
        return "done"

    never_end = tuple((token, -100.0) for token in engine.end_ids)
    long = SamplingParams(max_tokens=200, temperature=0.0, logit_bias=never_end)
    generations = [scheduler.submit(p, long) for p in PROMPTS]
    done = scheduler.run_in_pieces(work(5))
    dropped = scheduler.run_in_pieces(work(100))
    dropped.cancel()
    queued.set()
    assert done.result(60) == "done"
    pieces = [i for i, entry in enumerate(log) if entry == "piece"]
    assert len(pieces) == 5  # the cancelled work never ran
    assert all(b - a > 1 for a, b in itertools.pairwise(pieces)), log
    for generation in generations:
        generation.cancel()


class OneAtATime(EngineWrapper):
    """A real engine that asks to be stepped one sequence at a time (as the llama.cpp engine does
    where a batch of a few costs more than as many single steps), recording its calls; its steps
    wait while `go` is clear."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        self.go = threading.Event()
        self.go.set()

    def step_group(self, running: int) -> int:
        return 1

    def prefill(self, slot, prompt, params):
        self.calls.append(("prefill", (slot,)))
        return self._engine.prefill(slot, prompt, params)

    def step(self, slots):
        assert self.go.wait(60), "the test never let the engine go on"
        self.calls.append(("step", tuple(slots)))
        return self._engine.step(slots)

    def release(self, slot):
        self.calls.append(("release", (slot,)))
        return self._engine.release(slot)


def test_an_engine_stepped_in_groups_advances_each_request_once_per_round(make):
    scheduler = make(wrap=OneAtATime)
    alone = [_tokens(scheduler.submit(p, GREEDY)) for p in PROMPTS]
    engine = scheduler.engine
    calls = engine.calls
    calls.clear()
    engine.go.clear()  # no request runs ahead before all four are in
    generations = [scheduler.submit(p, GREEDY) for p in PROMPTS]
    engine.go.set()
    assert [_tokens(g) for g in generations] == alone  # same answers, one sequence per step
    assert all(len(slots) == 1 for kind, slots in calls if kind == "step")
    # While all four run, every four consecutive steps advance four different requests.
    last_prefill = max(i for i, (kind, _) in enumerate(calls) if kind == "prefill")
    first_release = min(i for i, (kind, _) in enumerate(calls) if kind == "release")
    together = [slots[0] for _, slots in calls[last_prefill + 1 : first_release]]
    assert len(together) >= 8
    assert all(len(set(together[i : i + 4])) == 4 for i in range(len(together) - 3))


class PrefillRecorder(EngineWrapper):
    """A real engine recording the slots of each prefill round the scheduler hands it."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.rounds: list[list[int]] = []

    def prefill_many(self, items):
        self.rounds.append([slot for slot, *_ in items])
        return self._engine.prefill_many(items)


def test_an_idle_engine_waits_for_the_requests_on_their_way_and_starts_them_together(make):
    arrivals = Arrivals()
    # A wait this long ends only by the requests' coming (or the test's timeout).
    scheduler = make(wrap=PrefillRecorder, arrivals=arrivals, gather_s=600.0)
    alone = [_tokens(scheduler.submit(p, GREEDY)) for p in PROMPTS[:2]]  # none on their way: at once
    rounds = scheduler.engine.rounds
    assert [len(r) for r in rounds] == [1, 1]
    arrivals.coming()
    arrivals.coming()
    first = scheduler.submit(PROMPTS[0], GREEDY)
    arrivals.came()
    second = scheduler.submit(PROMPTS[1], GREEDY)
    arrivals.came()
    assert [_tokens(first), _tokens(second)] == alone
    assert [len(r) for r in rounds] == [1, 1, 2]  # both in one round


def test_an_idle_engine_waits_for_a_burst_as_big_as_the_last_one(make):
    arrivals = Arrivals()
    scheduler = make(wrap=PrefillRecorder, arrivals=arrivals, gather_s=600.0)
    rounds = scheduler.engine.rounds
    on_their_way = [arrivals.coming(), arrivals.coming()]  # a burst of two, gathered as above
    burst = []
    for prompt in PROMPTS[:2]:
        burst.append(scheduler.submit(prompt, GREEDY))
        arrivals.came()
    assert all(len(_tokens(g)) == 16 for g in burst) and [len(r) for r in rounds] == [2]
    assert len(on_their_way) == 2
    # Nothing is on its way now, but the last burst had two: the first of the next one waits
    # (600 s unless the second comes), the second starts with it.
    first = scheduler.submit(PROMPTS[2], GREEDY)
    assert not first.wait_started(0.3)
    second = scheduler.submit(PROMPTS[3], GREEDY)
    assert len(_tokens(first)) == 16 and len(_tokens(second)) == 16
    assert [len(r) for r in rounds] == [2, 2]


class HeldPrefill(EngineWrapper):
    """A real engine recording its prefills and steps; the first prefill waits for `let_go` (after
    setting `prefilling`)."""

    def __init__(self, engine, prefilling: threading.Event, let_go: threading.Event) -> None:
        self._engine, self._prefilling, self._let_go = engine, prefilling, let_go
        self.calls: list[tuple[str, int]] = []

    def prefill(self, slot, prompt, params):
        if not self.calls:
            self._prefilling.set()
            assert self._let_go.wait(60), "the test never let the prefill go"
        self.calls.append(("prefill", slot))
        return self._engine.prefill(slot, prompt, params)

    def step(self, slots):
        self.calls.append(("step", len(slots)))
        return self._engine.step(slots)


def test_a_request_waiting_after_a_prefill_gets_its_first_token_before_the_next_step(make):
    prefilling, let_go = threading.Event(), threading.Event()
    scheduler = make(wrap=lambda e: HeldPrefill(e, prefilling, let_go))
    first = scheduler.submit(PROMPTS[0], GREEDY)
    assert prefilling.wait(60)
    second = scheduler.submit(PROMPTS[1], GREEDY)  # waits: the engine thread is in the prefill
    let_go.set()
    assert len(_tokens(first)) == 16 and len(_tokens(second)) == 16
    calls = scheduler.engine.calls
    assert [kind for kind, _ in calls[:3]] == ["prefill", "prefill", "step"]
    assert calls[2] == ("step", 2)  # the first request's second token came with the second's


def test_the_queue_is_bounded_and_a_cancelled_request_frees_its_slot(make, wait_until):
    scheduler = make(queue_length=1, buffer_events=2)
    running = [scheduler.submit(p, LONG) for p in PROMPTS]
    for generation in running:
        generation.wait_started()
    waiting = scheduler.submit(PROMPTS[0], GREEDY)
    assert scheduler.counts() == SchedulerCounts(4, 1)
    with pytest.raises(Overloaded, match="4 running and 1 waiting") as info:
        scheduler.submit(PROMPTS[1], GREEDY)
    assert info.value.retry_after_s >= 1
    running[2].cancel()
    assert waiting.wait_started(60)  # it took the freed slot
    assert len(_tokens(waiting)) == 16
    for generation in running:
        generation.cancel()
    wait_until(lambda: scheduler.counts() == SchedulerCounts(0, 0), "every slot freed")


class HeldRelease(EngineWrapper):
    """A real engine whose `release` waits for `let_go` (after setting `releasing`)."""

    def __init__(self, engine, releasing: threading.Event, let_go: threading.Event) -> None:
        self._engine, self._releasing, self._let_go = engine, releasing, let_go

    def release(self, slot: int) -> None:
        self._releasing.set()
        assert self._let_go.wait(60), "the test never let the release go"
        self._engine.release(slot)


def test_a_request_ends_for_its_client_after_its_slot_is_free(make):
    # A client that sends its next request on the last event of the one before must find the slot
    # free (one slot and no queue would refuse it), so the last event waits for the release. Passing
    # never depends on timing; a last event handed over before the release is seen within 0.5 s.
    releasing, let_go, ended = threading.Event(), threading.Event(), threading.Event()
    scheduler = make(slots=1, queue_length=0, wrap=lambda e: HeldRelease(e, releasing, let_go))
    generation = scheduler.submit(PROMPTS[0], GREEDY)
    consumer = threading.Thread(target=lambda: (_tokens(generation), ended.set()))
    consumer.start()
    assert releasing.wait(60)
    assert not ended.wait(0.5)  # the slot is still being freed: the client has not had its end
    let_go.set()
    consumer.join(60)
    assert ended.is_set()
    assert len(_tokens(scheduler.submit(PROMPTS[1], GREEDY))) == 16  # admitted, not refused


def test_a_consumer_that_stops_reading_is_dropped_and_the_others_go_on(make, wait_until):
    scheduler = make(buffer_events=2, stall_timeout_s=0.2)
    stalled = scheduler.submit(PROMPTS[0], LONG)
    stalled.wait_started()
    reader = scheduler.submit(PROMPTS[1], SamplingParams(max_tokens=60, temperature=0.0))
    assert len(_tokens(reader)) == 60  # paused beside it, the stalled request held nobody up
    wait_until(lambda: scheduler.counts().running == 0, "the stalled request dropped")
    with pytest.raises(AgentError, match="the consumer read nothing"):
        _tokens(stalled)


def test_an_abandoned_generation_frees_its_slot(make, wait_until):
    scheduler = make(buffer_events=2)
    generation = scheduler.submit(PROMPTS[0], LONG)
    generation.wait_started()
    del generation
    gc.collect()
    wait_until(lambda: scheduler.counts() == SchedulerCounts(0, 0), "the abandoned slot freed")


def test_a_request_waiting_too_long_for_a_slot_times_out(make):
    scheduler = make(slots=1, queue_timeout_s=0.05, buffer_events=2)
    holder = scheduler.submit(PROMPTS[0], LONG)
    holder.wait_started()
    with pytest.raises(QueueTimeout, match="waited"):
        scheduler.submit(PROMPTS[1], GREEDY).wait_started()
    holder.cancel()


def test_asyncio_consumers_get_the_same_tokens(make):
    scheduler = make()
    expected = [_tokens(scheduler.submit(p, GREEDY)) for p in PROMPTS]

    async def consume(prompt):
        generation = scheduler.submit(prompt, GREEDY)
        await generation.await_started()
        return [event.token_id async for event in generation]

    async def main():
        return await asyncio.gather(*(consume(p) for p in PROMPTS))

    assert asyncio.run(main()) == expected


def test_a_cancelled_asyncio_task_gives_up_its_place(make, wait_until):
    scheduler = make(buffer_events=2)
    running = [scheduler.submit(p, LONG) for p in PROMPTS]  # every slot taken, paused
    for generation in running:
        generation.wait_started()

    async def main():
        waiting = scheduler.submit(PROMPTS[0], GREEDY)
        assert scheduler.counts() == SchedulerCounts(4, 1)
        # wait_for cancels the task blocked on its first event (as a server does when the client goes).
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(waiting.await_started(), timeout=0.05)

    asyncio.run(main())
    wait_until(lambda: scheduler.counts() == SchedulerCounts(4, 0), "the cancelled request left the queue")
    for generation in running:
        generation.cancel()


def test_cancel_all_ends_running_and_waiting_requests(make, wait_until):
    scheduler = make(slots=2, buffer_events=2)
    generations = [scheduler.submit(p, LONG) for p in PROMPTS[:3]]  # two run, one waits
    generations[0].wait_started()
    scheduler.cancel_all()
    assert all(g.cancelled for g in generations)
    wait_until(lambda: scheduler.counts() == SchedulerCounts(0, 0), "every request ended")
    assert all(len(_tokens(g)) < 200 for g in generations)


def test_closing_drains_then_runs_the_final_call_on_the_engine_thread(make):
    scheduler = make()
    generation = scheduler.submit(PROMPTS[0], GREEDY)
    threads = []
    scheduler.close(final=lambda: threads.append(threading.current_thread().name))
    with pytest.raises(EngineStopped, match="being unloaded"):
        scheduler.submit(PROMPTS[1], GREEDY)
    assert len(_tokens(generation)) == 16  # the request already in finished
    assert scheduler.join(60)
    assert threads == ["sits-engine"]
    with pytest.raises(EngineStopped):
        scheduler.run(lambda: None)


def _openmp_team_size() -> Callable[[], int]:
    """omp_get_max_threads of the OpenMP runtime torch loaded: the calling thread's team size."""
    import torch  # noqa: F401 (loads the runtime)

    maps = Path("/proc/self/maps").read_text().splitlines()
    library = next((line.split()[-1] for line in maps if "libgomp" in line), None)
    if library is None:
        pytest.skip("torch is not built with GNU OpenMP here")
    return ctypes.CDLL(library).omp_get_max_threads


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to tell one thread from all")
def test_torch_on_the_engine_thread_keeps_the_thread_count_it_was_loaded_with(tiny_model_dir):
    team_size = _openmp_team_size()
    scheduler = _scheduler("torch", tiny_model_dir)
    try:
        # The premise (the "4.5x slower on a handler thread"): torch.set_num_threads sets the calling
        # thread's OpenMP team size only; any other thread computes with one OpenMP thread per CPU.
        seen: list[int] = []
        other = threading.Thread(target=lambda: seen.append(team_size()))
        other.start()
        other.join()
        assert seen == [len(os.sched_getaffinity(0))]
        assert scheduler.run(team_size) == 1  # loaded on the engine thread with threads=1
    finally:
        _stop(scheduler)
