"""The adapters of a served model (runtime/adapters.py) on the tiny model's torch engine: a reload
lets running requests finish on their version, and the memory budget unloads the least recently
used adapter, which the next request naming it loads again. Real PEFT adapters."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from deployer.agent.engines.torch.engine import TorchEngine
from deployer.agent.ota.adapters import AdapterStore
from deployer.agent.runtime.adapters import (
    CRASH_LOOP_LOADS,
    AdapterSet,
    AdapterSource,
    OtherBase,
    adapter_memory_bytes,
)
from deployer.agent.runtime.scheduler import Scheduler, SchedulerLimits
from deployer.agent.types import SamplingParams
from deployer.core.lora import from_peft, read_adapter, write_adapter
from deployer.errors import AgentError
from tests.agent.engines.torch.steps import PROMPTS
from tests.agent.lora_helpers import make_peft_adapter

GREEDY = SamplingParams(max_tokens=24, temperature=0)


@pytest.fixture(scope="module")
def artifacts(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name, version, seed in (("a", "1", 1), ("a", "2", 3), ("b", "1", 2)):
        peft = make_peft_adapter(tiny_model_dir, tmp_path_factory.mktemp("peft"), seed=seed, b_std=0.3)
        out[f"{name}{version}"] = artifact = tmp_path_factory.mktemp(f"{name}{version}")
        write_adapter(from_peft(peft, name, version, "tiny-base"), artifact)
    return out


@pytest.fixture
def scheduler(tiny_model_dir: Path) -> Iterator[Scheduler]:
    engine = TorchEngine(device="cpu", threads=1, slots=4)
    # One event buffered per consumer: a request that is not read pauses (stays running).
    scheduler = Scheduler(engine, SchedulerLimits(batch_size=4, buffer_events=1))
    scheduler.run(lambda: engine.load(tiny_model_dir))
    yield scheduler
    scheduler.close(final=engine.unload)
    scheduler.join(30)


def adapter_set(scheduler: Scheduler, root: Path, budget: int = 2**30) -> AdapterSet:
    return AdapterSet(scheduler, AdapterSource(AdapterStore(root), lambda version: None, budget), "v1")


def generate(scheduler: Scheduler, adapters: AdapterSet, name: str) -> list[int]:
    prompt = scheduler.engine.encode(PROMPTS[0])
    with adapters.use(name) as adapter:
        assert adapter is not None
        generation = scheduler.submit(prompt, replace(GREEDY, adapter=adapter.key))
    return [event.token_id for event in generation if event.token_id is not None]


def engine_keys(scheduler: Scheduler) -> str:
    """The adapters loaded on the engine, after every engine call queued so far has run."""
    scheduler.run(lambda: None)  # a tick after now: what run_when_unused released has run by the next
    return scheduler.run(lambda: scheduler.engine.describe().extra["adapters"])


def test_a_reload_lets_a_running_request_finish_on_its_version(
    scheduler: Scheduler, artifacts: dict[str, Path], tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path)
    store.install("a", artifacts["a1"], "a1-id", "1", 1)
    adapters = adapter_set(scheduler, tmp_path)
    adapters.reload("a")
    v1 = generate(scheduler, adapters, "a")
    prompt = scheduler.engine.encode(PROMPTS[0])
    with adapters.use("a") as adapter:
        assert adapter is not None
        running = scheduler.submit(prompt, replace(GREEDY, adapter=adapter.key))
    first = next(running)  # it holds a slot now, paused on its full buffer
    store.install("a", artifacts["a2"], "a2-id", "2", 2)
    assert adapters.reload("a") is not None and adapters.get("a").version == "2"  # type: ignore[union-attr]
    assert engine_keys(scheduler).count("a@") == 2  # the old version stays for the running request
    tokens = [first.token_id, *(e.token_id for e in running if e.token_id is not None)]
    assert tokens == v1
    assert engine_keys(scheduler).count("a@") == 1  # unloaded once its last request ended
    assert generate(scheduler, adapters, "a") != v1


def test_the_budget_unloads_the_least_recently_used_and_a_request_loads_it_again(
    scheduler: Scheduler, artifacts: dict[str, Path], tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path)
    store.install("a", artifacts["a1"], "a1-id", "1", 1)
    store.install("b", artifacts["b1"], "b1-id", "1", 1)
    one = adapter_memory_bytes(read_adapter(artifacts["a1"]))
    adapters = adapter_set(scheduler, tmp_path, budget=one + one // 2)  # room for one adapter
    adapters.reload("a")
    alone = generate(scheduler, adapters, "a")
    adapters.reload("b")
    assert [(a.name, loaded) for a, loaded in adapters.known()] == [("a", False), ("b", True)]
    assert engine_keys(scheduler).count("@") == 1
    assert generate(scheduler, adapters, "a") == alone  # loaded again, b unloaded for it
    assert [(a.name, loaded) for a, loaded in adapters.known()] == [("a", True), ("b", False)]
    assert adapters.nbytes() <= one + one // 2


def test_an_adapter_above_the_whole_budget_is_refused(
    scheduler: Scheduler, artifacts: dict[str, Path], tmp_path: Path
) -> None:
    AdapterStore(tmp_path).install("a", artifacts["a1"], "a1-id", "1", 1)
    adapters = adapter_set(scheduler, tmp_path, budget=1024)
    with pytest.raises(AgentError, match="adapter_memory_mb"):
        adapters.reload("a")
    assert adapters.known() == [] and engine_keys(scheduler) == "-"


def test_an_adapter_for_another_base_is_refused(
    scheduler: Scheduler, artifacts: dict[str, Path], tmp_path: Path
) -> None:
    AdapterStore(tmp_path).install("a", artifacts["a1"], "a1-id", "1", 1)
    AdapterStore(tmp_path).install("a", artifacts["a2"], "a2-id", "2", 2)
    source = AdapterSource(AdapterStore(tmp_path), lambda version: "another-base", 2**30)
    adapters = AdapterSet(scheduler, source, "v1")
    with pytest.raises(OtherBase, match="made for base artifact tiny-base"):
        adapters.reload("a")
    adapters.load_installed()  # after a base update: skipped, and not rolled back
    assert AdapterStore(tmp_path).state("a").version == "2"
    assert adapters.known() == [] and engine_keys(scheduler) == "-"


# A process whose engine dies while loading any adapter (as a native crash or an OOM kill would):
# its AdapterSet loads the store's installed adapters, as the agent does at start-up.
_DIES_LOADING = """
import os, signal, sys
from pathlib import Path
from deployer.agent.ota.adapters import AdapterStore
from deployer.agent.runtime.adapters import AdapterSet, AdapterSource
from deployer.agent.runtime.scheduler import Scheduler, SchedulerLimits
from tests.agent.scripted import ScriptedEngine

