"""The quality gate on a GGUF artifact runs the quantized model through llama.cpp's own kernels (what
the llama.cpp engine serves), and through torch on the dequantized weights only without llama.cpp."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from deployer.build import quality
from deployer.build.gguf_writer import GGUF_NAME, load_gguf_state, plan_gguf, write_gguf
from deployer.build.pipeline import build_artifact
from deployer.build.source import open_source
from deployer.build.spec import BuildRequest, GateSpec, QualityReport, QuantSpec
from deployer.errors import QualityGateError
from tests.agent.engines.llamacpp.conftest import build_gguf, needs_llama_cpp
from tests.build.conftest import EVAL_TEXT, small_gate
from tests.checkpoints import hf_random_checkpoint


def _request(source: Path, store: Path, gate: GateSpec, scheme: str = "int4", **kwargs) -> BuildRequest:
    return BuildRequest(
        source_dir=source,
        name="tiny",
        version="1.0.0",
        quant=QuantSpec(scheme, 32),
        store_dir=store,
        gate=gate,
        format="gguf",
        **kwargs,
    )


def _measured_in_torch(request: BuildRequest, artifact_dir: Path, bits: float = 0.0) -> QualityReport:
    """The gate's report of the artifact scored in torch (`bits` per weight is carried, not measured)."""
    source = open_source(request.source_dir)
    plans = plan_gguf(source, request.quant, int4_type=request.gguf_int4)
    with quality.torch_scorer(source, load_gguf_state(artifact_dir / GGUF_NAME, plans)) as scorer:
        return quality.apply_limits(quality.measure(source, scorer, request.gate, bits), request.gate)


def _measured_in_llama_cpp(request: BuildRequest, artifact_dir: Path, bits: float = 0.0) -> QualityReport:
    """The gate's report of the artifact scored by llama.cpp (`bits` per weight is carried)."""
    source = open_source(request.source_dir)
    with quality.llama_cpp_scorer(artifact_dir / GGUF_NAME, quality.window(source)) as scorer:
        return quality.apply_limits(quality.measure(source, scorer, request.gate, bits), request.gate)


@needs_llama_cpp
def test_llama_cpp_scores_an_f32_gguf_as_transformers_does(tiny_model_dir, tmp_path):
    """Position for position: llama.cpp's logits line up with the reference's (same model, fp32)."""
    source = open_source(tiny_model_dir)
    write_gguf(source, tmp_path / GGUF_NAME, plan_gguf(source, QuantSpec("fp32")), name="tiny", version="1")
    ids = quality.eval_tokens(source, EVAL_TEXT, 64)
    with torch.inference_mode(), quality.llama_cpp_scorer(tmp_path / GGUF_NAME, 64) as scorer:
        ours = scorer(ids)
        again = scorer(ids[:10])  # a fresh window: nothing left over from the last one
        theirs = quality.load_model(source)(torch.tensor([ids])).logits[0]
    assert ours.shape == theirs.shape == (64, source.config["vocab_size"])
    assert torch.allclose(ours, theirs, atol=1e-3)
    assert torch.allclose(again, ours[:10], atol=1e-5)


