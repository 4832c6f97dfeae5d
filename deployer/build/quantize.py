"""Weight-only quantization, one tensor at a time, in the device-neutral layout of
docs/artifact-format.md (described, and read back, by `deployer.core.quant_layout`).

* int8: symmetric, one fp16 scale per output channel.
* int4: asymmetric, per group of `g` input columns, over each group's own min..max range (an
  fp16 zero point, so the range need not include 0; artifact format 2).

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
from deployer.core.quant_layout import TORCH_DTYPES, ModuleQuant, quantize_int4, quantize_int8
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
    "auto" arrives here resolved (`mixed.choose`): its choices are overrides naming each decoder
    linear, and what it does not choose (embeddings, head) stays fp16.
    """
    for override in spec.overrides:
        if fnmatch.fnmatchcase(module, override.pattern):
            return override.scheme, override.group_size or spec.group_size
    if spec.scheme == "layered":
        if ".self_attn." in module:
            return "int4", spec.group_size
        return ("int8" if ".mlp." in module else "fp16"), spec.group_size
    if spec.scheme == "auto":
        return DEFAULT_HEAD_SCHEME, spec.group_size
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
            StoredTensor(f"{name}_zero", "F16", (out_features, groups)),
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


def quantize_tensor(
    plan: TensorPlan,
    weight: torch.Tensor,
    rounded: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Quantize one source tensor per its plan; returns the stored tensors in plan order.
    `rounded`: an int4 weight's tensors already rounded by GPTQ (build/gptq.py), stored as given."""
    quant = plan.quant
    tensors: tuple[torch.Tensor, ...]
    if quant is not None and quant.scheme == "int8":
        tensors = quantize_int8(weight)
    elif quant is not None and quant.scheme == "int4":
        if quant.group_size is None:
            raise BuildError(f"internal: the int4 plan for {plan.source} has no group size")
        tensors = rounded or quantize_int4(weight, quant.group_size)
    else:
        tensors = (weight.to(FLOAT_DTYPES[quant.scheme if quant else "fp32"][1]).contiguous(),)
    result = {}
    for stored, tensor in zip(plan.outputs, tensors, strict=True):
        if tuple(tensor.shape) != stored.shape or tensor.dtype != TORCH_DTYPES[stored.dtype]:
            raise BuildError(f"internal: {stored.name} came out {tensor.dtype}{list(tensor.shape)}")
        result[stored.name] = tensor
    return result
