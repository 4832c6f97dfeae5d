"""Artifact format versions: int4 and AWQ artifacts are format 2, others stay 1; format 1 int4
(uint8 zero points) still loads; a later version is refused with a clear message."""

from __future__ import annotations

import json

import pytest
import torch

from deployer.agent.engines.torch.qlinear import LinearWeights, build_linear
from deployer.build.pipeline import build_artifact
from deployer.core.canonical import canonical_json
from deployer.core.manifest import parse_manifest, read_manifest
from deployer.core.quant_layout import ModuleQuant, dequantize_int4
from deployer.errors import FormatError
from tests.build.conftest import make_request


@pytest.mark.parametrize(("scheme", "version"), [("int8", 1), ("fp16", 1), ("int4", 2), ("layered", 2)])
def test_only_artifacts_with_int4_need_format_2(tiny_model_dir, tmp_path, scheme, version):
    result = build_artifact(make_request(tiny_model_dir, tmp_path / "store", scheme, 32))
    manifest = read_manifest(result.artifact_dir)
    assert manifest.format_version == version
    assert (
        "awq"
        not in json.loads((result.artifact_dir / "sits-manifest.json").read_text())["quantization"]["spec"]
    )
    zeros = {t.dtype for name, t in manifest.tensors.items() if name.endswith("_zero")}
    assert zeros == ({"F16"} if version == 2 else set())


def _manifest_doc(tiny_model_dir, tmp_path) -> dict:
    result = build_artifact(make_request(tiny_model_dir, tmp_path / "store", "int8"))
    return json.loads((result.artifact_dir / "sits-manifest.json").read_text())


def test_a_later_format_version_is_refused_with_the_remedy(tiny_model_dir, tmp_path):
    doc = _manifest_doc(tiny_model_dir, tmp_path)
    doc["format_version"] = 3
    with pytest.raises(FormatError) as caught:
        parse_manifest(canonical_json(doc), "m.json")
    assert "format_version 3 is not one this sits-deployer reads (1, 2)" in caught.value.message
    assert "upgrade sits-deployer" in caught.value.hint


def test_format_1_cannot_claim_awq(tiny_model_dir, tmp_path):
    doc = _manifest_doc(tiny_model_dir, tmp_path)
    doc["quantization"]["spec"]["awq"] = {"calibration_sha256": "0" * 64, "tokens": 9}
    with pytest.raises(FormatError, match="needs format_version 2"):
        parse_manifest(canonical_json(doc), "m.json")
    doc["format_version"] = 2
    assert parse_manifest(canonical_json(doc), "m.json").quantization.spec.awq.tokens == 9


def test_format_1_int4_with_uint8_zero_points_still_loads():
    # What a format 1 artifact stores: zero points 0..15 as uint8, same formula.
    generator = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (32, 32), dtype=torch.uint8, generator=generator)
    scale = (torch.rand(32, 2, generator=generator) * 0.01 + 0.001).to(torch.float16)
    zero = torch.randint(0, 16, (32, 2), dtype=torch.uint8, generator=generator)
    layout = ModuleQuant("int4", 32, 64, 64, 32)
    layer, _ = build_linear(
        "x", LinearWeights(packed, scale=scale, zero=zero), layout, torch.device("cpu"), torch.float32
    )
    x = torch.randn(3, 64, generator=generator)
    want = x @ dequantize_int4(packed, scale, zero, 64).t()
    # Our AVX2 kernel rounds activations to int16: close, not equal.
    assert float((layer(x) - want).norm() / want.norm()) < 1e-2
