"""LoRA adapters on the llama.cpp engine (issue #41): llama.cpp's LoRA GGUF loaded at runtime on
the loaded model, set on the context for the requests that name it; requests of different
adapters decoded in separate batches of one step, each as alone; an adapter's greedy output is the
merged model's; unload frees it; an adapter of another base is refused before llama.cpp sees it.
Real PEFT adapters of the tiny model (q, k and v targeted, so the rotary row order counts)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from deployer.agent.engines.llamacpp.engine import LlamaCppEngine
from deployer.agent.types import ChatMessage, SamplingParams
from deployer.build.demo_model import make_tiny_checkpoint
from deployer.core.lora import read_adapter
from deployer.errors import AgentError, FormatError
from tests.agent.engines.llamacpp.conftest import build_gguf, build_gguf_adapter, needs_llama_cpp
from tests.agent.lora_helpers import merged_checkpoint

pytestmark = needs_llama_cpp

PROMPT = "The quick brown fox jumps over the lazy dog, and then"
TOKENS = 16


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The fp32 GGUF base, adapters `a` and `b` for it, and the base with `a` merged, as GGUF."""
    root = tmp_path_factory.mktemp("llamacpp-adapters")
    base = build_gguf(tiny_model_dir, root / "store", scheme="fp32")
    a = build_gguf_adapter(tiny_model_dir, base, root / "store", name="a", seed=5)
    b = build_gguf_adapter(tiny_model_dir, base, root / "store", name="b", seed=7)
    merged = build_gguf(merged_checkpoint(tiny_model_dir, a, root / "merged"), root / "m", "fp32")
    return {"base": base, "a": a, "b": b, "merged": merged}


def _engine(artifact: Path) -> LlamaCppEngine:
    engine = LlamaCppEngine(max_context=128, threads=1, slots=4)
    engine.load(artifact)
    return engine


def _greedy(engine: LlamaCppEngine, adapter: str | None = None) -> list[int]:
    params = SamplingParams(max_tokens=TOKENS, temperature=0, adapter=adapter)
    return [e.token_id for e in engine.stream(engine.encode(PROMPT), params)]


def _load(engine: LlamaCppEngine, key: str, artifact: Path) -> None:
    engine.load_adapter(key, read_adapter(artifact), artifact)


def test_an_adapter_changes_the_greedy_output_to_the_merged_models(models: dict[str, Path]) -> None:
    merged = _engine(models["merged"])
    try:
        want = _greedy(merged)
    finally:
        merged.unload()
    engine = _engine(models["base"])
    try:
        base = _greedy(engine)
        _load(engine, "a#1", models["a"])
        assert engine.describe().extra["adapters"] == "a#1"
        assert _greedy(engine, "a#1") == want != base
        assert _greedy(engine) == base  # the base untouched beside it
    finally:
        engine.unload()


def test_mixed_adapters_in_one_step_each_get_their_answer_alone(models: dict[str, Path]) -> None:
    engine = _engine(models["base"])
    try:
        _load(engine, "a", models["a"])
        _load(engine, "b", models["b"])
        alone = {key: _greedy(engine, key) for key in (None, "a", "b")}
        assert len({tuple(tokens) for tokens in alone.values()}) == 3
        keys = ["a", None, "b", "a"]
        prompt = engine.encode(PROMPT)
        firsts = engine.prefill_many(
            [
                (slot, prompt, SamplingParams(max_tokens=TOKENS, temperature=0, adapter=key))
                for slot, key in enumerate(keys)
            ]
        )
        got: list[list[int | Exception]] = [[token] for token in firsts]
        for _ in range(TOKENS - 1):
            for row, token in zip(got, engine.step(range(len(keys))), strict=True):
                row.append(token)
        assert got == [alone[key] for key in keys]
    finally:
        engine.unload()


