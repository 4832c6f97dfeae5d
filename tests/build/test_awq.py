"""Calibrated int4: the AWQ folds leave the float model's function unchanged, GPTQ rounding lowers
a linear's output error on its calibration inputs (deterministically, in the same layout), the
layer-by-layer calibration pass matches the whole model's, the build records its calibration text
and stays byte-reproducible, and bad or reused calibration text is refused with a position."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from deployer.build import awq, gptq, quality
from deployer.build.demo_model import make_tiny_checkpoint
from deployer.build.pipeline import build_artifact
from deployer.build.quality import load_model
from deployer.build.source import iter_tensors, open_source
from deployer.build.spec import AwqSpec, BuildRequest, Override, QuantSpec
from deployer.core.calibration import DEFAULT_CALIBRATION, MIN_WORDS
from deployer.core.quant_layout import dequantize_int4, quantize_int4
from deployer.errors import BuildError
from tests.build.conftest import EVAL_TEXT, make_request, small_gate, store_is_empty

IDS = [5, 17, 42, 99, 7, 3, 250, 11, 64, 128, 31, 8]


def _logits(source_dir: Path, folds: awq.Folds | None) -> torch.Tensor:
    source = open_source(source_dir)
    state = {t.name: folds.apply(t.name, w) if folds else w.float() for t, w in iter_tensors(source)}
    with torch.inference_mode():
        return load_model(source, state)(torch.tensor([IDS])).logits[0]


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_scaling_alone_leaves_the_logits_unchanged(tmp_path, kv_heads):
    # kv_heads 2 of 4 heads is GQA (o_proj is not scaled); 4 scales o_proj through v_proj's rows.
    source_dir = make_tiny_checkpoint(tmp_path / "model", num_kv_heads=kv_heads)
    groups = awq.groups(open_source(source_dir))
    scaled = {name for g in groups for name in g.linears}
    assert ("model.layers.0.self_attn.o_proj" in scaled) == (kv_heads == 4)
    generator = torch.Generator().manual_seed(0)
    width = {g: 160 if g.linears[0].endswith("down_proj") else 64 for g in groups}
    scales = {g: torch.exp(torch.randn(width[g], generator=generator)) for g in groups}
    folds = awq.fold(scales, 0)
    before, after = _logits(source_dir, None), _logits(source_dir, folds)
    assert not torch.equal(before, after)  # the weights did change...
    assert torch.allclose(before, after, rtol=1e-4, atol=1e-4)  # ...the function did not


def test_the_layer_by_layer_pass_sees_what_the_whole_model_computes(tiny_model_dir):
    source = open_source(tiny_model_dir)
    ids = torch.tensor([IDS[:6], IDS[6:]])
    with torch.inference_mode():
        states = load_model(source)(ids, output_hidden_states=True).hidden_states
    stream = awq.LayerStream(source, ids)
    for index in range(len(states) - 1):
        assert torch.allclose(stream.hidden, states[index], atol=1e-5)
        layer = stream.advance(index, [f"model.layers.{index}.mlp.down_proj"])
        assert layer.inputs[f"model.layers.{index}.mlp.down_proj"].shape[0] == ids.numel()


def test_the_search_scales_int4_layers_and_the_build_records_it(tiny_model_dir, tmp_path):
    source = open_source(tiny_model_dir)
    calibration = awq.read_calibration(AwqSpec())
    folds = awq.search_folds(source, QuantSpec("int4", 32), AwqSpec(), calibration, lambda _: None)
    assert folds.tokens >= 256 and folds.columns and not folds.rounded
    assert all(name.endswith(".weight") for name in folds.columns)
    # A model stored in fp16 has nothing to protect from rounding: no scales.
    fp16 = awq.search_folds(source, QuantSpec("fp16"), AwqSpec(), calibration, lambda _: None)
    assert not fp16.columns and not fp16.rows

    result = build_artifact(make_request(tiny_model_dir, tmp_path / "store", "int4", 32, awq=AwqSpec()))
    manifest = json.loads((result.artifact_dir / "sits-manifest.json").read_text())
    assert manifest["format_version"] == 2
    assert manifest["quantization"]["spec"]["awq"] == {
        "calibration_sha256": calibration.sha256,
        "tokens": folds.tokens,
    }
    again = build_artifact(
        make_request(tiny_model_dir, tmp_path / "store2", "int4", 32, awq=AwqSpec(), use_cache=False)
    )
    assert again.artifact_id == result.artifact_id  # byte-reproducible


def _int4_layer(tiny_model_dir: Path, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, calibration inputs) of linear `name` of layer 0 of the tiny model."""
    source = open_source(tiny_model_dir)
    ids = quality.encode(source, awq.read_calibration(AwqSpec()).text)[:256]
    layer = awq.LayerStream(source, torch.tensor([ids])).advance(0, [name])
    return layer.weight(name), layer.inputs[name]


