"""int8 / int4 artifacts: the packed aten kernels are used where they exist, fall back where they
cannot run, and give logits close to the fp32 model on the artifact's own dequantized weights."""

from __future__ import annotations

import pytest
import torch

from deployer.agent.engines.torch import native
from deployer.agent.engines.torch.qlinear import (
    KERNEL_DEQUANT,
    KERNEL_FP32_AVX2,
    KERNEL_INT4_CPU,
    KERNEL_INT8,
    KERNEL_LINEAR,
    KERNEL_ONEDNN,
    ONEDNN_MARGIN,
    TIMED_SWEEPS,
    FloatLinear,
    LinearWeights,
    OneDnnLinear,
    build_linear,
    choose_float_kernels,
)
from deployer.core.quant_layout import ModuleQuant, quantize_int4, quantize_int8
from deployer.errors import FormatError

PROMPT = "The capital of France is Paris. Hello, how are you today?"


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize(
    ("scheme", "group_size"),
    [("int8", 128), ("int4", 32), ("int4", 128)],
)
def test_packed_kernels_match_dequantized_fp32(
    scheme, group_size, tiny_model_dir, build, dequantized, engine_on, cpu_kernel
):
    kernel = cpu_kernel[scheme]
    artifact = build(tiny_model_dir, scheme, group_size)
    engine = engine_on(artifact, dtype="auto")
    kernels = engine.layer_kernels
    assert {k for name, k in kernels.items() if name != "lm_head"} == {kernel}
    assert engine.describe().kernel == kernel
    reference = engine_on(dequantized(artifact))
    ids = engine.encode(PROMPT)
    got, want = engine.logits(ids), reference.logits(ids)
    assert _relative_error(got, want) < 0.02  # bf16 activations, nothing more
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_unsupported_shapes_fall_back_to_dequant(
    odd_model_dir, build, dequantized, engine_on, torch_kernels_only
):
    # N = 72 is not a multiple of 16: the CPU int4 packer refuses the layer.
    torch.manual_seed(0)
    weight = torch.randn(72, 64)
    packed, scale, zero = quantize_int4(weight, 32)
    layout = ModuleQuant("int4", 32, 64, 64, 72)
    w = LinearWeights(packed, scale=scale, zero=zero)
    layer, kernel = build_linear("x", w, layout, torch.device("cpu"), torch.float32)
    assert kernel == KERNEL_DEQUANT
    from deployer.core.quant_layout import dequantize_int4

    x = torch.randn(3, 64)
    assert _relative_error(layer(x), x @ dequantize_int4(packed, scale, zero, 64).t()) < 1e-5
    # In the model, gate and up (72 each) run fused as one 144-wide layer, which packs.
    engine = engine_on(build(odd_model_dir, "int4", 32), dtype="auto")
    kernels = engine.layer_kernels
    assert kernels["model.layers.0.mlp.gate_proj"] == kernels["model.layers.0.mlp.up_proj"] == KERNEL_INT4_CPU
    ids = engine.encode(PROMPT)
    reference = engine_on(dequantized(build(odd_model_dir, "int4", 32)))
    assert _relative_error(engine.logits(ids), reference.logits(ids)) < 0.02


def test_int8_never_tries_the_kernel_where_it_would_crash(odd_model_dir, build, engine_on, cpu_kernel):
    # K = 72: torch's CPU _weight_int8pack_mm reads out of bounds; the layer must not use it.
    engine = engine_on(build(odd_model_dir, "int8"), dtype="auto")
    assert engine.layer_kernels["model.layers.0.mlp.down_proj"] == KERNEL_DEQUANT
    assert engine.layer_kernels["model.layers.0.mlp.gate_proj"] == cpu_kernel["int8"]
    assert engine.logits(engine.encode(PROMPT)).isfinite().all()


