"""An adapter of a GGUF base is also written as llama.cpp's LoRA GGUF (issue #41), and llama.cpp
running the base with it computes what the merged model computes (q, k and v targeted, so the
rotary row permutation of q and k is checked too)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from deployer.build.adapter import AdapterBuildRequest, build_adapter
from deployer.core.gguf_io import read_gguf_header
from deployer.core.hashing import sha256_file
from tests.agent.engines.llamacpp.conftest import build_gguf, needs_llama_cpp
from tests.agent.lora_helpers import make_peft_adapter, merged_checkpoint

PROMPT = "The quick brown fox jumps over the lazy dog, and then"


def _logits(model: Path, lora: Path | None = None) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(model),
        lora_path=str(lora) if lora else None,
        n_ctx=64,
        logits_all=True,
        verbose=False,
        n_threads=1,
    )
    tokens = llm.tokenize(PROMPT.encode())
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)])


@needs_llama_cpp
def test_llama_cpp_with_the_gguf_adapter_matches_the_merged_model(tiny_model_dir, tmp_path):
    peft = make_peft_adapter(
        tiny_model_dir, tmp_path / "peft", seed=5, targets=("q_proj", "k_proj", "v_proj"), b_std=0.5
    )
    base = build_gguf(tiny_model_dir, tmp_path / "store", scheme="fp32")
    request = AdapterBuildRequest(
        name="extract",
        version="1.0.0",
        peft_dir=peft,
        scale=0.5,
        base_artifact_dir=base,
        base_artifact_id=sha256_file(base / "sits-manifest.json"),
        base_source_dir=tiny_model_dir,
        store_dir=tmp_path / "store",
    )
    built = build_adapter(request)
    again = build_adapter(AdapterBuildRequest(**{**request.__dict__, "store_dir": tmp_path / "store2"}))
    assert sha256_file(again.artifact_dir / "adapter.gguf") == sha256_file(
        built.artifact_dir / "adapter.gguf"
    )
    header = read_gguf_header(built.artifact_dir / "adapter.gguf")
    assert (header.string("general.type"), header.string("adapter.type")) == ("adapter", "lora")
    assert "blk.1.attn_k.weight.lora_b" in header.by_name()

    merged = build_gguf(
        merged_checkpoint(tiny_model_dir, built.artifact_dir, tmp_path / "merged"), tmp_path / "m", "fp32"
    )
    reference = _logits(merged / "model.gguf")
    with_adapter = _logits(base / "model.gguf", built.artifact_dir / "adapter.gguf")
    alone = _logits(base / "model.gguf")
    moved = np.abs(alone - reference).max()
    assert moved > 0.05  # the adapter changes the model's outputs
    # fp16 factors against the fp32 merged delta: far closer than the adapter's own effect (B of q
    # and k left in HF row order instead of llama.cpp's rotary order misses by about moved / 10).
    assert np.abs(with_adapter - reference).max() < moved / 100
    assert (with_adapter.argmax(-1) == reference.argmax(-1)).all()
