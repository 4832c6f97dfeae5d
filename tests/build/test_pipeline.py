"""End-to-end builds of the tiny checkpoint: schemes, reproducibility, cache, gate, bad input."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from deployer.build.artifact import load_state_dict, read_manifest
from deployer.build.pipeline import build_artifact
from deployer.core.hashing import sha256_bytes, sha256_file
from deployer.core.manifest import MANIFEST_NAME
from deployer.core.safetensors_io import read_header
from deployer.errors import BuildError, QualityGateError, SourceModelError
from tests.build.conftest import make_request, small_gate, store_is_empty

SCHEMES = [
    ("fp32", 128),
    ("fp16", 128),
    ("bf16", 128),
    ("int8", 128),
    ("int4", 32),
    ("int4", 64),
    ("int4", 128),
    ("layered", 64),
]


class CountingProgress:
    """Records how many tensors were quantized."""

    def __init__(self):
        self.tensors = 0

    def stage(self, text):
        pass

    def start_tensors(self, total, total_bytes):
        pass

    def tensor_done(self, name, nbytes):
        self.tensors += 1

    def close(self):
        pass


def _source_weights(source: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


@pytest.mark.parametrize(("scheme", "group_size"), SCHEMES)
def test_every_scheme_builds_a_valid_artifact_close_to_the_source(
    tiny_model_dir, tmp_path, scheme, group_size
):
    result = build_artifact(make_request(tiny_model_dir, tmp_path, scheme, group_size))
    art = result.artifact_dir
    assert art.parent.name == "artifacts" and art.name == result.artifact_id
    assert sha256_file(art / MANIFEST_NAME) == result.artifact_id
    manifest = read_manifest(art)
    assert sorted(manifest.files) == sorted(p.name for p in art.iterdir() if p.name != MANIFEST_NAME)
    for name, info in manifest.files.items():
        assert sha256_file(art / name) == info.sha256
    header = read_header(art / "model.safetensors")
    assert {e.name for e in header.tensors} == set(manifest.tensors)
    with (art / "model.safetensors").open("rb") as f:
        for entry in header.tensors:
            f.seek(entry.offset)
            info = manifest.tensors[entry.name]
            assert sha256_bytes(f.read(entry.length)) == info.sha256
            assert (info.dtype, tuple(info.shape)) == (entry.dtype, entry.shape)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (art / name).read_bytes() == (tiny_model_dir / name).read_bytes()

    source = _source_weights(tiny_model_dir)
    loaded = load_state_dict(art)
    assert set(loaded) == set(source)
    tolerance = {"fp32": 0, "fp16": 1e-3, "bf16": 1e-2, "int8": 0.01, "int4": 0.15, "layered": 0.15}
    for name, w in source.items():
        rel = float((loaded[name] - w).norm() / w.norm())
        assert rel <= tolerance[scheme], (name, rel)


def test_int4_records_padding_in_the_manifest(tiny_model_dir, tmp_path):
    art = build_artifact(make_request(tiny_model_dir, tmp_path, "int4", 128)).artifact_dir
    modules = read_manifest(art).quantization.modules
    down = modules["model.layers.0.mlp.down_proj"]  # in = 160, padded to 256
    assert (down.in_features, down.in_padded, down.group_size) == (160, 256, 128)
    assert read_manifest(art).tensors["model.layers.0.mlp.down_proj.weight"].shape == [64, 128]
    assert modules["model.embed_tokens"].scheme == "fp16"


def test_two_builds_are_byte_identical(tiny_model_dir, tmp_path):
    a = build_artifact(make_request(tiny_model_dir, tmp_path / "a", "int4", 64, gate=small_gate()))
    b = build_artifact(make_request(tiny_model_dir, tmp_path / "b", "int4", 64, gate=small_gate()))
    assert a.artifact_id == b.artifact_id
    for path in a.artifact_dir.iterdir():
        assert path.read_bytes() == (b.artifact_dir / path.name).read_bytes()
    other = build_artifact(make_request(tiny_model_dir, tmp_path / "c", "int4", 32))
    assert other.artifact_id != a.artifact_id


def test_unchanged_rebuild_is_a_cache_hit_that_does_no_work(tiny_model_dir, tmp_path):
    first = build_artifact(make_request(tiny_model_dir, tmp_path, "int8"))
    progress = CountingProgress()
    again = build_artifact(make_request(tiny_model_dir, tmp_path, "int8"), progress=progress)
    assert (again.cached, again.artifact_id, progress.tensors) == (True, first.artifact_id, 0)
    forced = build_artifact(
        make_request(tiny_model_dir, tmp_path, "int8", use_cache=False), progress=progress
    )
    assert not forced.cached and progress.tensors > 0 and forced.artifact_id == first.artifact_id


def test_a_damaged_cached_artifact_is_rebuilt(tiny_model_dir, tmp_path):
    first = build_artifact(make_request(tiny_model_dir, tmp_path, "int8"))
    (first.artifact_dir / "model.safetensors").write_bytes(b"truncated")
    again = build_artifact(make_request(tiny_model_dir, tmp_path, "int8"))
    assert not again.cached and again.artifact_id == first.artifact_id
    assert (again.artifact_dir / "model.safetensors").stat().st_size > 1000


def test_gate_reports_figures_and_a_tight_gate_fails_leaving_nothing(tiny_model_dir, tmp_path):
    ok = build_artifact(make_request(tiny_model_dir, tmp_path / "ok", "int8", gate=small_gate()))
    quality = read_manifest(ok.artifact_dir).quality
    assert quality.tokens == 128 and quality.top1_agreement > 0.9
    assert quality.perplexity.reference > 1 and quality.mean_kl >= 0
    tight = small_gate(max_perplexity_increase_pct=0.0, min_top1_agreement=1.0, max_mean_kl=0.0)
    store = tmp_path / "tight"
    with pytest.raises(QualityGateError) as info:
        build_artifact(make_request(tiny_model_dir, store, "int4", 128, gate=tight))
    assert "quality gate failed" in info.value.message and "FAILED: mean KL" in info.value.message
    assert info.value.report["mean_kl"] > 0 and info.value.report["failures"]
    assert store_is_empty(store)


def test_a_cached_artifact_is_still_judged_by_todays_limits(tiny_model_dir, tmp_path):
    build_artifact(make_request(tiny_model_dir, tmp_path, "int4", 32, gate=small_gate()))
    with pytest.raises(QualityGateError):
        build_artifact(make_request(tiny_model_dir, tmp_path, "int4", 32, gate=small_gate(max_mean_kl=0.0)))


def test_fp32_artifact_gives_the_same_logits_as_transformers(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from deployer.build.quality import load_model
    from deployer.build.source import open_source

    art = build_artifact(make_request(tiny_model_dir, tmp_path, "fp32")).artifact_dir
    ours = load_model(open_source(tiny_model_dir), load_state_dict(art))
    theirs = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 42, 7, 100, 3]])
    with torch.inference_mode():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)


def _truncate(model: Path) -> None:
    path = model / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def _bad_json(model: Path) -> None:
    path = model / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"{{{{"
    path.write_bytes(bytes(data))


def _huge_header_length(model: Path) -> None:
    path = model / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", len(data) * 2) + data[8:])


def _int64_tensor(model: Path) -> None:
    from safetensors.torch import save_file

    tensors = _source_weights(model)
    tensors["model.layers.0.extra"] = torch.arange(4, dtype=torch.int64)
    save_file(tensors, str(model / "model.safetensors"))


def _gpt2(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model / "config.json").write_text(json.dumps(config))


def _no_weights(model: Path) -> None:
    (model / "model.safetensors").unlink()


def _shard(model: Path) -> None:
    """Rewrite the checkpoint as two shards and an index, as Hugging Face exports big models."""
    from safetensors.torch import save_file

    tensors = _source_weights(model)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:7], "model-00002-of-00002.safetensors": names[7:]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(model / shard))
    (model / "model.safetensors").unlink()
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))


def _missing_shard(model: Path) -> None:
    _shard(model)
    (model / "model-00002-of-00002.safetensors").unlink()


def _truncated_shard(model: Path) -> None:
    _shard(model)
    path = model / "model-00002-of-00002.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def _index_names_a_missing_tensor(model: Path) -> None:
    _shard(model)
    path = model / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["weight_map"]["model.layers.0.mlp.ghost.weight"] = "model-00001-of-00002.safetensors"
    path.write_text(json.dumps(index))


def _tensor_missing(model: Path) -> None:
    from safetensors.torch import save_file

    tensors = _source_weights(model)
    del tensors["model.norm.weight"]
    save_file(tensors, str(model / "model.safetensors"))


def _config_does_not_match(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    config["intermediate_size"] += 8
    (model / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_truncate, "past the end of the file"),
        (_bad_json, "not valid JSON"),
        (_huge_header_length, "header length .* is larger than the file"),
        (_int64_tensor, "dtype I64, which cannot be quantized"),
        (_gpt2, "architecture 'GPT2LMHeadModel' is not supported"),
        (_no_weights, "no model.safetensors"),
        (_missing_shard, "weight file 'model-00002-of-00002.safetensors' is missing"),
        (_truncated_shard, "model-00002-of-00002.safetensors.*past the end of the file"),
        (_index_names_a_missing_tensor, "names tensor 'model.layers.0.mlp.ghost.weight' in model-00001"),
        (_tensor_missing, "no tensor 'model.norm.weight', which its config.json"),
        (
            _config_does_not_match,
            r"model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' has shape \[160, 64\], "
            r"but config.json says \[168, 64\]",
        ),
    ],
)
def test_bad_source_gives_a_clear_error_and_leaves_nothing(tiny_copy, tmp_path, damage, message):
    damage(tiny_copy)
    store = tmp_path / "store"
    with pytest.raises(SourceModelError, match=message) as info:
        build_artifact(make_request(tiny_copy, store, "int8"))
    assert str(tiny_copy) in info.value.message
    assert store_is_empty(store)


def test_missing_eval_text_fails_before_any_work(tiny_model_dir, tmp_path):
    gate = small_gate().__class__(eval_text=tmp_path / "nope.txt")
    with pytest.raises(BuildError, match="eval_text not found"):
        build_artifact(make_request(tiny_model_dir, tmp_path / "s", "int8", gate=gate))
    assert store_is_empty(tmp_path / "s")


def test_sharded_source_gives_the_same_tensors(tiny_model_dir, tiny_copy, tmp_path):
    _shard(tiny_copy)
    single = read_manifest(build_artifact(make_request(tiny_model_dir, tmp_path / "a")).artifact_dir)
    sharded = read_manifest(build_artifact(make_request(tiny_copy, tmp_path / "b")).artifact_dir)
    assert sharded.tensors == single.tensors
    assert sharded.source.sha256 != single.source.sha256
