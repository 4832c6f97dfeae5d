"""The scheduler on a scripted engine (tests/agent/scripted.py), in milliseconds: admission and the
bounded queue, cancellation, a stalled step and a stalled consumer, failures of one sequence or of
a whole step, step groups. test_scheduler.py runs the same machinery on the real engines."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from deployer.agent.runtime.scheduler import (
    Generation,
    Overloaded,
    QueueTimeout,
    Scheduler,
    SchedulerCounts,
    SchedulerLimits,
)
from deployer.agent.types import SamplingParams
from deployer.errors import AgentError
from tests.agent.scripted import Gate, Reply, ScriptedEngine, ScriptedFault, decode, encode

PARAMS = SamplingParams(max_tokens=32, temperature=0.0)
ARTIFACT = Path("/nonexistent/scripted")  # the scripted engine reads nothing

MakeScheduler = Callable[..., Scheduler]


@pytest.fixture
def make() -> Iterator[MakeScheduler]:
    """`make(engine, **limits)`: a scheduler over the loaded `engine` (batch: all its slots);
    closed at teardown, and checked to have stopped."""
    made: list[Scheduler] = []

    def start(engine: ScriptedEngine, **limits: object) -> Scheduler:
        scheduler = Scheduler(engine, SchedulerLimits(**{"batch_size": engine.max_slots, **limits}))
        scheduler.run(lambda: engine.load(ARTIFACT))
        made.append(scheduler)
        return scheduler

    yield start
    for scheduler in made:
        scheduler.cancel_all()
        scheduler.close()
        assert scheduler.join(10)


def _submit(scheduler: Scheduler, prompt: str, params: SamplingParams = PARAMS) -> Generation:
    return scheduler.submit(encode(prompt), params)


def _text(generation: Generation) -> tuple[str, str | None]:
    """(the answer's text, its finish reason), read to the end."""
    events = list(generation)
    return "".join(e.text for e in events), events[-1].finish_reason if events else None


def _one_batch(
    scheduler: Scheduler, engine: ScriptedEngine, prompts: str, params: SamplingParams = PARAMS
) -> list[Generation]:
    """Submit one request per character of `prompts` so that they all run in one batch: the first's
    prefill waits until the others are queued, and they join before the next step."""
    gate = Gate()
    engine.hold_next_prefill(gate)
    first = _submit(scheduler, prompts[0], params)
    gate.wait_reached()
    others = [_submit(scheduler, p, params) for p in prompts[1:]]
    gate.open()
    return [first, *others]


def _steps(engine: ScriptedEngine) -> list[tuple[int, ...]]:
    return [slots for kind, slots in engine.calls if kind == "step"]


def test_requests_get_their_own_scripted_answers_in_one_batch(make):
    replies = {p: Reply(text=f"answer to {p}") for p in "abc"}
    engine = ScriptedEngine(replies)
    scheduler = make(engine)
    generations = _one_batch(scheduler, engine, "abc")
    assert [_text(g) for g in generations] == [(f"answer to {p}", "stop") for p in "abc"]
    assert _steps(engine)[0] == (0, 1, 2)  # the three ran together from the first step
    assert scheduler.counts() == SchedulerCounts(0, 0)


def test_the_budget_ends_an_answer_without_an_end(make):
    scheduler = make(ScriptedEngine(default=Reply(text="go", end=False)))
    generation = _submit(scheduler, "x", SamplingParams(max_tokens=5, temperature=0.0))
    assert _text(generation) == ("go...", "length")


def test_logprobs_reach_the_events_when_asked(make):
    engine = ScriptedEngine(default=Reply(text="ab", probability=0.25))
    scheduler = make(engine)
    events = list(_submit(scheduler, "x", SamplingParams(max_tokens=8, logprobs=1)))
    scored = [e.logprobs.chosen for e in events if e.logprobs is not None]
    assert [(lp.token, round(lp.logprob, 6)) for lp in scored] == [(b"a", -1.386294), (b"b", -1.386294)]
    assert all(e.logprobs is None for e in _submit(scheduler, "x"))


def test_admission_fills_the_batch_then_the_queue_then_refuses(make):
    gate = Gate()
    engine = ScriptedEngine(default=Reply(text="held", hold=gate), slots=2)
    scheduler = make(engine, queue_length=1)
    running = _one_batch(scheduler, engine, "ab")
    gate.wait_reached()  # both in the batch, its first step held
    waiting = _submit(scheduler, "c")
    assert scheduler.counts() == SchedulerCounts(2, 1)
    with pytest.raises(Overloaded, match="2 running and 1 waiting") as refused:
        _submit(scheduler, "d")
    assert refused.value.retry_after_s >= 1
    gate.open()
    assert [_text(g) for g in (*running, waiting)] == [("held", "stop")] * 3
    assert scheduler.counts() == SchedulerCounts(0, 0)


def test_a_request_that_waits_past_queue_timeout_is_refused_with_queue_timeout(make):
    # The holder's consumer reads nothing (its buffer of one is full), so its slot stays taken while
    # the engine thread is free to notice the newcomer's deadline.
    scheduler = make(ScriptedEngine(default=Reply(end=False), slots=1), queue_timeout_s=0.01, buffer_events=1)
    holder = _submit(scheduler, "a", SamplingParams(max_tokens=100))
    assert holder.wait_started(10)
    late = _submit(scheduler, "b")
    with pytest.raises(QueueTimeout, match="waited 0 s for a free slot"):
        late.wait_started(10)
    assert scheduler.counts() == SchedulerCounts(1, 0)
    assert _text(holder) == ("ok" + "." * 98, "length")  # reading again, it goes on to its end


def test_a_cancelled_request_frees_its_slot_at_the_next_step(make):
    gate = Gate()
    engine = ScriptedEngine({"a": Reply(text="long answer", hold=gate)}, slots=1)
    scheduler = make(engine, queue_length=1)
    first = _submit(scheduler, "a")
    gate.wait_reached()  # mid-step
    second = _submit(scheduler, "b")
    first.cancel()
    assert scheduler.counts() == SchedulerCounts(1, 1)  # nothing is freed in the middle of a step
    gate.open()
    assert _text(second) == ("ok", "stop")
    assert list(first) == []  # a cancelled generation gives nothing more, not even what was pushed
    # The held step finished, the slot was released, and only then did the second request start.
    assert engine.calls[:4] == [("prefill", (0,)), ("step", (0,)), ("release", (0,)), ("prefill", (0,))]


def test_a_stalled_step_queues_newcomers_and_lets_a_waiting_one_leave(make):
    gate = Gate()
    engine = ScriptedEngine({"a": Reply(text="slow", hold=gate)}, slots=2)
    scheduler = make(engine, queue_length=2)
    held = _submit(scheduler, "a")
    gate.wait_reached()  # the engine thread is stuck in a step
    newcomers = [_submit(scheduler, p) for p in "bcd"]
    # Nothing is admitted during the step: the free slot counts toward what may wait.
    assert scheduler.counts() == SchedulerCounts(1, 3)
    with pytest.raises(Overloaded):
        _submit(scheduler, "e")
    newcomers[1].cancel()
    gate.open()
    assert _text(held) == ("slow", "stop")
    assert [_text(g) for g in (newcomers[0], newcomers[2])] == [("ok", "stop")] * 2
    assert list(newcomers[1]) == []
    assert len([c for c in engine.calls if c[0] == "prefill"]) == 3  # the cancelled one never started


def test_a_consumer_that_stops_reading_is_dropped_and_the_others_go_on(make, wait_until):
    engine = ScriptedEngine({"s": Reply(end=False), "r": Reply(text="x" * 20)})
    scheduler = make(engine, buffer_events=1, stall_timeout_s=0.05)
    stalled, reader = _one_batch(scheduler, engine, "sr", SamplingParams(max_tokens=100))
    assert _text(reader) == ("x" * 20, "stop")  # paused beside it, the stalled one held nobody up
    wait_until(lambda: scheduler.counts().running == 0, "the stalled request dropped")
    with pytest.raises(AgentError, match="the consumer read nothing for 0 s"):
        _text(stalled)
    assert ("release", (0,)) in engine.calls


def test_a_sequence_that_fails_in_a_step_fails_alone(make):
    fault = ScriptedFault("its grammar allows no token")
    replies = {"b": Reply(text="abcdef", error=fault, error_at=3), "g": Reply(text="fine answer")}
    engine = ScriptedEngine(replies)
    scheduler = make(engine)
    bad, *good = _one_batch(scheduler, engine, "bgg")
    written = []
    with pytest.raises(ScriptedFault, match="allows no token"):
        for event in bad:
            written.append(event.text)
    assert "".join(written) == "abc"
    assert [_text(g) for g in good] == [("fine answer", "stop")] * 2
    assert _steps(engine)[2] == (0, 1, 2)  # it failed in the batch, beside the others
    assert (0,) not in _steps(engine)[3:] and (1, 2) in _steps(engine)  # the others went on alone
    assert scheduler.counts() == SchedulerCounts(0, 0)


def test_a_sequence_that_fails_its_prefill_fails_alone(make):
    engine = ScriptedEngine({"b": Reply(error=MemoryError("no room for this prompt"), error_at=0)})
    scheduler = make(engine)
    bad, good = _one_batch(scheduler, engine, "bg")
    with pytest.raises(MemoryError, match="no room"):
        bad.wait_started(10)
    assert _text(good) == ("ok", "stop")
    assert ("release", (0,)) in engine.calls


def test_a_failed_step_ends_every_request_in_it_and_the_scheduler_goes_on(make):
    gate = Gate()
    engine = ScriptedEngine(default=Reply(text="abc", hold=gate))
    scheduler = make(engine)
    generations = _one_batch(scheduler, engine, "abc")
    gate.wait_reached()
    engine.fail_steps(RuntimeError("the forward pass failed"))
    gate.open()
    for generation in generations:
        with pytest.raises(RuntimeError, match="the forward pass failed"):
            _text(generation)
    assert sorted(slots for kind, slots in engine.calls if kind == "release") == [(0,), (1,), (2,)]
    assert _text(_submit(scheduler, "d")) == ("abc", "stop")  # the engine thread lives on


def test_an_engine_stepped_in_groups_advances_each_request_once_per_round(make):
    engine = ScriptedEngine({p: Reply(text=p * 6) for p in "abc"}, group=1)
    scheduler = make(engine)
    generations = _one_batch(scheduler, engine, "abc")
    assert [_text(g) for g in generations] == [(p * 6, "stop") for p in "abc"]
    steps = _steps(engine)
    assert all(len(slots) == 1 for slots in steps)
    # All three ran to their end (6 tokens and EOS each) side by side: 18 single steps, each
    # consecutive three advancing three different requests.
    assert len(steps) == 18
    assert all(len(set(steps[i : i + 3])) == 3 for i in range(0, 16))


def test_the_vocabulary_round_trips():
    assert decode(encode("héllo\n")) == "héllo\n"
    assert [Reply("ab", end=False).token(n) for n in range(4)] == encode("ab..")
