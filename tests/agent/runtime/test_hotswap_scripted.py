"""Hot swaps on scripted engines (tests/agent/scripted.py), in milliseconds: in-flight requests
drain on the old model, the side-by-side and unload-first orders, a load, warm-up or smoke test
that fails keeps the old model serving, unload-first restores it, and the readiness deadline and
smoke budget on a fake clock. test_hotswap.py runs swaps on the real engines."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from deployer.agent.runtime.hotswap import ModelManager, SwapResult, Unavailable
from deployer.agent.runtime.scheduler import Generation, SchedulerCounts
from deployer.agent.settings import AgentSettings, SmokePrompt
from deployer.agent.types import SamplingParams
from tests.agent.scripted import FakeClock, Gate, Reply, ScriptedEngine, ScriptedFault, encode

V1, V2 = Path("/nonexistent/v1"), Path("/nonexistent/v2")  # the scripted engine reads nothing
PARAMS = SamplingParams(max_tokens=32, temperature=0.0)


class Engines:
    """The factory a ModelManager calls: hands out the scripted engines given, in order, and keeps
    one shared log of their loads, warm-ups and unloads."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self._queue: list[ScriptedEngine] = []
        self.made: list[ScriptedEngine] = []

    def add(self, name: str, **script: object) -> ScriptedEngine:
        """Queue the next engine the factory returns."""
        engine = ScriptedEngine(name=name, log=self.log, **script)
        self._queue.append(engine)
        return engine

    def __call__(self) -> ScriptedEngine:
        engine = self._queue.pop(0)
        self.made.append(engine)
        return engine


@pytest.fixture
def engines() -> Engines:
    return Engines()


@pytest.fixture
def manager(engines: Engines) -> Iterator[Callable[..., ModelManager]]:
    """`manager(clock=None, **settings)`: a ModelManager on `engines`; shut down at teardown."""
    made: list[ModelManager] = []

    def make(clock: FakeClock | None = None, **overrides: object) -> ModelManager:
        settings = AgentSettings(
            **{"port": 0, "smoke_prompts": (SmokePrompt(prompt="Hi", max_tokens=4),), **overrides}
        )
        made.append(ModelManager(engines, settings, **({"clock": clock} if clock else {})))
        return made[-1]

    yield make
    for m in made:
        m.cancel_all()
        m.shutdown()


def _submit(manager: ModelManager, prompt: str) -> tuple[str, Generation]:
    """(the version it went to, its generation): a request as the server submits one."""
    with manager.lease() as served:
        return served.version, served.scheduler.submit(encode(prompt), PARAMS)


def _answer(manager: ModelManager, prompt: str = "q") -> tuple[str, str]:
    """(version, answer text) of one request on the active model."""
    version, generation = _submit(manager, prompt)
    return version, "".join(e.text for e in generation)


def _swap(manager: ModelManager, directory: Path, version: str) -> SwapResult:
    return manager.swap_to(directory, version)


def test_a_swap_loads_warms_and_smoke_tests_then_serves(engines, manager):
    v1 = engines.add("one", default=Reply(text="from one"))
    m = manager()
    result = _swap(m, V1, "v1")
    assert (result.ok, result.phase, result.active_version, len(result.smoke_ms)) == (True, "done", "v1", 1)
    assert engines.log == [("one", "load"), ("one", "warmup")]
    assert v1.loaded_from == V1
    assert v1.params[0] == SamplingParams(max_tokens=4, temperature=0.0)  # the smoke prompt, greedy
    assert _answer(m) == ("v1", "from one")


def test_side_by_side_drains_in_flight_requests_on_the_old_model(engines, manager):
    gate = Gate()
    old = engines.add("old", replies={"long": Reply(text="old answer", hold=gate)})
    new = engines.add("new", default=Reply(text="new answer"))
    m = manager(swap_policy="side-by-side")
    assert _swap(m, V1, "v1").ok
    version, in_flight = _submit(m, "long")
    gate.wait_reached()  # mid-generation on the old model
    result = _swap(m, V2, "v2")
    assert (result.ok, result.policy, result.previous_version) == (True, "side-by-side", "v1")
    # The new model loaded beside the old, which still holds its request: both count.
    assert engines.log == [("old", "load"), ("old", "warmup"), ("new", "load"), ("new", "warmup")]
    assert _answer(m) == ("v2", "new answer")
    assert m.counts() == SchedulerCounts(1, 0)
    assert not old.unloaded.is_set()
    gate.open()
    assert (version, "".join(e.text for e in in_flight)) == ("v1", "old answer")
    assert old.unloaded.wait(10)  # once drained, on its own thread
    assert engines.log[-1] == ("old", "unload") and not new.unloaded.is_set()
    assert (m.active_info().version, m.previous_info().version) == ("v2", "v1")


def test_unload_first_drains_and_unloads_the_old_model_before_loading_the_new(engines, manager):
    gate, unloading = Gate(), Gate()
    old = engines.add(
        "old", replies={"long": Reply(text="old answer", hold=gate)}, holds={"unload": unloading}
    )
    engines.add("new", default=Reply(text="new answer"))
    m = manager(swap_policy="unload-first")
    assert _swap(m, V1, "v1").ok
    _, in_flight = _submit(m, "long")
    gate.wait_reached()
    results: list[SwapResult] = []
    swap = threading.Thread(target=lambda: results.append(_swap(m, V2, "v2")))
    swap.start()
    try:
        gate.open()
        assert "".join(e.text for e in in_flight) == "old answer"  # the in-flight request finished
        unloading.wait_reached()  # then the drained model unloads, and the gap is open
        with pytest.raises(Unavailable, match="unload-first") as gap:
            _answer(m)
        assert gap.value.retry_after_s >= 1
        assert len(engines.made) == 1  # the new model is not even made yet
    finally:
        unloading.open()
        swap.join(10)
    (result,) = results
    assert (result.ok, result.policy, result.active_version) == (True, "unload-first", "v2")
    assert engines.log[2:] == [("old", "unload"), ("new", "load"), ("new", "warmup")]
    assert old.unloaded.is_set()
    assert _answer(m) == ("v2", "new answer")


