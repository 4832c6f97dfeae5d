"""GGUF artifacts from `build`: reproducible, hashed per tensor, faithful to the source, refused when
GGUF cannot hold the scheme; and deltas between GGUF artifacts that are tensor-aware and bit-exact."""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from deployer.build.gguf_writer import GGUF_NAME, load_gguf_state, plan_gguf, write_gguf
from deployer.build.pipeline import build_artifact
from deployer.build.source import open_source
from deployer.build.spec import BuildRequest, QuantSpec
from deployer.core.gguf_io import read_gguf_header
from deployer.core.manifest import read_manifest
from deployer.core.patch_apply import apply_patch
from deployer.core.patch_format import Codec, read_header
from deployer.errors import BuildError, QualityGateError
from deployer.release.delta import create_patch
from tests.agent.engines.llamacpp.conftest import build_gguf
from tests.build.conftest import small_gate, store_is_empty


def _file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_artifact_is_one_gguf_plus_a_manifest_hashing_every_tensor(tiny_gguf_dir):
    manifest = read_manifest(tiny_gguf_dir)
    assert sorted(p.name for p in tiny_gguf_dir.iterdir()) == [GGUF_NAME, "sits-manifest.json"]
    assert manifest.files[GGUF_NAME].sha256 == _file_sha(tiny_gguf_dir / GGUF_NAME)
    header = read_gguf_header(tiny_gguf_dir / GGUF_NAME)
    data = (tiny_gguf_dir / GGUF_NAME).read_bytes()
    assert set(manifest.tensors) == {t.name for t in header.tensors}
    for t in header.tensors:
        record = manifest.tensors[t.name]
        assert (record.file, record.dtype, tuple(record.shape)) == (GGUF_NAME, t.dtype, t.shape)
        assert record.sha256 == hashlib.sha256(data[t.offset : t.offset + t.length]).hexdigest()
    assert manifest.tensors["blk.0.attn_q.weight"].dtype == "Q8_0"
    assert manifest.tensors["blk.0.attn_norm.weight"].dtype == "F32"
    assert manifest.quantization.spec.scheme == "int8"