@pytest.mark.parametrize(
    ("name", "group"), [("mlp.down_proj", 32), ("self_attn.q_proj", 32), ("mlp.down_proj", 128)]
)
def test_gptq_rounding_lowers_a_layers_output_error_and_is_deterministic(tiny_model_dir, name, group):
    # down_proj has 160 inputs: with groups of 128 its second group is padded, as quantize_int4 pads.
    weight, x = _int4_layer(tiny_model_dir, f"model.layers.0.{name}")
    factor = gptq.inverse_factor(gptq.hessian(x))
    stored = gptq.quantize(weight, factor, group)
    plain = quantize_int4(weight, group)
    assert [(t.dtype, t.shape) for t in stored] == [(t.dtype, t.shape) for t in plain]

    def error(tensors: tuple[torch.Tensor, ...]) -> float:
        return float((x @ (dequantize_int4(*tensors, weight.shape[1]) - weight).t()).pow(2).mean())

    assert error(stored) < 0.8 * error(plain)
    again = gptq.quantize(weight, gptq.inverse_factor(gptq.hessian(x)), group)
    assert all(torch.equal(a, b) for a, b in zip(stored, again, strict=True))


def test_gptq_keeps_each_groups_grid_and_levels_within_it():
    # Uncorrelated inputs of equal spread: nothing to compensate beyond rounding itself, so every
    # level stays on the group's grid and the first column (no earlier error) rounds to nearest.
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 64, generator=generator)
    packed, scale, zero = gptq.quantize(weight, gptq.inverse_factor(torch.eye(64, dtype=torch.float64)), 32)
    plain = quantize_int4(weight, 32)
    assert torch.equal(scale[:, 0], plain[1][:, 0]) and torch.equal(zero[:, 0], plain[2][:, 0])
    assert torch.equal(packed[:, 0] & 0x0F, plain[0][:, 0] & 0x0F)


def test_a_gptq_build_rounds_every_int4_linear_and_is_reproducible(tiny_model_dir, tmp_path):
    source = open_source(tiny_model_dir)
    spec = QuantSpec("int4", 32, (Override("*.mlp.*", "int8"),))
    calibrated = AwqSpec(scales=False, gptq=True)
    folds = awq.search_folds(source, spec, calibrated, awq.read_calibration(AwqSpec()), lambda _: None)
    attention = {f"model.layers.{i}.self_attn.{n}_proj.weight" for i in range(2) for n in "qkvo"}
    assert set(folds.rounded) == attention and not folds.columns  # int8 MLP: not GPTQ's

    def build(store: str, awq_spec: AwqSpec) -> str:
        request = make_request(tiny_model_dir, tmp_path / store, "int4", 32, awq=awq_spec, use_cache=False)
        return build_artifact(request).artifact_id

    first = build("a", AwqSpec(gptq=True))
    assert build("b", AwqSpec(gptq=True)) == first  # byte-reproducible
    assert build("c", AwqSpec()) != first  # the rounding is part of what the id hashes


@pytest.mark.parametrize(
    ("content", "position", "message"),
    [
        (b"", "1:1", "is empty"),
        (b"  \n\n", "1:1", "is empty"),
        (b"plain words\nthen \xff\xfe binary", "2:6", "is not UTF-8 text (byte 0xff)"),
        (b"some text\x00\x01\x02", "1:10", "is not UTF-8 text (byte 0x00)"),
        (b"too few words here\n", "1:19", f"has 4 words; the scale search needs at least {MIN_WORDS}"),
    ],
    ids=["empty", "blank", "invalid-utf8", "nul", "too-short"],
)
def test_bad_calibration_text_is_refused_with_its_position(tmp_path, content, position, message):
    path = tmp_path / "calibration.txt"
    path.write_bytes(content)
    with pytest.raises(BuildError) as caught:
        awq.read_calibration(AwqSpec(path))
    assert f"{path}:{position}: model.quantization.calibration: the text {message}" in caught.value.message


def test_a_missing_calibration_file_names_the_field(tmp_path):
    with pytest.raises(BuildError, match=r"model\.quantization\.calibration cannot be read"):
        awq.read_calibration(AwqSpec(tmp_path / "nope.txt"))


def test_the_build_refuses_to_gate_on_its_calibration_text(tiny_model_dir, tmp_path):
    same = tmp_path / "copy-of-eval.txt"
    shutil.copyfile(EVAL_TEXT, same)
    request = make_request(
        tiny_model_dir, tmp_path / "store", "int4", 32, awq=AwqSpec(same), gate=small_gate()
    )
    with pytest.raises(BuildError, match=r"is the same text as model\.quality_gate\.eval_text"):
        build_artifact(request)
    assert store_is_empty(tmp_path / "store")


def test_the_default_calibration_text_is_not_the_example_eval_text():
    assert DEFAULT_CALIBRATION.read_bytes() != EVAL_TEXT.read_bytes()
    assert awq.read_calibration(AwqSpec()).path == DEFAULT_CALIBRATION


def test_awq_is_refused_for_gguf(tiny_model_dir, tmp_path):
    with pytest.raises(BuildError, match="not GGUF"):
        BuildRequest(
            tiny_model_dir, "t", "1.0.0", QuantSpec("int4", 32), tmp_path, format="gguf", awq=AwqSpec()
        )


def test_a_model_without_the_expected_norm_is_named(tmp_path):
    source_dir = make_tiny_checkpoint(tmp_path / "model")
    from safetensors.torch import load_file, save_file

    weights = load_file(source_dir / "model.safetensors")
    del weights["model.layers.1.post_attention_layernorm.weight"]
    save_file(weights, source_dir / "model.safetensors")
    with pytest.raises(BuildError, match=r"model\.layers\.1\.post_attention_layernorm\.weight"):
        awq.groups(open_source(source_dir))
