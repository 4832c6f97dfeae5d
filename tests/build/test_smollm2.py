"""The real SmolLM2-135M-Instruct: int8 and int4-g128 builds are byte-reproducible."""

from __future__ import annotations

import pytest

from deployer.build.artifact import read_manifest
from deployer.build.pipeline import build_artifact
from tests.build.conftest import make_request, small_gate


@pytest.mark.slow
@pytest.mark.parametrize(("scheme", "group_size"), [("int8", 128), ("int4", 128)])
def test_smollm2_builds_twice_to_the_same_sha256(smollm2_dir, tmp_path, scheme, group_size):
    gate = small_gate(max_perplexity_increase_pct=60.0)
    first = build_artifact(make_request(smollm2_dir, tmp_path / "a", scheme, group_size, gate=gate))
    second = build_artifact(make_request(smollm2_dir, tmp_path / "b", scheme, group_size, gate=gate))
    assert first.artifact_id == second.artifact_id and not second.cached
    manifest = read_manifest(first.artifact_dir)
    assert manifest.model.architecture == "LlamaForCausalLM"
    assert "lm_head.weight" not in manifest.tensors  # tied to the embeddings: stored once
    q_proj = manifest.quantization.modules["model.layers.0.self_attn.q_proj"]
    assert q_proj.scheme == scheme and q_proj.in_features == 576
    if scheme == "int4":
        assert q_proj.in_padded == 640  # 576 is not a multiple of 128
    assert manifest.quality.perplexity.quantized < 1.6 * manifest.quality.perplexity.reference