@needs_llama_cpp
def test_llama_cpp_serves_a_qwen2_gguf_as_transformers_does(tiny_model_dir, tmp_path):
    """Qwen2 as llama.cpp's qwen2 graph: q/k/v biases kept, q/k rows not permuted (that graph
    rotates HF's halves as stored), the tied head read from the embedding; the engine reads its
    context length under the qwen2 keys."""
    from transformers import AutoConfig

    from deployer.agent.engines.llamacpp.engine import LlamaCppEngine

    config = AutoConfig.for_model(
        "qwen2",
        tie_word_embeddings=True,
        vocab_size=384,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,  # logits far enough apart that a wrong layout shows
    )
    source = open_source(hf_random_checkpoint(tmp_path / "qwen2", config, tiny_model_dir))
    assert any(t.name.endswith("q_proj.bias") for t in source.tensors)
    artifact = build_gguf(source.path, tmp_path / "store", scheme="fp32")
    ids = quality.eval_tokens(source, EVAL_TEXT, 64)
    with torch.inference_mode(), quality.llama_cpp_scorer(artifact / GGUF_NAME, 64) as scorer:
        ours = scorer(ids)
        theirs = quality.load_model(source)(torch.tensor([ids])).logits[0]
    # Logits up to 8 differ by 0.009 at most (llama.cpp's f16 KV cache); with the q/k rows
    # permuted as for llama, by 10, and the top token agrees at 5% of positions.
    assert (ours - theirs).abs().max() < 0.05
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    engine = LlamaCppEngine(max_context=2048, threads=1, slots=1)
    engine.load(artifact)
    try:
        assert engine.describe().context_length == 512  # the model's, below the agent's cap
    finally:
        engine.unload()


@needs_llama_cpp
def test_a_gguf_build_is_gated_through_llama_cpp(tiny_model_dir, tmp_path):
    request = _request(tiny_model_dir, tmp_path / "store", small_gate())
    result = build_artifact(request)
    bits = result.quality.bits_per_weight
    assert result.quality == _measured_in_llama_cpp(request, result.artifact_dir, bits)
    # Not the dequantized fp32 copy: llama.cpp multiplies 4-bit weights by 8-bit activations.
    assert result.quality.mean_kl != _measured_in_torch(request, result.artifact_dir).mean_kl


def test_without_llama_cpp_a_gguf_build_is_gated_in_torch(tiny_model_dir, tmp_path, monkeypatch):
    with_llama_cpp = None
    if quality.llama_cpp_available():
        with_llama_cpp = build_artifact(_request(tiny_model_dir, tmp_path / "store", small_gate()))
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # what `import llama_cpp` sees when absent
    request = _request(tiny_model_dir, tmp_path / "store", small_gate())
    result = build_artifact(request)
    assert not result.cached  # the gate's runtime shapes the manifest, so it keys the cache
    bits = result.quality.bits_per_weight
    assert result.quality == _measured_in_torch(request, result.artifact_dir, bits)
    if with_llama_cpp is not None:
        assert result.artifact_id != with_llama_cpp.artifact_id


def _quickstart_gate() -> GateSpec:
    """The quickstart's gate (examples/quickstart/deploy.yaml)."""
    return GateSpec(EVAL_TEXT, max_tokens=256, max_perplexity_increase_pct=5.0, min_top1_agreement=0.9)


@pytest.mark.slow
@needs_llama_cpp
def test_smollm2_q8_0_passes_the_quickstart_gate_in_llama_cpp(smollm2_dir, tmp_path):
    request = _request(smollm2_dir, tmp_path / "store", _quickstart_gate(), scheme="int8")
    result = build_artifact(request)
    report, in_torch = result.quality, _measured_in_torch(request, result.artifact_dir)
    assert report.tokens == 256 and report.passed
    assert report.reference_perplexity == in_torch.reference_perplexity  # the same fp32 reference
    # llama.cpp's kernels cost a little more than the weights alone, but the same order of figures.
    assert 0 < report.mean_kl < 0.02 and abs(report.top1_agreement - in_torch.top1_agreement) <= 0.05
    assert abs(report.increase_pct - in_torch.increase_pct) < 1.0


@pytest.mark.slow
@needs_llama_cpp
def test_smollm2_q4_0_fails_the_quickstart_gate_in_llama_cpp(smollm2_dir, tmp_path):
    """SmolLM2's checkpoint is llama.cpp's Q4_1 file dequantized: Q4_0 re-rounds every weight."""
    request = _request(smollm2_dir, tmp_path / "store", _quickstart_gate(), gguf_int4="Q4_0")
    with pytest.raises(QualityGateError, match="perplexity rose"):
        build_artifact(request)
