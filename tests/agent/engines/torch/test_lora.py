"""LoRA adapters on the torch engine: loaded beside the base, batched across adapters, and equal to
the merged model (engines/torch/lora.py). The adapters are real PEFT adapters of the tiny model."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from deployer.agent.engines.torch.engine import TorchEngine
from deployer.agent.types import SamplingParams
from deployer.core.lora import LoraAdapter, from_peft
from deployer.errors import AgentError
from tests.agent.engines.torch.steps import PROMPTS
from tests.agent.lora_helpers import make_peft_adapter
from tests.checkpoints import TOKENIZER_FILES

GREEDY = SamplingParams(max_tokens=24, temperature=0)
N = 16


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[LoraAdapter]:
    """Two adapters: rank 4 on q/v, and rank 8 on q/k/v/o and the MLP (every fused part)."""
    qv = make_peft_adapter(tiny_model_dir, tmp_path_factory.mktemp("peft-qv"), seed=1, b_std=0.2)
    every = make_peft_adapter(
        tiny_model_dir,
        tmp_path_factory.mktemp("peft-all"),
        seed=2,
        rank=8,
        alpha=8,
        targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        b_std=0.2,
    )
    return [from_peft(qv, "qv", "1", "base"), from_peft(every, "every", "1", "base")]


def merged(model_dir: Path, adapter: LoraAdapter, dest: Path) -> Path:
    """The checkpoint with the adapter merged in fp32: W + factor * B @ A."""
    dest.mkdir()
    for name in (*TOKENIZER_FILES, "config.json"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, dest / name)
    state = load_file(str(model_dir / "model.safetensors"))
    for module, (a, b) in adapter.tensors.items():
        delta = torch.from_numpy(b).float() @ torch.from_numpy(a).float()
        state[f"{module}.weight"] = state[f"{module}.weight"] + adapter.factor * delta
    save_file(state, str(dest / "model.safetensors"))
    return dest


def engine_on(model_dir: Path) -> TorchEngine:
    engine = TorchEngine(device="cpu", threads=1, slots=4)
    engine.load(model_dir)
    return engine


def generate(engine: TorchEngine, slot: int, prompt: list[int], params: SamplingParams) -> list[int]:
    tokens = [engine.prefill(slot, prompt, params)]
    tokens += [engine.step([slot])[0] for _ in range(N - 1)]  # type: ignore[misc]
    engine.release(slot)
    return tokens  # type: ignore[return-value]


def batched(engine: TorchEngine, jobs: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    """Every job in its own slot, prefilled together and stepped as one batch."""
    items = [(slot, prompt, params) for slot, (prompt, params) in enumerate(jobs)]
    out = [[t] for t in engine.prefill_many(items)]
    slots = list(range(len(jobs)))
    for _ in range(N - 1):
        for row, token in zip(out, engine.step(slots), strict=True):
            row.append(token)
    for slot in slots:
        engine.release(slot)
    return out  # type: ignore[return-value]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, adapters: list[LoraAdapter]) -> TorchEngine:
    engine = engine_on(tiny_model_dir)
    for adapter in adapters:
        engine.load_adapter(f"{adapter.name}#1", adapter, Path())
    return engine


@pytest.mark.parametrize("which", [0, 1], ids=["q-v", "every-layer-fused"])
def test_an_adapter_gives_the_merged_models_greedy_tokens(
    engine: TorchEngine, adapters: list[LoraAdapter], tiny_model_dir: Path, tmp_path: Path, which: int
) -> None:
    adapter = adapters[which]
    layer = engine._require().loaded.model.model.layers[0]
    assert layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None  # fused parts
    reference = engine_on(merged(tiny_model_dir, adapter, tmp_path / "merged"))
    with_adapter = replace(GREEDY, adapter=f"{adapter.name}#1")
    changed = 0
    for prompt in map(engine.encode, PROMPTS):
        ours = generate(engine, 0, prompt, with_adapter)
        assert ours == generate(reference, 0, prompt, GREEDY)
        changed += ours != generate(engine, 0, prompt, GREEDY)
    assert changed  # the adapter does change what the model writes


def test_mixed_batch_rows_get_their_tokens_alone(engine: TorchEngine) -> None:
    """Four rows, two adapters and the base, in one batch: each row's tokens are those it gets alone."""
    prompt = engine.encode(PROMPTS[1])
    jobs = [
        (prompt, replace(GREEDY, adapter="qv#1")),
        (prompt, GREEDY),
        (prompt, replace(GREEDY, adapter="every#1")),
        (engine.encode(PROMPTS[0]), replace(GREEDY, adapter="qv#1")),
    ]
    alone = [generate(engine, 0, p, params) for p, params in jobs]
    assert len({tuple(t) for t in alone[:3]}) == 3  # three models: three answers
    assert batched(engine, jobs) == alone


