"""Quantization maths and per-module scheme resolution (no files)."""

from __future__ import annotations

import pytest
import torch

from deployer.build.quantize import module_scheme, plan_tensor, quantize_int4, quantize_int8
from deployer.build.spec import GROUP_SIZES, Override, QuantSpec
from deployer.core.quant_layout import ZERO_LIMIT, dequantize_int4, dequantize_int8
from deployer.errors import BuildError


def _weight(out: int, inn: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(out, inn, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_int8_error_is_within_half_a_step_per_row():
    w = _weight(48, 96)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == (48,)
    err = (dequantize_int8(q, scale) - w).abs().amax(dim=1)
    assert torch.all(err <= scale.float() * 0.5 + 1e-6)
    assert q.abs().max() == 127  # the largest weight of a row uses the full range


@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_int4_roundtrip_is_close_and_padding_is_dropped(group_size):
    w = _weight(20, 160)  # 160 is not a multiple of 64 or 128: padded
    packed, scale, zero = quantize_int4(w, group_size)
    in_padded = -(-160 // group_size) * group_size
    assert packed.shape == (20, in_padded // 2) and packed.dtype == torch.uint8
    assert scale.shape == zero.shape == (20, in_padded // group_size)
    assert zero.dtype == torch.float16
    back = dequantize_int4(packed, scale, zero, 160)
    assert back.shape == w.shape
    step = scale.float().repeat_interleave(group_size, dim=1)[:, :160]
    assert torch.all((back - w).abs() <= step * 0.5 + 1e-6)


def test_int4_low_nibble_is_the_even_column():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 1.0, -1.0
    packed, scale, zero = quantize_int4(w, 32)
    s, z = float(scale[0, 0]), float(zero[0, 0])
    low, high = int(packed[0, 0]) & 0x0F, int(packed[0, 0]) >> 4
    assert (low - z) * s == pytest.approx(1.0, rel=1e-2)
    assert (high - z) * s == pytest.approx(-1.0, rel=1e-2)


def test_int4_handles_all_zero_rows():
    w = _weight(4, 64)
    w[1] = 0.0
    back = dequantize_int4(*quantize_int4(w, 32), 64)
    assert torch.all(back[1] == 0.0)
    q, scale = quantize_int8(torch.zeros(3, 8))
    assert torch.all(q == 0) and torch.all(scale == 1.0)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_int4_range_is_exact_for_one_signed_groups(sign):
    # A group of all-positive (or all-negative) weights uses all 16 levels over its own range:
    # forcing 0 into the range (artifact format 1) made the step of this group 3x coarser.
    w = sign * (0.02 + 0.01 * torch.rand(3, 64, generator=torch.Generator().manual_seed(1)))
    packed, scale, zero = quantize_int4(w, 32)
    back = dequantize_int4(packed, scale, zero, 64)
    low, high = w.reshape(3, 2, 32).amin(-1), w.reshape(3, 2, 32).amax(-1)
    assert torch.allclose(scale.float(), (high - low) / 15, rtol=2e-3)
    step = scale.float().repeat_interleave(32, dim=1)
    assert torch.all((back - w).abs() <= step * 0.5 + 1e-6)


def test_int4_keeps_zero_a_level_for_heavy_tailed_groups():
    # Mostly near-zero weights and one outlier: on the exact range no level sits near 0, and
    # every small weight would shift the same way; the grid through 0 keeps them (format 1's).
    w = torch.full((1, 32), 0.001)
    w[0, :16] = -0.001
    w[0, 0] = -1.0
    w[0, 1] = 0.9
    packed, scale, zero = quantize_int4(w, 32)
    assert float(zero[0, 0]) == round(float(zero[0, 0]))  # an integer zero point: 0 is a level
    back = dequantize_int4(packed, scale, zero, 32)
    assert torch.all(back[0, 2:] == 0.0)


def test_int4_zero_point_stays_small_for_ranges_far_from_zero():
    w = torch.full((2, 32), 3.0)
    w[1, 0] = 3.001
    packed, scale, zero = quantize_int4(w, 32)
    assert float(zero.abs().max()) <= ZERO_LIMIT + 15
    back = dequantize_int4(packed, scale, zero, 32)
    assert torch.all((back - w).abs() <= scale.float() * 0.5 + 1e-6)


def test_layered_preset_and_first_matching_override_wins():
    spec = QuantSpec("layered", 64, (Override("*.layers.0.*", "fp16"), Override("*.mlp.*", "int4")))
    assert module_scheme(spec, "model.layers.0.mlp.up_proj") == ("fp16", 64)
    assert module_scheme(spec, "model.layers.1.mlp.up_proj") == ("int4", 64)
    assert module_scheme(spec, "model.layers.1.self_attn.q_proj") == ("int4", 64)
    plain = QuantSpec("layered")
    assert module_scheme(plain, "model.layers.3.mlp.down_proj") == ("int8", 128)


def test_embeddings_head_and_norms_stay_float():
    spec = QuantSpec("int4", 32, (Override("*", "int4"),))
    emb = plan_tensor(spec, "model.embed_tokens.weight", (384, 64))
    assert [(t.dtype, t.shape) for t in emb.outputs] == [("F16", (384, 64))]
    norm = plan_tensor(spec, "model.norm.weight", (64,))
    assert norm.quant is None and norm.outputs[0].dtype == "F32"
    head = plan_tensor(QuantSpec("int8", overrides=(Override("lm_head", "fp32"),)), "lm_head.weight", (9, 4))
    assert head.outputs[0].dtype == "F32"


def test_int4_plan_records_padding():
    plan = plan_tensor(QuantSpec("int4", 128), "model.layers.0.mlp.gate_proj.weight", (160, 576))
    assert plan.quant.to_json() == {
        "scheme": "int4",
        "group_size": 128,
        "in": 576,
        "in_padded": 640,
        "out": 160,
    }
    assert [t.name for t in plan.outputs] == [
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.gate_proj.weight_scale",
        "model.layers.0.mlp.gate_proj.weight_zero",
    ]
    assert plan.outputs[0].shape == (160, 320)


@pytest.mark.parametrize(
    "make",
    [
        lambda: QuantSpec("int3"),
        lambda: QuantSpec("int4", 100),
        lambda: Override("*.mlp.*", "nf4"),
    ],
)
def test_bad_specs_are_refused(make):
    with pytest.raises(BuildError, match="use one of"):
        make()
