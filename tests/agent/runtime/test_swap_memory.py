"""swap_policy auto on a real (tiny) int4 artifact: the agent counts the new model's load as
validate's estimate counts it (weights, the torch engine's int8 head, KV cache, draft, engine
overhead), and swaps unload-first exactly where that does not fit in the available memory.

The available memory is faked: the machine's MemAvailable is whatever the other processes leave
(GBs above a tiny model's need, and changing), so only a figure the test sets can sit one byte
either side of the need."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from deployer.agent.runtime.hotswap import ModelManager, SwapResult, Unavailable, load_need_bytes
from deployer.agent.settings import AgentSettings, SmokePrompt
from deployer.build.pipeline import build_artifact
from deployer.build.spec import BuildRequest, QuantSpec
from deployer.config import estimate
from deployer.config.models import AgentSettings as DeployAgentSettings
from deployer.config.models import ModelSpec, Quantization
from deployer.core.gguf_io import GGUF_FILE, read_gguf_header
from deployer.core.memory import ModelShape, engine_bytes, kv_bytes_per_position
from tests.agent.engines.llamacpp.conftest import build_gguf
from tests.agent.scripted import Gate, Reply, ScriptedEngine


@pytest.fixture(scope="module")
def int4_artifact(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    store = tmp_path_factory.mktemp("store")
    request = BuildRequest(tiny_model_dir, "tiny", "1.0.0", QuantSpec("int4", 32), store)
    return build_artifact(request).artifact_dir


def _settings(**overrides: object) -> AgentSettings:
    base = {"port": 0, "smoke_prompts": (SmokePrompt(prompt="Hi", max_tokens=4),), "max_prompt_tokens": 64}
    return AgentSettings(**{**base, **overrides})


def test_the_agent_counts_what_validate_estimates(int4_artifact: Path) -> None:
    shape = ModelShape.from_config_json(int4_artifact / "config.json")
    need = load_need_bytes(int4_artifact, _settings(max_concurrent=4, context_length=2048))
    model = ModelSpec(
        name="tiny", version="1.0.0", source=".", quantization=Quantization(scheme="int4", group_size=32)
    )
    foreseen = estimate.estimate_memory(
        shape, model, DeployAgentSettings(max_concurrent=4, max_tokens=2048, swap_policy="unload-first")
    )
    assert need is not None
    # The same terms; only the weights differ: the files' bytes here, the scheme's arithmetic there.
    weights = sum(p.stat().st_size for p in int4_artifact.glob("*.safetensors"))
    assert abs(need - foreseen.total) <= abs(weights - estimate.weight_bytes(shape, model.quantization))
    # The KV cache grows with slots x context (the old rule, 1.5 x the artifact, ignored it).
    longer = load_need_bytes(int4_artifact, _settings(max_concurrent=4, context_length=4096))
    assert longer == need + 4 * 2048 * kv_bytes_per_position(shape, "torch")
    drafted = load_need_bytes(int4_artifact, _settings(max_concurrent=4, context_length=2048, draft="int4"))
    assert drafted == need + estimate.draft_bytes(shape, 2048 * kv_bytes_per_position(shape, "torch"))


def test_a_gguf_artifact_is_counted_from_its_header(tiny_model_dir: Path, tmp_path: Path) -> None:
    artifact = build_gguf(tiny_model_dir, tmp_path / "store")  # no config.json beside the GGUF
    shape = ModelShape.from_gguf(read_gguf_header(artifact / GGUF_FILE))
    assert shape == ModelShape.from_config_json(tiny_model_dir / "config.json")
    need = load_need_bytes(artifact, _settings(engine="llama.cpp", max_concurrent=2, context_length=512))
    kv_cache = 2 * 512 * kv_bytes_per_position(shape, "llama.cpp")  # fp16 K and V
    assert need == (artifact / GGUF_FILE).stat().st_size + kv_cache + engine_bytes(
        shape, "llama.cpp", kv_cache
    )


def test_an_unreadable_artifact_has_no_need(tmp_path: Path) -> None:
    assert load_need_bytes(tmp_path, _settings()) is None


@pytest.fixture
def managers() -> Iterator[list[ModelManager]]:
    made: list[ModelManager] = []
    yield made
    for m in made:
        m.cancel_all()
        m.shutdown()


@pytest.mark.parametrize(("spare", "policy"), [(0, "side-by-side"), (-1, "unload-first")])
def test_auto_swaps_unload_first_exactly_where_the_new_model_does_not_fit(
    int4_artifact: Path, managers: list[ModelManager], spare: int, policy: str
) -> None:
    settings = _settings(max_concurrent=2, context_length=1024)
    need = load_need_bytes(int4_artifact, settings)
    assert need is not None
    loading = Gate()
    engines = iter(
        [
            ScriptedEngine(name="old", default=Reply(text="old")),
            ScriptedEngine(name="new", holds={"load": loading}),
        ]
    )
    manager = ModelManager(lambda: next(engines), settings, available_memory=lambda: need + spare)
    managers.append(manager)
    first = manager.swap_to(int4_artifact, "v1")
    assert (first.ok, first.policy) == (True, "side-by-side")  # nothing loaded yet: nothing to unload
    results: list[SwapResult] = []
    swap = threading.Thread(target=lambda: results.append(manager.swap_to(int4_artifact, "v2")))
    swap.start()
    try:
        loading.wait_reached()  # the new model is loading
        if policy == "unload-first":  # the old one is gone: 503 + Retry-After until the new one serves
            with pytest.raises(Unavailable) as gap, manager.lease():
                pass
            assert gap.value.retry_after_s >= 1
        else:  # the old one still serves beside it
            with manager.lease() as served:
                assert served.version == "v1"
    finally:
        loading.open()
        swap.join(10)
    (second,) = results
    assert (second.ok, second.policy, second.active_version) == (True, policy, "v2")


def test_auto_without_a_memory_figure_swaps_side_by_side(
    int4_artifact: Path, managers: list[ModelManager]
) -> None:
    engines = iter([ScriptedEngine(name=n, default=Reply(text=n)) for n in ("old", "new")])
    manager = ModelManager(lambda: next(engines), _settings(), available_memory=lambda: None)
    managers.append(manager)
    assert manager.swap_to(int4_artifact, "v1").ok
    assert manager.swap_to(int4_artifact, "v2").policy == "side-by-side"