def test_quantized_models_run_an_int8_head_on_a_cpu(tiny_model_dir, build, engine_on, cpu_kernel):
    artifact = build(tiny_model_dir, "int4", 32)
    engine = engine_on(artifact, dtype="auto")
    float_head = engine_on(artifact, dtype="auto", quantize_head=False)
    assert engine.layer_kernels["lm_head"] == engine.describe().extra["head"] == cpu_kernel["int8"]
    assert float_head.layer_kernels["lm_head"] == KERNEL_LINEAR
    # fp32 models keep their float head (oneDNN or F.linear, whichever is timed faster here).
    assert engine_on(tiny_model_dir).layer_kernels["lm_head"] in (
        KERNEL_ONEDNN,
        KERNEL_LINEAR,
        KERNEL_FP32_AVX2,
    )
    ids = engine.encode(PROMPT)
    got, want = engine.logits(ids), float_head.logits(ids)
    assert got.dtype == torch.float32
    assert 0 < _relative_error(got, want) < 0.02
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_a_bf16_model_attends_in_fp32_on_a_cpu(tiny_model_dir, tiny_engine, engine_on):
    engine = engine_on(tiny_model_dir, dtype="bf16")
    extra = engine.describe().extra
    assert (extra["dtype"], extra["kv_cache"]) == ("bfloat16", "fp32")
    ids = engine.encode(PROMPT)
    got = engine.logits(ids)
    assert got.dtype == torch.float32
    assert _relative_error(got, tiny_engine.logits(ids)) < 0.02


def test_layered_artifact_mixes_kernels(tiny_model_dir, build, engine_on, cpu_kernel):
    engine = engine_on(build(tiny_model_dir, "layered"), dtype="auto")
    kernels = engine.layer_kernels
    assert kernels["model.layers.0.self_attn.q_proj"] == cpu_kernel["int4"]
    assert kernels["model.layers.0.mlp.up_proj"] == cpu_kernel["int8"]
    info = engine.describe()
    assert info.quantization == "layered"
    assert info.version == "1.0.0" and info.model == "tiny"


@pytest.mark.parametrize("scheme", ["fp16", "bf16"])
def test_float_artifacts_load(scheme, tiny_model_dir, tiny_engine, build, engine_on):
    engine = engine_on(build(tiny_model_dir, scheme), dtype="auto")
    assert set(engine.layer_kernels.values()) == {"linear"}
    ids = engine.encode(PROMPT)
    assert _relative_error(engine.logits(ids), tiny_engine.logits(ids)) < 0.02


def test_build_linear_rejects_tensors_that_contradict_the_layout():
    weight = torch.randn(32, 64)
    q, scale = quantize_int8(weight)
    layout = ModuleQuant("int8", None, 64, 64, 32)
    with pytest.raises(FormatError, match=r"x\.weight_scale: expected"):
        build_linear("x", LinearWeights(q, scale=scale[:16]), layout, torch.device("cpu"), torch.bfloat16)
    packed, s4, z4 = quantize_int4(weight, 32)
    layout4 = ModuleQuant("int4", 32, 64, 64, 32)
    with pytest.raises(FormatError, match=r"x\.weight_zero: expected"):
        build_linear("x", LinearWeights(packed, scale=s4), layout4, torch.device("cpu"), torch.bfloat16)
    bad_padding = ModuleQuant("int4", 32, 64, 96, 32)
    with pytest.raises(FormatError, match=r"inconsistent|expected"):
        build_linear(
            "x", LinearWeights(packed, scale=s4, zero=z4), bad_padding, torch.device("cpu"), torch.bfloat16
        )


def test_int4_padding_is_exact(torch_kernels_only):
    # K = 40 with group 32 pads to 64; padded activations must contribute nothing.
    torch.manual_seed(0)
    weight = torch.randn(48, 40)
    packed, scale, zero = quantize_int4(weight, 32)
    layout = ModuleQuant("int4", 32, 40, 64, 48)
    layer, kernel = build_linear(
        "x", LinearWeights(packed, scale=scale, zero=zero), layout, torch.device("cpu"), torch.float32
    )
    assert kernel == KERNEL_INT4_CPU
    from deployer.core.quant_layout import dequantize_int4

    x = torch.randn(5, 40)
    want = x @ dequantize_int4(packed, scale, zero, 40).t()
    assert _relative_error(layer(x), want) < 0.02