def test_unload_frees_the_adapter_and_a_request_naming_it_fails_alone(models: dict[str, Path]) -> None:
    engine = _engine(models["base"])
    try:
        base = _greedy(engine)
        _load(engine, "a", models["a"])
        _greedy(engine, "a")  # slot 0's cache now holds keys and values of the adapter
        engine.unload_adapter("a")
        assert engine.describe().extra["adapters"] == "-"
        with pytest.raises(AgentError, match="no adapter is loaded under 'a'"):
            _greedy(engine, "a")
        assert _greedy(engine) == base  # no prefix of the adapter's cache reused for the base
        engine.unload_adapter("a")  # a second unload does nothing
    finally:
        engine.unload()


def test_an_adapter_of_another_base_or_without_its_gguf_is_refused(
    models: dict[str, Path], tmp_path: Path
) -> None:
    wide = make_tiny_checkpoint(tmp_path / "wide", hidden_size=96)
    wide_base = build_gguf(wide, tmp_path / "store", scheme="fp32")
    other = build_gguf_adapter(wide, wide_base, tmp_path / "store", name="a", seed=5)
    engine = _engine(models["base"])
    try:
        base = _greedy(engine)
        with pytest.raises(FormatError, match=r"blk\.0\.attn_k\.weight\.lora_a does not fit the model"):
            _load(engine, "other", other)
        (tmp_path / "safetensors-only").mkdir()
        for name in ("adapter.json", "adapter.safetensors"):
            (tmp_path / "safetensors-only" / name).write_bytes((models["a"] / name).read_bytes())
        with pytest.raises(AgentError, match=r"has no adapter\.gguf"):
            _load(engine, "a", tmp_path / "safetensors-only")
        assert engine.describe().extra["adapters"] == "-"
        assert _greedy(engine) == base
    finally:
        engine.unload()


def test_smollm2_adapter_answers_as_the_merged_model_alone_and_beside_the_base(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    """A rank-8 q/v PEFT adapter of SmolLM2-135M-Instruct as the issue sizes it, on its F16 GGUF:
    greedy chat answers with the adapter are those of the F16 GGUF of the checkpoint with it merged
    in, alone and with the base's and the adapter's rows in one step, and differ from the base's."""
    base = build_gguf(smollm2_dir, tmp_path / "store", scheme="fp16")
    adapter = build_gguf_adapter(
        smollm2_dir, base, tmp_path / "store", name="a", seed=5, targets=("q_proj", "v_proj"), b_std=0.02
    )
    merged_dir = merged_checkpoint(smollm2_dir, adapter, tmp_path / "merged")
    merged = build_gguf(merged_dir, tmp_path / "m", scheme="fp16")
    questions = ["What is the capital of France?", "Name three colours.", "Say hello in Spanish."]
    params = SamplingParams(max_tokens=24, temperature=0)

    def answers(engine: LlamaCppEngine, adapter: str | None = None) -> list[list[int]]:
        ask = SamplingParams(max_tokens=24, temperature=0, adapter=adapter)
        return [
            [e.token_id for e in engine.stream(engine.chat_prompt([ChatMessage("user", q)]), ask)]
            for q in questions
        ]

    engine = _engine(merged)
    try:
        want = answers(engine)
    finally:
        engine.unload()
    engine = _engine(base)
    try:
        _load(engine, "a", adapter)
        assert answers(engine, "a") == want != answers(engine)
        prompts = [engine.chat_prompt([ChatMessage("user", q)]) for q in questions]
        items = [
            (2 * i + k, p, replace(params, adapter=key))
            for i, p in enumerate(prompts[:2])
            for k, key in enumerate(("a", None))
        ]
        got: list[list[int | Exception]] = [[t] for t in engine.prefill_many(items)]
        for _ in range(23):
            for row, token in zip(got, engine.step([slot for slot, *_ in items]), strict=True):
                row.append(token)
        # Stepped past a stream's end token: the answers are what came before it.
        assert [row[: len(w)] for row, w in zip(got[0::2], want, strict=False)] == want[:2]
    finally:
        engine.unload()
