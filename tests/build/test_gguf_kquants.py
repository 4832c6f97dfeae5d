"""`quantization.gguf_type`: llama.cpp's own quantizer (K-quants, Q8_0, through llama-cpp-python's
llama_model_quantize) on an f16 GGUF the pipeline writes, weighted by an importance matrix computed
on the calibration text. Byte-reproducible, recorded in the manifest, and patchable."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from deployer.build import llama_quant, quality
from deployer.build.awq import read_calibration
from deployer.build.demo_model import make_tiny_checkpoint
from deployer.build.gguf_writer import GGUF_NAME, plan_gguf
from deployer.build.pipeline import build_artifact
from deployer.build.source import open_source
from deployer.build.spec import AwqSpec, BuildRequest, LlamaQuantSpec, QuantSpec
from deployer.core.calibration import DEFAULT_CALIBRATION
from deployer.core.gguf_io import read_gguf_header
from deployer.core.patch_apply import apply_patch
from deployer.errors import BuildError
from deployer.release.delta import create_patch
from tests.build.conftest import EVAL_TEXT, small_gate

needs_llama_cpp = pytest.mark.skipif(
    not quality.llama_cpp_available(), reason="llama-cpp-python is not installed (SITS_NO_LLAMACPP=1)"
)


@pytest.fixture(scope="module")
def kq_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose rows are whole K-quant super-blocks of 256 (the default tiny model's 64
    would make llama.cpp fall back to Q5_0/Q8_0 everywhere)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("kq-model"), hidden_size=256, intermediate_size=512)


def _request(source: Path, store: Path, gguf_type: str = "Q4_K_M", **kwargs) -> BuildRequest:
    imatrix = kwargs.pop("imatrix", True)
    calibration = kwargs.pop("calibration", None)
    return BuildRequest(
        source_dir=source,
        name="tiny",
        version=kwargs.pop("version", "1.0.0"),
        quant=QuantSpec("fp16"),
        store_dir=store,
        format="gguf",
        use_cache=False,
        llama_quant=LlamaQuantSpec(gguf_type, imatrix, calibration),
        **kwargs,
    )


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _linear_types(artifact: Path) -> set[str]:
    header = read_gguf_header(artifact / GGUF_NAME)
    return {t.dtype for t in header.tensors if t.name.startswith("blk.") and len(t.shape) == 2}


@needs_llama_cpp
@pytest.mark.long  # 4 s or more on 2 shared cores
def test_q4_k_m_with_an_imatrix_is_reproducible_and_recorded(kq_model, tmp_path):
    first = build_artifact(_request(kq_model, tmp_path / "a"))
    second = build_artifact(_request(kq_model, tmp_path / "b"))
    assert first.artifact_id == second.artifact_id  # same inputs, same bytes, built twice
    assert _sha(first.artifact_dir / GGUF_NAME) == _sha(second.artifact_dir / GGUF_NAME)
    assert _linear_types(first.artifact_dir) == {"Q4_K", "Q6_K"}  # Q4_K_M's recipe
    assert sorted(p.name for p in first.artifact_dir.iterdir()) == [GGUF_NAME, "sits-manifest.json"]
    manifest = json.loads((first.artifact_dir / "sits-manifest.json").read_text())
    gguf = manifest["quantization"]["spec"]["gguf"]
    assert gguf["type"] == "Q4_K_M"
    assert gguf["imatrix"]["calibration_sha256"] == _sha(DEFAULT_CALIBRATION)
    assert len(gguf["imatrix"]["sha256"]) == 64
    for name, record in manifest["tensors"].items():
        assert record["file"] == GGUF_NAME and len(record["sha256"]) == 64, name

    plain = build_artifact(_request(kq_model, tmp_path / "c", imatrix=False))
    manifest = json.loads((plain.artifact_dir / "sits-manifest.json").read_text())
    assert manifest["quantization"]["spec"]["gguf"] == {"type": "Q4_K_M", "imatrix": None}
    assert plain.artifact_id != first.artifact_id  # the matrix moved the rounding


@needs_llama_cpp
@pytest.mark.parametrize(
    ("gguf_type", "types"), [("Q5_K_M", {"Q5_K", "Q6_K"}), ("Q6_K", {"Q6_K"}), ("Q8_0", {"Q8_0"})]
)
def test_each_gguf_type_gets_llama_cpp_s_recipe(kq_model, tmp_path, gguf_type, types):
    result = build_artifact(_request(kq_model, tmp_path / "store", gguf_type, gate=small_gate()))
    assert _linear_types(result.artifact_dir) == types
    manifest = json.loads((result.artifact_dir / "sits-manifest.json").read_text())
    # Q8_0's quantizer reads no importance matrix: none is computed.
    assert (manifest["quantization"]["spec"]["gguf"]["imatrix"] is None) == (gguf_type == "Q8_0")
    assert result.quality is not None and result.quality.bits_per_weight > 5


@pytest.mark.long  # 4 s or more on 2 shared cores
def test_the_imatrix_covers_every_matrix_llama_cpp_quantizes(kq_model):
    """llama.cpp quietly quantizes a matrix without weights when its name is missing: every
    quantized matrix of the GGUF must have an entry, one value per input channel."""
    source = open_source(kq_model)
    plans = plan_gguf(source, QuantSpec("fp16"))
    calibration = read_calibration(AwqSpec())
    imatrix = llama_quant.compute_imatrix(source, plans, calibration, lambda _: None)
    matrices = {p.name: p.shape[1] for p in plans if len(p.shape) == 2}  # numpy order: (out, in)
    assert {name: v.size for name, v in imatrix.values.items()} == matrices  # tied: token_embd too
    assert all(v.dtype == np.float32 and (v > 0).all() for v in imatrix.values.values())
    again = llama_quant.compute_imatrix(source, plans, calibration, lambda _: None)
    assert again.sha256 == imatrix.sha256 and imatrix.tokens > 200


def _one_tensor_changed(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name] * np.float32(1.05)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


@needs_llama_cpp
@pytest.mark.long  # 4 s or more on 2 shared cores
def test_a_delta_between_two_k_quant_builds_applies_and_verifies(kq_model, tmp_path):
    base = build_artifact(_request(kq_model, tmp_path / "store")).artifact_dir
    tuned = _one_tensor_changed(kq_model, tmp_path / "tuned")
    target = build_artifact(_request(tuned, tmp_path / "store", version="1.0.1")).artifact_dir
    patch = tmp_path / "v1-v2.sitspatch"
    summary = create_patch(base, target, patch)
    assert summary.size < (target / GGUF_NAME).stat().st_size  # layer 0 is untouched: copied
    out = tmp_path / "applied"
    out.mkdir()
    apply_patch(patch, base, out)
    for name in (GGUF_NAME, "sits-manifest.json"):
        assert _sha(out / name) == _sha(target / name)


def test_calibration_that_is_the_eval_text_is_refused(kq_model, tmp_path):
    request = _request(kq_model, tmp_path / "store", calibration=EVAL_TEXT, gate=small_gate())
    with pytest.raises(BuildError, match="calibration is the same text as"):
        build_artifact(request)


def test_gguf_type_needs_a_gguf_from_a_float_source(kq_model, tmp_path):
    with pytest.raises(BuildError, match="GGUF artifacts only"):
        BuildRequest(kq_model, "t", "1.0.0", QuantSpec("fp16"), tmp_path, llama_quant=LlamaQuantSpec("Q6_K"))
    with pytest.raises(BuildError, match="starts from a float GGUF, not int4-g32"):
        BuildRequest(
            kq_model,
            "t",
            "1.0.0",
            QuantSpec("int4", 32),
            tmp_path,
            format="gguf",
            llama_quant=LlamaQuantSpec("Q6_K"),
        )
    with pytest.raises(BuildError, match=r"unknown type 'Q4_K_S'.*Q4_K_M, Q5_K_M, Q6_K, Q8_0"):
        LlamaQuantSpec("Q4_K_S")


@needs_llama_cpp
def test_build_from_deploy_yaml_hands_the_gguf_to_llama_cpp_s_quantizer(kq_model, tmp_path):
    from click.testing import CliRunner

    from deployer.cli.main import cli

    (tmp_path / "calib.txt").write_text(DEFAULT_CALIBRATION.read_text()[::-1])  # another text
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(
        f"application: tiny\nmodel:\n  name: tiny\n  version: 1.0.0\n  source: {kq_model}\n"
        "  quantization:\n    gguf_type: Q5_K_M\n    calibration: calib.txt\n"
        "fleet:\n  devices:\n    - name: d1\n      transport: local\n      root: ./fleet/d1\n"
        "agent:\n  engine: llama.cpp\n"
    )
    result = CliRunner().invoke(cli, ["build", "-f", str(deploy), "--output", "json"])
    assert result.exit_code == 0, result.output
    artifact = Path(json.loads(result.stdout)["artifact_dir"])
    assert _linear_types(artifact) == {"Q5_K", "Q6_K"}
    manifest = json.loads((artifact / "sits-manifest.json").read_text())
    assert manifest["quantization"]["spec"]["scheme"] == "fp16"  # the GGUF llama.cpp started from
    imatrix = manifest["quantization"]["spec"]["gguf"]["imatrix"]
    assert imatrix["calibration_sha256"] == _sha(tmp_path / "calib.txt")