def test_fp32_on_a_cpu_runs_onednn_and_falls_back_to_f_linear(monkeypatch, torch_kernels_only):
    weight, bias, x = torch.randn(48, 64), torch.randn(48), torch.randn(3, 64)
    layer, kernel = build_linear("m", LinearWeights(weight, bias), None, torch.device("cpu"), torch.float32)
    assert kernel == KERNEL_ONEDNN
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)

    def missing(self, x):
        raise RuntimeError("no mkldnn in this build")

    monkeypatch.setattr(OneDnnLinear, "forward", missing)
    layer, kernel = build_linear("m", LinearWeights(weight, bias), None, torch.device("cpu"), torch.float32)
    assert kernel == KERNEL_LINEAR
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight, bias))


LAYERS_PER_SHAPE = 2


def _fake_timer(times: dict[tuple[type, int], list[float]]):
    """A timer that answers, per (layer class, output rows), the next of the listed seconds (the
    last one repeating): one entry per sweep, the warm-up first."""
    calls: dict[tuple[type, int], int] = {}

    def timer(layer, x):
        key = (type(layer), layer.weight.shape[0])
        n = calls.get(key, 0)
        calls[key] = n + 1
        return times[key][min(n // LAYERS_PER_SHAPE, len(times[key]) - 1)]

    return timer


def test_a_compiled_graph_keeps_onednn_linear_as_the_eager_layer_runs_it():
    torch.manual_seed(0)
    layer = OneDnnLinear(torch.randn(48, 64), torch.randn(48))
    graphs = []

    def record(gm, example_inputs):  # what dynamo hands a backend such as inductor
        graphs.append(str(gm.graph))
        return gm.forward

    x = torch.randn(3, 64)
    with torch.inference_mode():
        compiled = torch.compile(layer, backend=record, fullgraph=True)(x)
        eager = layer(x)
    assert "sits.onednn_linear" in graphs[0]  # not F.linear (MKL), which is slower on some CPUs
    assert torch.equal(compiled, eager)


def test_float_kernels_are_chosen_per_shape_by_their_timings():
    torch.manual_seed(0)
    layers = {
        f"{shape}{i}": OneDnnLinear(torch.randn(rows, 64), torch.randn(rows))
        for i in range(LAYERS_PER_SHAPE)
        for shape, rows in (("wide", 96), ("narrow", 32), ("tie", 48))
    }
    slow_start = [1e-6] + [2e-3] * TIMED_SWEEPS  # fast only in the warm-up, which must not count
    timer = _fake_timer(
        {
            (OneDnnLinear, 96): [5e-3, 1e-3, 9e-3, 1e-3],  # one noisy sweep: the best one counts
            (FloatLinear, 96): slow_start,
            (OneDnnLinear, 32): [3e-3],
            (FloatLinear, 32): [1e-3],
            # oneDNN a little faster, but inside the margin: F.linear stays.
            (OneDnnLinear, 48): [(ONEDNN_MARGIN + 0.05) * 1e-3],
            (FloatLinear, 48): [1e-3],
        }
    )
    choice = choose_float_kernels(layers, timer)
    want = {"wide": KERNEL_ONEDNN, "narrow": KERNEL_LINEAR, "tie": KERNEL_LINEAR}
    assert choice.kernels == {name: want[name[:-1]] for name in layers}
    x = torch.randn(3, 64)
    for name, layer in choice.layers.items():
        assert type(layer) is (OneDnnLinear if want[name[:-1]] == KERNEL_ONEDNN else FloatLinear)
        assert layer.weight.data_ptr() == layers[name].weight.data_ptr()  # not copied
        want_y = torch.nn.functional.linear(x, layers[name].weight, layers[name].bias)
        torch.testing.assert_close(layer(x), want_y, rtol=1e-5, atol=1e-5)
    # Each shape's sum over its layers, best of the timed sweeps.
    assert "96x64 mkldnn._linear_pointwise (linear 4.00 ms, oneDNN 2.00 ms)" in choice.note
    assert "32x64 linear (linear 2.00 ms, oneDNN 6.00 ms)" in choice.note


def test_the_loader_runs_each_fp32_layer_on_its_timed_kernel(
    tiny_model_dir, engine_on, monkeypatch, torch_kernels_only
):
    from deployer.agent.engines.torch import loader

    def f_linear_faster_for_qkv_only(layers):
        qkv = {m.weight.data_ptr() for n, m in layers.items() if n.endswith("qkv_proj")}

        def timer(layer, x):
            return 1e-3 if (type(layer) is FloatLinear) == (layer.weight.data_ptr() in qkv) else 2e-3

        return choose_float_kernels(layers, timer)

    monkeypatch.setattr(loader, "choose_float_kernels", f_linear_faster_for_qkv_only)
    engine = engine_on(tiny_model_dir)
    kernels = engine.layer_kernels
    # The fused q/k/v layer is reported under its members' names.
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert kernels[f"model.layers.0.self_attn.{proj}"] == KERNEL_LINEAR
    assert kernels["model.layers.0.mlp.down_proj"] == kernels["lm_head"] == KERNEL_ONEDNN
    assert engine.describe().kernel == f"{KERNEL_LINEAR}+{KERNEL_ONEDNN}"
    assert engine.describe().extra["kernel_choice"].startswith("timed at load, 1 row: ")
    # Why our CPU kernels serve or not, as native says it for this CPU (an Arm board: x86-only code).
    assert engine.describe().extra["cpu_kernels"] == (native.cpu_kernels()[1] or "ours")
    monkeypatch.undo()
    ids = engine.encode(PROMPT)
    torch.testing.assert_close(engine.logits(ids), engine_on(tiny_model_dir).logits(ids), rtol=0, atol=1e-4)


def test_a_kernel_wrong_only_for_prefill_sized_inputs_is_not_used(monkeypatch, torch_kernels_only):
    # Kernels with a tile per row bucket (the Triton int8 one) are probed at both a decode's and
    # a prefill chunk's row count; here the CPU int8 kernel is broken above 16 rows.
    from deployer.agent.engines.torch.qlinear import PROBE_ROWS, Int8PackLinear

    assert min(PROBE_ROWS) <= 16 < max(PROBE_ROWS)
    weight = torch.randn(32, 64)
    q, scale = quantize_int8(weight)
    layout = ModuleQuant("int8", None, 64, 64, 32)
    cpu = torch.device("cpu")
    assert build_linear("m", LinearWeights(q, None, scale), layout, cpu, torch.float32)[1] == KERNEL_INT8
    right = Int8PackLinear._mm

    def wrong_in_prefill(self, x2d):
        out = right(self, x2d)
        return -out if x2d.shape[0] > 16 else out

    monkeypatch.setattr(Int8PackLinear, "_mm", wrong_in_prefill)
    assert build_linear("m", LinearWeights(q, None, scale), layout, cpu, torch.float32)[1] == KERNEL_DEQUANT


@pytest.mark.parametrize("before", [None, 123])
def test_inductor_tunes_with_a_small_flush_while_a_cuda_engine_loads(before, monkeypatch):
    from torch._inductor.runtime.benchmarking import benchmarker

    from deployer.agent.engines.torch.compile import TUNING_FLUSH_BYTES, _small_tuning_flush

    # Whatever the benchmarker held before (nothing, or a size of its own) is what it holds after.
    if before is None:
        monkeypatch.delitem(benchmarker.__dict__, "L2_cache_size", raising=False)
    else:
        monkeypatch.setitem(benchmarker.__dict__, "L2_cache_size", before)
    with _small_tuning_flush(torch.device("cuda")):  # sets a number only: no GPU is touched
        assert benchmarker.L2_cache_size == TUNING_FLUSH_BYTES
    assert benchmarker.__dict__.get("L2_cache_size") == before
    with _small_tuning_flush(torch.device("cpu")):
        assert benchmarker.__dict__.get("L2_cache_size") == before
