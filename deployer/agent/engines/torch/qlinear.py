"""Linear layers built at load time from the artifact's device-neutral weights.

The artifact stores int8 (per output channel) and int4 (group-wise, asymmetric) weights in one
layout for every device (docs/artifact-format.md); this module derives the packing the device's
kernels want (fp32 weights on a CPU run oneDNN's linear or MKL's, whichever `choose_float_kernels`
times faster on this machine). For each layer the candidates are tried in order — on an AVX2 CPU
our own kernels (native.py), then the fused aten kernel for this device, dequantize-once +
`F.linear` last — and a candidate is kept only if it runs and
agrees with the dequantized reference on a probe input. So an unsupported shape, a missing
kernel or a packing convention that differs on some device falls back instead of giving wrong
answers. `build_linear` says which kernel it chose; the engine reports it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deployer.agent.engines.torch import native
from deployer.core.manifest import INTEGER_SCHEMES
from deployer.core.quant_layout import ROW_CHUNK, ModuleQuant, dequantize_int4, dequantize_int8
from deployer.errors import FormatError

KERNEL_LINEAR = "linear"
KERNEL_ONEDNN = "mkldnn._linear_pointwise"
KERNEL_DEQUANT = "dequant+linear"
KERNEL_INT8 = "aten._weight_int8pack_mm"
KERNEL_INT8_TRITON = "triton int8 weight-only"
KERNEL_INT4_CPU = "aten._weight_int4pack_mm_for_cpu"
KERNEL_INT4_AVX2 = "sits.int4_linear (ours, AVX2)"
KERNEL_INT8_AVX2 = "sits.int8_linear (ours, AVX2)"
KERNEL_FP32_AVX2 = "sits.fp32_linear (ours, AVX2)"
KERNEL_INT4_CUDA = "aten._weight_int4pack_mm"

# torch 2.13's CPU _weight_int8pack_mm reads out of bounds (segfault, or wrong sums) unless K is
# a multiple of this; a crash cannot be caught by the probe, so such layers never try it.
INT8_CPU_K_MULTIPLE = 16
# Byte alignment of torch's allocator; packed kernels get weights at least this aligned.
ALIGNMENT = 64
# A packed kernel must match the dequantized reference this closely (relative L2) on the probe;
# bf16 activations alone cost about 1e-2.
PROBE_TOLERANCE = 5e-2
# The probe's row counts: a decode step's and a prefill chunk's (odd: some kernels tile by 2).
# Kernels with a tile per row bucket (triton_int8) are checked in both, and tuned for both here,
# while only the weights are in memory: tuned later, in the capture warm-ups, the int8 kernel's
# flush buffer (twice the L2, 120 MB on an H200) came on top of the KV cache.
PROBE_ROWS = (3, 17)
# choose_float_kernels: sweeps over every fp32 layer (a decode step's weight traffic) per kernel,
# best of this many after one warm-up sweep (the first touch of mapped pages, oneDNN's JIT).
TIMED_SWEEPS = 3
# oneDNN is kept only where it beats F.linear by this factor: a near-tie would otherwise flip
# between loads, and F.linear's sums are MKL's, the ones transformers computes.
ONEDNN_MARGIN = 0.9


_CPU = torch.device("cpu")


@dataclass(frozen=True)
class LinearWeights:
    """The stored tensors of one linear layer (still on the CPU, possibly memory-mapped)."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None


def _need(t: torch.Tensor | None, what: str) -> torch.Tensor:
    """A tensor a quantized layout must have (check_shapes has made sure; mypy cannot tell)."""
    if t is None:
        raise FormatError(f"a quantized layer has no {what}", hint="the artifact is incomplete; rebuild it")
    return t