def test_base_rows_are_bit_for_bit_the_base_beside_adapter_rows(
    engine: TorchEngine, tiny_model_dir: Path
) -> None:
    plain = engine_on(tiny_model_dir)
    prompt = engine.encode(PROMPTS[2])
    lora = engine._require().lora
    with torch.inference_mode():
        tokens = torch.tensor([prompt[-1], prompt[-1]])
        for e in (engine, plain):
            for slot in (0, 1):
                e.prefill(slot, prompt[:-1], GREEDY)
        with lora.rows(["every#1", None]):
            mixed = engine._require().loaded.model.decode(
                tokens, torch.tensor([len(prompt) - 1] * 2), len(prompt)
            )
        base = plain._require().loaded.model.decode(tokens, torch.tensor([len(prompt) - 1] * 2), len(prompt))
    assert torch.equal(mixed[1], base[1])
    assert not torch.allclose(mixed[0], base[0])


def test_a_prefix_cached_under_one_adapter_is_not_reused_by_another(engine: TorchEngine) -> None:
    prompt = engine.encode(PROMPTS[1])
    want = generate(engine, 0, prompt, replace(GREEDY, adapter="every#1"))
    generate(engine, 1, prompt, GREEDY)  # slot 1 now holds the prompt under the base
    assert generate(engine, 1, prompt, replace(GREEDY, adapter="every#1")) == want


def test_unload_forgets_the_adapter_and_a_request_for_it_fails_alone(
    tiny_model_dir: Path, adapters: list[LoraAdapter]
) -> None:
    engine = engine_on(tiny_model_dir)
    engine.load_adapter("qv#1", adapters[0], Path())
    prompt = engine.encode(PROMPTS[0])
    base = generate(engine, 0, prompt, GREEDY)
    generate(engine, 0, prompt, replace(GREEDY, adapter="qv#1"))
    engine.unload_adapter("qv#1")
    results = engine.prefill_many([(0, prompt, replace(GREEDY, adapter="qv#1")), (1, prompt, GREEDY)])
    assert isinstance(results[0], AgentError) and "no adapter is loaded" in str(results[0])
    assert [results[1], *[engine.step([1])[0] for _ in range(N - 1)]] == base
    assert engine.describe().extra["adapters"] == "-"


def test_an_adapter_for_another_shape_is_refused_and_nothing_loads(
    tiny_model_dir: Path, adapters: list[LoraAdapter]
) -> None:
    engine = engine_on(tiny_model_dir)
    adapter = adapters[0]
    module = adapter.target_modules[0]
    a, b = adapter.tensors[module]
    wide = replace(adapter, tensors={**adapter.tensors, module: (np.zeros((4, 80), np.float16), b)})
    with pytest.raises(AgentError, match=rf"{module} is \[\d+ x 80\].*another base"):
        engine.load_adapter("wide", wide, Path())
    outside = replace(adapter, target_modules=("lm_head",), tensors={"lm_head": (a, b)})
    with pytest.raises(AgentError, match="targets lm_head"):
        engine.load_adapter("head", outside, Path())
    assert engine.describe().extra["adapters"] == "-"


def test_int8_base_batches_adapter_rows_as_they_run_alone(
    build: Callable[..., Path], tiny_model_dir: Path, adapters: list[LoraAdapter]
) -> None:
    engine = engine_on(build(tiny_model_dir, "int8"))
    for adapter in adapters:
        engine.load_adapter(adapter.name, adapter, Path())
    prompt = engine.encode(PROMPTS[1])
    jobs = [(prompt, replace(GREEDY, adapter=a.name)) for a in adapters] + [(prompt, GREEDY)]
    alone = [generate(engine, 0, p, params) for p, params in jobs]
    assert len({tuple(t) for t in alone}) == 3
    assert batched(engine, jobs) == alone


