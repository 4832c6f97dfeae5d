"""The streamed quality gate gives the figures of the whole-model gate it replaced.

The whole-model gate (kept here as the oracle) ran `transformers`' whole model in fp32 for the
source and for the dequantized artifact; the streamed one runs the same modules a decoder layer at
a time. Figures are rounded to 4 significant digits, so they may differ in the last digit.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from deployer.build import quality
from deployer.build.artifact import ArtifactWeights, load_state_dict, module_quants, read_manifest
from deployer.build.pipeline import build_artifact
from deployer.build.source import open_source
from deployer.build.spec import GateSpec, QualityReport
from tests.build.conftest import EVAL_TEXT, make_request
from tests.checkpoints import hf_random_checkpoint


def _whole_model_report(source_dir: Path, artifact_dir: Path, gate: GateSpec) -> QualityReport:
    """What the gate measured before it streamed: both models whole, one window at a time."""
    source = open_source(source_dir)
    tokens = quality.eval_tokens(source, gate.eval_text, gate.max_tokens)
    size = quality.window(source)
    totals = quality._Totals()
    reference = quality.load_model(source)
    quantized = quality.load_model(source, load_state_dict(artifact_dir))
    with torch.inference_mode():
        for start in range(0, len(tokens) - 1, size):
            chunk = tokens[start : start + size + 1]
            inputs = torch.tensor([chunk[:-1]])
            totals = totals + quality._score(
                reference(inputs).logits[0], quantized(inputs).logits[0], torch.tensor(chunk[1:])
            )
    ref_ppl = math.exp(totals.reference_nll / totals.positions)
    q_ppl = math.exp(totals.quantized_nll / totals.positions)
    return QualityReport(
        eval_sha256="",
        tokens=len(tokens),
        reference_perplexity=ref_ppl,
        quantized_perplexity=q_ppl,
        increase_pct=(q_ppl / ref_ppl - 1.0) * 100.0,
        top1_agreement=totals.agree / totals.positions,
        mean_kl=totals.kl / totals.positions,
        bits_per_weight=0.0,
    )


def _streamed_report(source_dir: Path, artifact_dir: Path, gate: GateSpec) -> QualityReport:
    modules = module_quants(read_manifest(artifact_dir))
    return quality.measure(open_source(source_dir), ArtifactWeights(artifact_dir, modules), gate, 0.0)


def _assert_same_figures(streamed: QualityReport, whole: QualityReport) -> None:
    assert streamed.tokens == whole.tokens
    assert streamed.reference_perplexity == pytest.approx(whole.reference_perplexity, rel=1e-3)
    assert streamed.quantized_perplexity == pytest.approx(whole.quantized_perplexity, rel=1e-3)
    assert streamed.increase_pct == pytest.approx(whole.increase_pct, rel=1e-2, abs=1e-3)
    assert streamed.mean_kl == pytest.approx(whole.mean_kl, rel=1e-2, abs=1e-6)
    # One position in 200 may flip where two logits tie to float noise.
    assert streamed.top1_agreement == pytest.approx(whole.top1_agreement, abs=0.005)


def _tiny_config(kind: str) -> object:
    """Small configs in the layouts real checkpoints have: Qwen2 (q/k/v biases, tied head) and
    Llama 3 (untied head, GQA, rope scaling); a 64-token context, so the eval text spans windows."""
    from transformers import AutoConfig

    common = {
        "vocab_size": 384,
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "initializer_range": 0.2,
    }
    if kind == "qwen2":
        return AutoConfig.for_model("qwen2", tie_word_embeddings=True, **common)
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    return AutoConfig.for_model("llama", tie_word_embeddings=False, rope_scaling=rope, **common)


@pytest.mark.parametrize("kind", ["qwen2", "llama3"])
def test_streamed_gate_matches_the_whole_model_gate_over_several_windows(tiny_model_dir, tmp_path, kind):
    source = hf_random_checkpoint(tmp_path / kind, _tiny_config(kind), tiny_model_dir)
    gate = GateSpec(eval_text=EVAL_TEXT, max_tokens=200)
    artifact = build_artifact(make_request(source, tmp_path / "store", "int4", 32)).artifact_dir
    whole = _whole_model_report(source, artifact, gate)
    streamed = _streamed_report(source, artifact, gate)
    assert whole.tokens == 200  # 4 windows of the 64-token context
    _assert_same_figures(streamed, whole)
    assert streamed.increase_pct != 0.0  # int4 changed something the gate sees


def test_streamed_gate_matches_on_the_tiny_checkpoint_through_build(tiny_model_dir, tmp_path):
    gate = GateSpec(eval_text=EVAL_TEXT, max_tokens=128)
    result = build_artifact(make_request(tiny_model_dir, tmp_path, "int4", 32, gate=gate))
    assert result.quality is not None
    _assert_same_figures(result.quality, _whole_model_report(tiny_model_dir, result.artifact_dir, gate))


@pytest.mark.slow
def test_streamed_gate_matches_on_smollm2(smollm2_dir, tmp_path):
    gate = GateSpec(eval_text=EVAL_TEXT, max_tokens=512)
    result = build_artifact(make_request(smollm2_dir, tmp_path, "int4", 128, gate=gate))
    assert result.quality is not None
    _assert_same_figures(result.quality, _whole_model_report(smollm2_dir, result.artifact_dir, gate))