def test_the_gguf_carries_architecture_tokenizer_and_chat_template(tiny_gguf_dir, tiny_model_dir):
    header = read_gguf_header(tiny_gguf_dir / GGUF_NAME)
    meta = header.metadata
    assert (meta["general.architecture"], meta["llama.block_count"], meta["llama.embedding_length"]) == (
        "llama",
        2,
        64,
    )
    assert (meta["tokenizer.ggml.model"], meta["tokenizer.ggml.pre"]) == ("gpt2", "gpt-2")
    tokens = meta["tokenizer.ggml.tokens"]
    assert tokens[meta["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
    assert "<|im_start|>" in meta["tokenizer.chat_template"]
    assert meta["general.file_type"] == 7  # MOSTLY_Q8_0


def test_builds_are_byte_reproducible(tiny_model_dir, tmp_path):
    first = build_gguf(tiny_model_dir, tmp_path / "a", scheme="int4")
    second = build_gguf(tiny_model_dir, tmp_path / "b", scheme="int4")
    assert first.name == second.name  # the artifact id: the manifest's sha256
    assert _file_sha(first / GGUF_NAME) == _file_sha(second / GGUF_NAME)


@pytest.mark.parametrize(
    ("scheme", "int4_type", "linear_type", "tolerance"),
    [
        ("fp32", "Q4_1", "F32", 0.0),
        ("fp16", "Q4_1", "F16", 1e-4),
        ("bf16", "Q4_1", "BF16", 1e-3),
        ("int8", "Q4_1", "Q8_0", 2e-3),
        ("int4", "Q4_1", "Q4_1", 2e-2),
        ("int4", "Q4_0", "Q4_0", 3e-2),
    ],
)
def test_each_type_reads_back_close_to_the_source(
    tiny_model_dir, tmp_path, scheme, int4_type, linear_type, tolerance
):
    source = open_source(tiny_model_dir)
    plans = plan_gguf(source, QuantSpec(scheme, 32), int4_type=int4_type)
    write_gguf(source, tmp_path / GGUF_NAME, plans, name="tiny", version="1")
    assert {p.ggml_type for p in plans if p.source.endswith("mlp.up_proj.weight")} == {linear_type}
    state = load_gguf_state(tmp_path / GGUF_NAME, plans)
    reference = load_file(str(tiny_model_dir / "model.safetensors"))
    worst = max(float(np.abs(state[name].numpy() - reference[name]).max()) for name in state)
    assert worst <= tolerance


def test_the_quality_gate_scores_the_gguf_weights(tiny_model_dir, tmp_path):
    request = BuildRequest(
        source_dir=tiny_model_dir,
        name="tiny",
        version="1.0.0",
        quant=QuantSpec("int4", 32),
        store_dir=tmp_path / "store",
        gate=small_gate(min_top1_agreement=0.5),
        format="gguf",
    )
    result = build_artifact(request)
    quality = read_manifest(result.artifact_dir).quality
    assert quality is not None and quality.tokens == 128
    assert quality.top1_agreement >= 0.5 and quality.mean_kl > 0  # 4-bit weights differ from fp32
    with pytest.raises(QualityGateError):
        build_artifact(replace(request, gate=small_gate(max_mean_kl=1e-9), use_cache=False))


def test_int4_groups_other_than_32_are_refused(tiny_model_dir, tmp_path):
    with pytest.raises(BuildError, match="group size 128 has no GGUF type") as info:
        build_gguf(tiny_model_dir, tmp_path / "store", scheme="int4", group_size=128)
    assert "group_size: 32" in info.value.hint
    assert store_is_empty(tmp_path / "store")


def _one_tensor_changed(tiny_model_dir: Path, dest: Path) -> Path:
    """A 'fine-tune' of the tiny checkpoint in which only one MLP weight moved."""
    shutil.copytree(tiny_model_dir, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"] * np.float32(
        1.05
    )
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def test_a_gguf_delta_copies_unchanged_tensors_and_rebuilds_bit_exactly(tiny_model_dir, tmp_path):
    base = build_gguf(tiny_model_dir, tmp_path / "store")
    tuned = _one_tensor_changed(tiny_model_dir, tmp_path / "tuned")
    target = build_gguf(tuned, tmp_path / "store", version="1.0.1")
    patch = tmp_path / "v1-v2.sitspatch"
    summary = create_patch(base, target, patch)
    (gguf_file,) = [t for t in read_header(patch)[0].targets if t.path == GGUF_NAME]
    codecs = {s.name: s.codec for s in gguf_file.segments}
    assert codecs["blk.1.ffn_up.weight"] is not Codec.COPY
    changed = {name for name, codec in codecs.items() if codec is not Codec.COPY and "." in name}
    assert changed == {"blk.1.ffn_up.weight"}
    assert summary.size < (target / GGUF_NAME).stat().st_size / 4
    out = tmp_path / "applied"
    out.mkdir()
    apply_patch(patch, base, out)
    for name in (GGUF_NAME, "sits-manifest.json"):
        assert _file_sha(out / name) == _file_sha(target / name)


@pytest.mark.slow
def test_smollm2_q4_1_is_byte_identical_to_the_shipped_gguf(smollm2_gguf_dir):
    """Our export of the HF checkpoint reproduces llama.cpp's own Q4_1 file tensor for tensor
    (names, rotary layout, types, bytes): the checkpoint is that file, dequantized."""
    from deployer.build.demo_model import smollm2_gguf_path

    ours_path, theirs_path = smollm2_gguf_dir / GGUF_NAME, smollm2_gguf_path()
    ours, theirs = read_gguf_header(ours_path).by_name(), read_gguf_header(theirs_path).by_name()
    assert set(ours) == set(theirs)
    with ours_path.open("rb") as a, theirs_path.open("rb") as b:
        for name, mine in ours.items():
            a.seek(mine.offset)
            b.seek(theirs[name].offset)
            assert a.read(mine.length) == b.read(theirs[name].length), name
