"""Weight-only quantization, one tensor at a time, in the device-neutral layout of
docs/artifact-format.md (described, and read back, by `deployer.core.quant_layout`).

* int8: symmetric, one fp16 scale per output channel.
* int4: asymmetric, per group of `g` input columns; the range of each group always includes 0,
  so the zero padding of the columns is exact and a zero weight stays zero.

`plan_tensor` decides what a source tensor becomes (pure, from its name and shape only), so the
artifact header can be written before any tensor is quantized.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

import torch

from deployer.build.spec import QuantSpec
from deployer.core.manifest import FLOAT_SCHEMES
from deployer.core.quant_layout import (
    MIN_SCALE,
    ROW_CHUNK,
    TORCH_DTYPES,
    ModuleQuant,
    fp16_scale,
    quantize_int8,
)
from deployer.errors import BuildError

FLOAT_DTYPES: dict[str, tuple[str, torch.dtype]] = {
    "fp32": ("F32", torch.float32),
    "fp16": ("F16", torch.float16),
    "bf16": ("BF16", torch.bfloat16),
}
# The head and embeddings stay in a float dtype: this one unless an override names another.
DEFAULT_HEAD_SCHEME = "fp16"


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as written to the artifact."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorPlan:
    """What one source tensor becomes: its module record (2-D weights only) and stored tensors."""

    source: str
    module: str | None
    quant: ModuleQuant | None
    outputs: tuple[StoredTensor, ...]


def module_scheme(spec: QuantSpec, module: str) -> tuple[str, int]:
    """(scheme, group size) for `module`, as deploy.yaml documents it.

    The first override whose pattern matches wins; then the "layered" preset picks int4 for
    attention and int8 for MLP modules (anything else fp16); otherwise the top-level scheme.
    """
    for override in spec.overrides:
        if fnmatch.fnmatchcase(module, override.pattern):
            return override.scheme, override.group_size or spec.group_size
    if spec.scheme == "layered":
        if ".self_attn." in module:
            return "int4", spec.group_size
        return ("int8" if ".mlp." in module else "fp16"), spec.group_size
    return spec.scheme, spec.group_size


def is_head_or_embedding(module: str) -> bool:
    """Embeddings and the output head are never integer-quantized (they stay float)."""
    return module == "lm_head" or module.endswith("embed_tokens")


def plan_tensor(spec: QuantSpec, name: str, shape: tuple[int, ...]) -> TensorPlan:
    """Decide how the source tensor `name` of `shape` is stored."""
    if len(shape) != 2 or not name.endswith(".weight"):
        # Norms and biases: small, and precision-sensitive.
        return TensorPlan(name, None, None, (StoredTensor(name, "F32", shape),))
    module = name[: -len(".weight")]
    scheme, group_size = module_scheme(spec, module)
    head_scheme = spec.scheme if spec.scheme in FLOAT_SCHEMES else DEFAULT_HEAD_SCHEME
    if is_head_or_embedding(module) and scheme not in FLOAT_SCHEMES:
        scheme = head_scheme
    out_features, in_features = shape
    if scheme == "int4":
        in_padded = math.ceil(in_features / group_size) * group_size
        groups = in_padded // group_size
        outputs: tuple[StoredTensor, ...] = (
            StoredTensor(name, "U8", (out_features, in_padded // 2)),
            StoredTensor(f"{name}_scale", "F16", (out_features, groups)),
            StoredTensor(f"{name}_zero", "U8", (out_features, groups)),
        )
        quant = ModuleQuant("int4", group_size, in_features, in_padded, out_features)
        return TensorPlan(name, module, quant, outputs)
    if scheme == "int8":
        outputs = (
            StoredTensor(name, "I8", shape),
            StoredTensor(f"{name}_scale", "F16", (out_features,)),
        )
        quant = ModuleQuant("int8", None, in_features, in_features, out_features)
        return TensorPlan(name, module, quant, outputs)
    dtype = FLOAT_DTYPES[scheme][0]
    quant = ModuleQuant(scheme, None, in_features, in_features, out_features)
    return TensorPlan(name, module, quant, (StoredTensor(name, dtype, shape),))


def quantize_tensor(plan: TensorPlan, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Quantize one source tensor per its plan; returns the stored tensors in plan order."""
    quant = plan.quant
    tensors: tuple[torch.Tensor, ...]
    if quant is not None and quant.scheme == "int8":
        tensors = quantize_int8(weight)
    elif quant is not None and quant.scheme == "int4":
        if quant.group_size is None:
            raise BuildError(f"internal: the int4 plan for {plan.source} has no group size")
        tensors = quantize_int4(weight, quant.group_size)
    else:
        tensors = (weight.to(FLOAT_DTYPES[quant.scheme if quant else "fp32"][1]).contiguous(),)
    result = {}
    for stored, tensor in zip(plan.outputs, tensors, strict=True):
        if tuple(tensor.shape) != stored.shape or tensor.dtype != TORCH_DTYPES[stored.dtype]:
            raise BuildError(f"internal: {stored.name} came out {tensor.dtype}{list(tensor.shape)}")
        result[stored.name] = tensor
    return result


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4: (packed uint8 [out, in_p/2], scale fp16 [out, in_p/g],
    zero uint8 [out, in_p/g]).

    (Clipping each group's range to minimize weight error was tried: it lowered the weight
    error on SmolLM2 but raised perplexity, so the plain min..max range is used.)
    """
    out_features, in_features = weight.shape
    in_padded = math.ceil(in_features / group_size) * group_size
    packed = torch.empty(out_features, in_padded // 2, dtype=torch.uint8)
    scale = torch.empty(out_features, in_padded // group_size, dtype=torch.float16)
    zero = torch.empty(out_features, in_padded // group_size, dtype=torch.uint8)
    for rows in range(0, out_features, ROW_CHUNK):
        chunk = slice(rows, rows + ROW_CHUNK)
        w = torch.nn.functional.pad(weight[chunk].float(), (0, in_padded - in_features))
        q, scale[chunk], zero[chunk] = _int4_groups(w.reshape(w.shape[0], -1, group_size))
        q = q.reshape(w.shape[0], in_padded)
        packed[chunk] = q[:, 0::2] | (q[:, 1::2] << 4)
    return packed, scale, zero


def _int4_groups(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize [rows, n, g] groups over their min..max range: (q, scale fp16, zero uint8).

    The zero point is rounded first and the scale then widened just enough that both ends of
    the range fit; otherwise the largest weights (which matter most) would be clipped.
    """
    low = groups.amin(dim=-1).clamp(max=0.0)
    high = groups.amax(dim=-1).clamp(min=0.0)
    zero = torch.round(-low / ((high - low) / 15.0).clamp(min=MIN_SCALE)).clamp_(0, 15)
    fit_high = torch.where(zero < 15, high / (15.0 - zero), torch.zeros_like(high))
    fit_low = torch.where(zero > 0, -low / zero.clamp(min=1.0), torch.zeros_like(low))
    # Round up to the next fp16 so the stored scale still fits the range.
    scale = fp16_scale(torch.maximum(fit_high, fit_low) * (1.0 + 2.0**-10))
    s = scale.float()
    q = (torch.round(groups / s[..., None]) + zero[..., None]).clamp_(0, 15)
    return q.to(torch.uint8), scale, zero.to(torch.uint8)