def test_an_adapter_loaded_into_the_layout_is_written_in_place_and_read_by_the_next_step(
    tiny_model_dir: Path, adapters: list[LoraAdapter], tmp_path: Path
) -> None:
    """Replacing, unloading and loading again within the stacked buffers' layout keeps the buffers
    (captured graphs read them), and each next step computes with what they hold now; a slot's
    prefix cached under the key's previous adapter is not reused."""
    engine = engine_on(tiny_model_dir)
    engine.load_adapter("x", adapters[1], Path())
    lora = engine._require().lora
    version, buffers = lora.version, [(m.a_t, m.b_t) for m in lora._wrapped.values()]
    prompt = engine.encode(PROMPTS[0])
    first = generate(engine, 0, prompt, replace(GREEDY, adapter="x"))
    other = from_peft(
        make_peft_adapter(tiny_model_dir, tmp_path / "peft-other", seed=3, b_std=0.2), "other", "1", "base"
    )
    engine.load_adapter("x", other, Path())  # q/v rank 4 fits the every-layer rank-8 layout
    assert lora.version == version
    assert all(m.a_t is a and m.b_t is b for m, (a, b) in zip(lora._wrapped.values(), buffers, strict=True))
    reference = engine_on(merged(tiny_model_dir, other, tmp_path / "merged"))
    want = generate(reference, 0, prompt, GREEDY)
    assert want != first
    assert generate(engine, 0, prompt, replace(GREEDY, adapter="x")) == want
    engine.unload_adapter("x")
    assert all(not m.b_t.any() for m in lora._wrapped.values())  # the slot is zeroed
    engine.load_adapter("y", other, Path())
    assert lora.version == version and lora.index("y") == 1  # the freed slot, the same buffers
    assert generate(engine, 1, prompt, replace(GREEDY, adapter="y")) == want
    assert generate(engine, 2, prompt, GREEDY) == generate(engine_on(tiny_model_dir), 0, prompt, GREEDY)


def test_more_adapters_than_the_layouts_slots_grow_it_and_keep_every_adapter(
    engine: TorchEngine, adapters: list[LoraAdapter]
) -> None:
    lora = engine._require().lora
    prompt = engine.encode(PROMPTS[2])
    before = generate(engine, 0, prompt, replace(GREEDY, adapter="every#1"))
    version = lora.version
    keys = [f"extra-{i}" for i in range(4)]
    for key in keys:
        engine.load_adapter(key, adapters[0], Path())
    assert lora.version > version  # six adapters: more than the four slots
    jobs = [(prompt, replace(GREEDY, adapter=k)) for k in ("every#1", keys[-1], "qv#1")]
    assert batched(engine, jobs)[0] == before
    for key in keys:
        engine.unload_adapter(key)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def cuda_engine(model_dir: Path) -> TorchEngine:
    engine = TorchEngine(device="cuda", dtype="fp32", slots=4, graph_buckets=(1, 2, 4))
    engine.load(model_dir)
    return engine


@cuda
def test_cuda_adapter_rows_replay_captured_graphs_alone_mixed_and_as_merged(
    tiny_model_dir: Path, adapters: list[LoraAdapter], tmp_path: Path
) -> None:
    engine = cuda_engine(tiny_model_dir)
    for adapter in adapters:
        engine.load_adapter(adapter.name, adapter, Path())
    decode = engine._require().decode
    assert decode.adapter_graphs and decode.adapter_prefills, engine.describe().extra["adapter_steps"]
    prompt = engine.encode(PROMPTS[1])
    jobs = [
        (prompt, replace(GREEDY, adapter="qv")),
        (prompt, GREEDY),
        (prompt, replace(GREEDY, adapter="every")),
        (engine.encode(PROMPTS[0]), replace(GREEDY, adapter="qv")),
    ]
    alone = [generate(engine, 0, p, params) for p, params in jobs]
    assert len({tuple(t) for t in alone[:3]}) == 3
    assert batched(engine, jobs) == alone
    for which, adapter in enumerate(adapters):
        reference = cuda_engine(merged(tiny_model_dir, adapter, tmp_path / f"merged-{which}"))
        assert generate(reference, 0, prompt, GREEDY) == alone[2 * which]
        reference.unload()


@cuda
def test_cuda_graphs_see_factors_loaded_and_unloaded_after_their_capture(
    tiny_model_dir: Path, adapters: list[LoraAdapter], tmp_path: Path
) -> None:
    engine = cuda_engine(tiny_model_dir)
    engine.load_adapter("x", adapters[1], Path())
    decode = engine._require().decode
    graphs = decode.adapter_graphs
    prompt = engine.encode(PROMPTS[0])
    first = generate(engine, 0, prompt, replace(GREEDY, adapter="x"))
    other = from_peft(
        make_peft_adapter(tiny_model_dir, tmp_path / "peft-other", seed=3, b_std=0.2), "other", "1", "base"
    )
    engine.load_adapter("x", other, Path())
    assert decode.adapter_graphs is graphs  # no new capture: the graphs read the buffers
    second = generate(engine, 0, prompt, replace(GREEDY, adapter="x"))
    assert second != first
    reference = cuda_engine(merged(tiny_model_dir, other, tmp_path / "merged"))
    assert second == generate(reference, 0, prompt, GREEDY)
    reference.unload()
    base = generate(engine, 1, prompt, GREEDY)
    engine.unload_adapter("x")
    engine.load_adapter("x", adapters[1], Path())
    assert decode.adapter_graphs is graphs
    assert batched(engine, [(prompt, replace(GREEDY, adapter="x")), (prompt, GREEDY)]) == [first, base]