class DiesLoadingAdapters(ScriptedEngine):
    serves_adapters = True

    def load_adapter(self, key, adapter, directory):
        os.kill(os.getpid(), signal.SIGKILL)

source = AdapterSource(AdapterStore(Path(sys.argv[1])), lambda version: None, 2**30)
AdapterSet(Scheduler(DiesLoadingAdapters(), SchedulerLimits()), source, "v1").load_installed()
"""


def _start_and_die(root: Path) -> None:
    died = subprocess.run([sys.executable, "-c", _DIES_LOADING, str(root)], check=False, timeout=120)
    assert died.returncode == -signal.SIGKILL


def test_an_adapter_that_kills_the_agent_twice_while_loading_is_rolled_back_at_the_next_start(
    scheduler: Scheduler, artifacts: dict[str, Path], tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path)
    store.install("a", artifacts["a1"], "a1-id", "1", 1)
    store.install("a", artifacts["a2"], "a2-id", "2", 2)
    for _ in range(CRASH_LOOP_LOADS):
        _start_and_die(tmp_path)
    assert store.crashed_loads("a", "a2-id") == CRASH_LOOP_LOADS
    adapters = adapter_set(scheduler, tmp_path)
    adapters.load_installed()  # the next start-up
    assert adapters.get("a").version == "1"  # type: ignore[union-attr]
    assert (store.state("a").version, store.state("a").counter) == ("1", 2)  # the counter stays
    assert store.crashed_loads("a", "a1-id") == 0  # the version restored loaded: its load ended
    assert generate(scheduler, adapters, "a")  # the engine serves, the restored adapter too
    store.rollback("a")  # back to the version that crashed: refused, the one loaded stays
    with pytest.raises(AgentError, match="died 2 times while loading"):
        adapters.reload("a")
    assert adapters.get("a").version == "1"  # type: ignore[union-attr]


def test_one_death_while_loading_an_adapter_is_retried_not_rolled_back(
    scheduler: Scheduler, artifacts: dict[str, Path], tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path)
    store.install("a", artifacts["a1"], "a1-id", "1", 1)
    store.install("a", artifacts["a2"], "a2-id", "2", 2)
    _start_and_die(tmp_path)  # e.g. a power cut mid-load
    adapters = adapter_set(scheduler, tmp_path)
    adapters.load_installed()
    assert adapters.get("a").version == "2" and store.state("a").version == "2"  # type: ignore[union-attr]
    assert store.crashed_loads("a", "a2-id") == 0