def _dequantized(w: LinearWeights, layout: ModuleQuant | None) -> torch.Tensor:
    """The fp32 weight [out, in] that the stored tensors stand for (artifact-format.md)."""
    if layout is None or layout.scheme not in INTEGER_SCHEMES:
        return w.weight.float()
    if layout.scheme == "int8":
        return dequantize_int8(w.weight, _need(w.scale, "weight_scale"))
    scale, zero = _need(w.scale, "weight_scale"), _need(w.zero, "weight_zero")
    return dequantize_int4(w.weight, scale, zero, layout.in_features)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """U8 [out, in_p/2] -> int32 [out, in_p] values 0..15; low nibble is the even column."""
    low = (packed & 0x0F).to(torch.int32)
    high = (packed >> 4).to(torch.int32)
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1)


def check_shapes(name: str, w: LinearWeights, layout: ModuleQuant) -> None:
    """Raise FormatError unless the stored tensors have the shapes and dtypes `layout` implies."""
    out, n_in = layout.out_features, layout.in_features
    if layout.scheme == "int8":
        expected: dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...] | None]] = {
            "weight": ((out, n_in), (torch.int8,)),
            "weight_scale": ((out,), None),
        }
    elif layout.scheme == "int4":
        g, in_p = layout.group_size, layout.in_padded
        if not g or not in_p or in_p % g or in_p % 2 or in_p < n_in or in_p - n_in >= g:
            raise FormatError(
                f"{name}: int4 layout in={n_in} in_padded={in_p} group_size={g} is inconsistent"
            )
        groups = (out, in_p // g)
        expected = {
            "weight": ((out, in_p // 2), (torch.uint8,)),
            "weight_scale": (groups, None),
            # uint8 0..15 in artifact format 1, fp16 (exact-range) since: same formula.
            "weight_zero": (groups, (torch.uint8, torch.float16)),
        }
    else:
        expected = {"weight": ((out, n_in), None)}
    found = {"weight": w.weight, "weight_scale": w.scale, "weight_zero": w.zero}
    for key, (shape, dtypes) in expected.items():
        t = found[key]
        if t is None or tuple(t.shape) != shape or (dtypes is not None and t.dtype not in dtypes):
            got = None if t is None else f"{t.dtype} {list(t.shape)}"
            want = " or ".join(map(str, dtypes)) if dtypes else "float"
            raise FormatError(
                f"{name}.{key}: expected {want} {list(shape)} for {layout.scheme}, found {got}",
                hint="the artifact does not match its manifest; rebuild it",
            )


class FloatLinear(nn.Module):
    """A plain linear layer on float weights."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T + bias."""
        return F.linear(x, self.weight, self.bias)


@torch.library.custom_op("sits::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear on fp32 weights as stored, as an op a compiled graph calls as it is:
    inductor lowers `mkldnn._linear_pointwise` only for weights frozen into the graph, and with
    `F.linear` in its place a compiled SmolLM2 fp32 step took 48 ms where eager oneDNN steps took
    36 (the 2-core AMD EPYC with AVX-512, where oneDNN reads twice as fast as MKL); through this
    op, 31."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear.register_fake
def _onednn_linear_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class OneDnnLinear(FloatLinear):
    """fp32 weights [out, in] as stored, through oneDNN's linear (`mkldnn._linear_pointwise`, the
    op inductor's CPU backend emits for a linear layer).

    At one row a token, decode is a stream over the weights: for SmolLM2's 121 fp32 matrices
    oneDNN read them at 26 GB/s where F.linear (MKL) reached 16 GB/s, 2 threads on the 2-core
    AMD EPYC; on the Intel Xeon VM MKL was faster (24 against 18 GB/s), so the loader times both
    (choose_float_kernels). The sums differ from MKL's in the last bits only.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T + bias."""
        if torch.compiler.is_compiling():
            return onednn_linear(x, self.weight, self.bias)  # see onednn_linear
        # Eager, straight to the op: the custom op's dispatch would cost microseconds a layer.
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


class Fp32Avx2Linear(FloatLinear):
    """fp32 weights [out, in] as stored, through our AVX2 kernel (native.py): on AVX2-only CPUs
    MKL and oneDNN read SmolLM2's fp32 weights at 6-14 GB/s at one row a token."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernels: native.CpuKernels) -> None:
        if weight.dtype != torch.float32 or weight.shape[1] % native.BLOCK:
            raise NotImplementedError(f"fp32 {weight.shape[0]}x{weight.shape[1]} does not fit our kernel")
        super().__init__(weight.contiguous(), bias)
        self._op = kernels.fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T + bias."""
        y = self._op(x.reshape(-1, x.shape[-1]).contiguous(), self.weight).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


# Seconds one call of a layer on an input takes (choose_float_kernels; tests pass their own).
Timer = Callable[[nn.Module, torch.Tensor], float]


def time_call(layer: nn.Module, x: torch.Tensor) -> float:
    """Wall-clock seconds of `layer(x)` (CPU kernels return when done)."""
    start = time.perf_counter()
    layer(x)
    return time.perf_counter() - start


@dataclass(frozen=True)
class FloatKernelChoice:
    """What choose_float_kernels picked: the layer to run under each name, its kernel, and a
    line naming each weight shape's two timings."""

    layers: dict[str, nn.Module]
    kernels: dict[str, str]
    note: str


@torch.inference_mode()
def choose_float_kernels(layers: dict[str, OneDnnLinear], timer: Timer = time_call) -> FloatKernelChoice:
    """oneDNN's linear or F.linear (MKL) for each weight shape of `layers` (fp32, on a CPU, in the
    order a decode step runs them), whichever a one-row input runs faster.

    Each kernel sweeps all the layers in turn, as decode does, so weights stream from memory
    rather than from a cache that a single repeated layer would sit in. A shape's time is the
    sum over its layers, best of TIMED_SWEEPS; oneDNN must win by ONEDNN_MARGIN.
    """
    plain: dict[str, nn.Module] = {n: FloatLinear(layer.weight, layer.bias) for n, layer in layers.items()}
    candidates: dict[str, dict[str, nn.Module]] = {KERNEL_ONEDNN: dict(layers), KERNEL_LINEAR: plain}
    inputs = {n: torch.randn(1, layer.weight.shape[1]) for n, layer in layers.items()}
    shapes = {name: tuple(layer.weight.shape) for name, layer in layers.items()}
    best: dict[tuple[str, tuple[int, ...]], float] = {}
    for sweep in range(1 + TIMED_SWEEPS):
        for kernel, chosen in candidates.items():
            totals: dict[tuple[str, tuple[int, ...]], float] = {}
            for name, layer in chosen.items():
                key = (kernel, shapes[name])
                totals[key] = totals.get(key, 0.0) + timer(layer, inputs[name])
            if sweep:  # the first is the warm-up
                best.update({k: min(t, best.get(k, t)) for k, t in totals.items()})
    winner, notes = {}, []
    for shape in dict.fromkeys(shapes.values()):
        onednn, linear = best[(KERNEL_ONEDNN, shape)], best[(KERNEL_LINEAR, shape)]
        winner[shape] = KERNEL_ONEDNN if onednn < ONEDNN_MARGIN * linear else KERNEL_LINEAR
        shown = "x".join(map(str, shape))
        notes.append(f"{shown} {winner[shape]} (linear {linear * 1e3:.2f} ms, oneDNN {onednn * 1e3:.2f} ms)")
    kernels = {name: winner[shapes[name]] for name in layers}
    picked = {name: candidates[kernels[name]][name] for name in layers}
    note = "timed at load, 1 row: " + "; ".join(notes) if notes else "-"
    return FloatKernelChoice(picked, kernels, note)


class _PackedLinear(nn.Module):
    """Shared frame of the packed kernels: pad K, flatten, cast to the kernel's dtype, add bias."""

    def __init__(self, in_features: int, in_padded: int, act_dtype: torch.dtype, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.in_padded, self.act_dtype = in_features, in_padded, act_dtype
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def _mm(self, x2d: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the packed matmul on x [..., in]."""
        # Casts only where the dtypes differ: a decode step makes 120 of these calls, and even a
        # cast to the same dtype costs a dispatch (about 1 us on a CPU).
        x2d = x.reshape(-1, x.shape[-1])
        if x2d.dtype != self.act_dtype:
            x2d = x2d.to(self.act_dtype)
        if self.in_padded != self.in_features:
            # Zero activations make the padded columns vanish exactly, whatever they hold.
            x2d = F.pad(x2d, (0, self.in_padded - self.in_features))
        y = self._mm(x2d).view(*x.shape[:-1], -1)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias


class Int8PackLinear(_PackedLinear):
    """int8 weights [out, in] used as stored; `aten._weight_int8pack_mm` (CPU and CUDA)."""

    qweight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, w: LinearWeights, act_dtype: torch.dtype, device: torch.device):
        n_in = w.weight.shape[1]
        super().__init__(n_in, n_in, act_dtype, _maybe(w.bias, device, act_dtype))
        self.register_buffer("qweight", _aligned(w.weight.to(device)))
        self.register_buffer("scales", _need(w.scale, "weight_scale").to(device, act_dtype))

    def _mm(self, x2d: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x2d, self.qweight, self.scales)


class Int8TritonLinear(_PackedLinear):
    """int8 weights [out, in] used as stored; the Triton kernel of `triton_int8` (CUDA)."""

    qweight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, w: LinearWeights, act_dtype: torch.dtype, device: torch.device):
        from deployer.agent.engines.torch.triton_int8 import int8_weight_matmul

        n_in = w.weight.shape[1]
        super().__init__(n_in, n_in, act_dtype, _maybe(w.bias, device, act_dtype))
        self._matmul = int8_weight_matmul
        self.register_buffer("qweight", w.weight.to(device).contiguous())
        self.register_buffer("scales", _need(w.scale, "weight_scale").to(device, act_dtype))

    def _mm(self, x2d: torch.Tensor) -> torch.Tensor:
        return self._matmul(x2d, self.qweight, self.scales)


class Int4PackLinear(_PackedLinear):
    """int4 weights packed for `_weight_int4pack_mm_for_cpu` (CPU) or `_weight_int4pack_mm` (CUDA).

    Both kernels compute w = (q - 8) * scale + bias_term per group, so our zero point maps to
    bias_term = (8 - zero) * scale.
    """

    def __init__(self, w: LinearWeights, layout: ModuleQuant, act_dtype: torch.dtype, device: torch.device):
        super().__init__(layout.in_features, layout.in_padded, act_dtype, _maybe(w.bias, device, act_dtype))
        self.group_size = layout.group_size
        self.on_cuda = device.type == "cuda"
        scale = _need(w.scale, "weight_scale").float()
        shift = (8.0 - _need(w.zero, "weight_zero").float()) * scale
        sz = torch.stack((scale.t(), shift.t()), dim=-1).contiguous()
        self.register_buffer("scales_and_zeros", sz.to(device, act_dtype))
        if self.on_cuda:
            # The CUDA packer takes bytes with the even column in the HIGH nibble.
            swapped = ((w.weight & 0x0F) << 4) | (w.weight >> 4)
            tiles = _inner_k_tiles(layout.in_padded)
            packed = torch.ops.aten._convert_weight_to_int4pack(swapped.to(device), tiles)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(w.weight), 2)
        self.register_buffer("packed", packed)

    def _mm(self, x2d: torch.Tensor) -> torch.Tensor:
        if self.on_cuda:
            return torch.ops.aten._weight_int4pack_mm(
                x2d, self.packed, self.group_size, self.scales_and_zeros
            )
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2d, self.packed, self.group_size, self.scales_and_zeros
        )


class _Avx2Linear(_PackedLinear):
    """Shared frame of our AVX2 kernels (native.py): activations in the model's dtype (fp32 or
    bf16, what the kernel returns too: compiled graphs then round where eager code does),
    quantized to int16 per 32 columns inside the kernel; out_features a multiple of native.ROWS,
    in_padded of native.BLOCK."""

    def __init__(self, w: LinearWeights, layout: ModuleQuant, dtype: torch.dtype, group: int = native.BLOCK):
        act = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        super().__init__(layout.in_features, layout.in_padded, act, _maybe(w.bias, _CPU, act))
        if layout.out_features % native.ROWS or layout.in_padded % native.BLOCK or group % native.BLOCK:
            shape = f"{layout.scheme} {layout.out_features}x{layout.in_padded}"
            raise NotImplementedError(f"{shape} (group {group}) does not fit our kernel's blocks")
        self.out_features = layout.out_features


class Int4Avx2Linear(_Avx2Linear):
    """int4 weights repacked for `sits::int4_linear`."""

    def __init__(self, w: LinearWeights, layout: ModuleQuant, dtype: torch.dtype, kernels: native.CpuKernels):
        group = layout.group_size or 0
        super().__init__(w, layout, dtype, group or 1)
        self._op = kernels.int4
        scale, zero = _need(w.scale, "weight_scale"), _need(w.zero, "weight_zero")
        self.register_buffer("packed", native.pack_int4(w.weight, scale, zero, group))

    def _mm(self, x2d: torch.Tensor) -> torch.Tensor:
        return self._op(x2d.contiguous(), self.packed, self.out_features)


class Int8Avx2Linear(_Avx2Linear):
    """int8 weights (scaled per output row) repacked for `sits::int8_linear`."""

    scales: torch.Tensor

    def __init__(self, w: LinearWeights, layout: ModuleQuant, dtype: torch.dtype, kernels: native.CpuKernels):
        super().__init__(w, layout, dtype)
        self._op = kernels.int8
        self.register_buffer("packed", native.pack_int8(w.weight))
        self.register_buffer("scales", _need(w.scale, "weight_scale").float().contiguous())

    def _mm(self, x2d: torch.Tensor) -> torch.Tensor:
        return self._op(x2d.contiguous(), self.packed, self.scales, self.out_features)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, copied if its data is not 64-byte aligned: a memory-mapped tensor is only 8-byte
    aligned, and the CPU _weight_int8pack_mm segfaults below 16."""
    return t if t.data_ptr() % ALIGNMENT == 0 else t.clone()


def _inner_k_tiles(k: int) -> int:
    return next((t for t in (8, 4, 2) if k % (t * 16) == 0), 2)


def _maybe(t: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(device, dtype)


def build_linear(
    name: str,
    w: LinearWeights,
    layout: ModuleQuant | None,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[nn.Module, str]:
    """The fastest working layer for these weights on `device`, and the kernel's name.

    `layout` None or a float scheme means float weights, used as they are when dtype and device
    already match (a memory-mapped fp32 tensor is not copied); fp32 on a CPU runs oneDNN's linear
    where it works (OneDnnLinear), until choose_float_kernels times it against F.linear. Raises
    FormatError when the tensors contradict the layout.
    """
    if layout is None or layout.scheme not in INTEGER_SCHEMES:
        if layout is not None:
            check_shapes(name, w, layout)
        weight, bias = w.weight.to(device, dtype), _maybe(w.bias, device, dtype)
        ours = native.cpu_kernels()[0] if device.type == "cpu" and dtype == torch.float32 else None
        if ours is not None:
            mine = _try(lambda: Fp32Avx2Linear(weight, bias, ours))
            if mine is not None and _agrees(mine, *_probe(w, None), device, dtype):
                return mine, KERNEL_FP32_AVX2
        if device.type == "cpu" and dtype == torch.float32:
            onednn = _try(lambda: OneDnnLinear(weight, bias))
            if onednn is not None and _agrees(onednn, *_probe(w, None), device, dtype):
                return onednn, KERNEL_ONEDNN
        return FloatLinear(weight, bias), KERNEL_LINEAR
    check_shapes(name, w, layout)
    probe = _probe(w, layout)
    for kernel, make in _candidates(w, layout, device, dtype):
        layer = _try(make)
        if layer is not None and _agrees(layer, *probe, device, dtype):
            return layer, kernel
    weight = _dequantized(w, layout).to(device, dtype)
    return FloatLinear(weight, _maybe(w.bias, device, dtype)), KERNEL_DEQUANT


def _candidates(
    w: LinearWeights, layout: ModuleQuant, device: torch.device, dtype: torch.dtype
) -> list[tuple[str, Callable[[], nn.Module]]]:
    # The CPU kernels are fastest with bf16 activations; CUDA ones want bf16 (int4) or the model dtype.
    act = torch.bfloat16 if device.type == "cpu" or layout.scheme == "int4" else dtype
    ours = native.cpu_kernels()[0] if device.type == "cpu" else None
    mine: list[tuple[str, Callable[[], nn.Module]]] = []
    if layout.scheme == "int8":
        mine = [] if ours is None else [(KERNEL_INT8_AVX2, lambda: Int8Avx2Linear(w, layout, dtype, ours))]
        if device.type == "cpu" and layout.in_features % INT8_CPU_K_MULTIPLE:
            return mine
        aten = (KERNEL_INT8, lambda: Int8PackLinear(w, act, device))
        if device.type == "cuda" and act in (torch.bfloat16, torch.float16):
            # On CUDA the aten kernel is slower than bf16 (FACTS.md); the Triton one is tried first.
            return [(KERNEL_INT8_TRITON, lambda: Int8TritonLinear(w, act, device)), aten]
        return [*mine, aten]
    if device.type == "cuda":
        return [(KERNEL_INT4_CUDA, lambda: Int4PackLinear(w, layout, act, device))]
    mine = [] if ours is None else [(KERNEL_INT4_AVX2, lambda: Int4Avx2Linear(w, layout, dtype, ours))]
    return [*mine, (KERNEL_INT4_CPU, lambda: Int4PackLinear(w, layout, act, device))]


def _try(make: Callable[[], nn.Module]) -> nn.Module | None:
    try:
        return make()
    except (RuntimeError, NotImplementedError, ImportError):
        # The kernel does not exist on this build/device (no triton), or refuses this shape.
        return None


@torch.inference_mode()
def _probe(w: LinearWeights, layout: ModuleQuant | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A probe input x [PROBE_ROWS[-1], in] and x @ W.T for the weights W the stored tensors
    stand for, dequantized a chunk of rows at a time: a whole 49152-row head in fp32 would add
    about 250 MB to the agent's peak memory at load."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_ROWS[-1], layout.in_features if layout else w.weight.shape[1], generator=gen)
    parts = []
    for start in range(0, w.weight.shape[0], ROW_CHUNK):
        rows = slice(start, start + ROW_CHUNK)
        scale, zero = (None if t is None else t[rows] for t in (w.scale, w.zero))
        parts.append(x @ _dequantized(LinearWeights(w.weight[rows], None, scale, zero), layout).t())
    return x, torch.cat(parts, dim=1)


@torch.inference_mode()
def _agrees(
    layer: nn.Module, x: torch.Tensor, expected: torch.Tensor, device: torch.device, dtype: torch.dtype
) -> bool:
    for rows in PROBE_ROWS:
        try:
            got = layer(x[:rows].to(device, dtype)).float().cpu()
        except Exception:  # a kernel that fails to build or run here (triton raises its own kinds)
            return False
        if layer.bias is not None:
            got = got - layer.bias.float().cpu()
        want = expected[:rows]
        if not (got - want).norm() / want.norm().clamp_min(1e-12) < PROBE_TOLERANCE:
            return False
    return True