@pytest.mark.parametrize(
    ("phase", "script", "reason"),
    [
        ("load", {"load_error": ScriptedFault("bad weights")}, "load failed: ScriptedFault: bad weights"),
        ("warmup", {"warmup_error": ScriptedFault("no memory")}, "warmup failed: ScriptedFault: no memory"),
        (
            "smoke",
            {"replies": {"Hi": Reply(error=ScriptedFault("kernel crash"), error_at=2)}},
            "smoke failed: ScriptedFault: kernel crash",
        ),
        ("smoke", {"replies": {"Hi": Reply(text="nonsense")}}, "answered 'nonsense', no 'hello'"),
    ],
)
def test_a_failing_new_model_keeps_the_old_one_serving(engines, manager, phase, script, reason):
    engines.add("old", default=Reply(text="hello from old"))
    broken = engines.add("new", **script)
    m = manager(smoke_prompts=(SmokePrompt(prompt="Hi", max_tokens=16, expect="hello"),))
    assert _swap(m, V1, "v1").ok
    result = _swap(m, V2, "v2")
    assert (result.ok, result.phase, result.active_version, result.previous_version) == (
        False,
        phase,
        "v1",
        "v1",
    )
    assert reason in result.reason
    assert _answer(m) == ("v1", "hello from old")
    assert broken.unloaded.wait(10)  # the failed engine is freed on its own thread


def test_unload_first_restores_the_old_model_when_the_new_one_fails(engines, manager):
    engines.add("old", default=Reply(text="old answer"))
    engines.add("new", load_error=ScriptedFault("bad weights"))
    restored = engines.add("old again", default=Reply(text="old answer, reloaded"))
    m = manager(swap_policy="unload-first")
    assert _swap(m, V1, "v1").ok
    result = _swap(m, V2, "v2")
    assert (result.ok, result.phase, result.restored, result.active_version) == (False, "load", True, "v1")
    assert restored.loaded_from == V1  # the old version's artifact, loaded again
    assert engines.log[2:] == [
        ("old", "unload"),
        ("new", "load"),
        ("new", "unload"),  # what the failed load left is freed before the old one comes back
        ("old again", "load"),
        ("old again", "warmup"),
    ]
    assert _answer(m) == ("v1", "old answer, reloaded")


def test_unload_first_frees_a_failed_model_before_it_restores_the_old_one(engines, manager):
    # Memory holds one model under unload-first: a new model that loaded fully and then failed its
    # smoke test must be gone before the old one loads again. Its unload (on its engine thread)
    # is held here: the swap waits for it. Passing never depends on timing; a restore that does
    # not wait is seen within 0.1 s.
    unloading = Gate()
    engines.add("old")
    engines.add("new", replies={"Hi": Reply(text="nonsense")}, holds={"unload": unloading})
    engines.add("old again")
    m = manager(swap_policy="unload-first", smoke_prompts=(SmokePrompt(prompt="Hi", expect="ok"),))
    assert _swap(m, V1, "v1").ok
    results: list[SwapResult] = []
    swap = threading.Thread(target=lambda: results.append(_swap(m, V2, "v2")))
    swap.start()
    unloading.wait_reached()
    swap.join(0.1)
    assert swap.is_alive() and len(engines.made) == 2  # the restore waits for the failed one's unload
    unloading.open()
    swap.join(10)
    (result,) = results
    assert (result.ok, result.phase, result.restored, result.active_version) == (False, "smoke", True, "v1")
    assert engines.log[-3:] == [("new", "unload"), ("old again", "load"), ("old again", "warmup")]


def test_unload_first_with_nothing_to_restore_leaves_no_model(engines, manager):
    engines.add("old")
    engines.add("new", load_error=ScriptedFault("bad weights"))
    engines.add("old again", warmup_error=ScriptedFault("the old one fails too"))
    m = manager(swap_policy="unload-first")
    assert _swap(m, V1, "v1").ok
    result = _swap(m, V2, "v2")
    assert (result.ok, result.restored, result.active_version) == (False, False, None)
    assert not m.ready
    with pytest.raises(Unavailable, match="the last load failed"):
        _answer(m)


def test_a_model_not_ready_within_the_readiness_timeout_is_refused(engines, manager):
    clock = FakeClock()
    engines.add("slow", clock=clock, takes={"load": 100.0, "warmup": 30.0})
    m = manager(clock=clock, readiness_timeout_s=120.0)
    result = _swap(m, V1, "v1")
    assert (result.ok, result.phase) == (False, "warmup")
    assert "not ready after 130.0 s (readiness_timeout_s 120.0)" in result.reason
    assert result.duration_s == 130.0
    assert not m.ready


def test_a_smoke_prompt_over_the_latency_budget_is_refused(engines, manager):
    clock = FakeClock()
    engines.add("slow", clock=clock, takes={"step": 0.5}, default=Reply(text="abc"))
    m = manager(clock=clock, latency_budget_ms=1000)
    result = _swap(m, V1, "v1")  # "abc" and its end: three steps after the prefill, 1.5 s
    assert (result.ok, result.phase) == (False, "smoke")
    assert "took 1500 ms > budget 1000 ms" in result.reason
    engines.add("quick", clock=clock, takes={"step": 0.25}, default=Reply(text="abc"))
    result = _swap(m, V1, "v1")
    assert (result.ok, result.smoke_ms) == (True, (750.0,))
