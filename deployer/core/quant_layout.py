"""How quantized weights are stored in an artifact (docs/artifact-format.md), and how to read
them back to fp32: what the builder writes and the device agent reads. Quantization itself
lives here too, because the agent also uses it (an int8 output head and an int4 draft model,
see the torch loader).

* int8: symmetric, one fp16 scale per output channel; ``w = q * scale``.
* int4: asymmetric, per group of `g` input columns, fp16 scale and uint8 zero point (0..15);
  two values per byte, low nibble = even column; ``w = (q - zero) * scale``. Columns are padded
  with zeros up to a multiple of `g`, and the padding is dropped when dequantizing.

Imports only torch and the standard library (no build code), so the device agent can use it.
The scheme names themselves live in `deployer.core.manifest`, which needs no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

# Safetensors dtype names of stored tensors -> torch dtypes.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I8": torch.int8,
    "U8": torch.uint8,
}
# Smallest positive fp16 (subnormal): a scale never rounds to zero, so q = w / scale is finite.
MIN_SCALE = 2.0**-24
# Rows quantized at once: bounds the fp32 temporaries for large matrices.
ROW_CHUNK = 1024


@dataclass(frozen=True)
class ModuleQuant:
    """How one 2-D weight was stored: the manifest's `quantization.modules` entry."""

    scheme: str
    group_size: int | None
    in_features: int
    in_padded: int
    out_features: int

    def to_json(self) -> dict[str, Any]:
        """Manifest form."""
        return {
            "scheme": self.scheme,
            "group_size": self.group_size,
            "in": self.in_features,
            "in_padded": self.in_padded,
            "out": self.out_features,
        }


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q int8 [out, in], scale fp16 [out]).

    The builder stores int8 modules this way; the torch engine also derives an int8 output head
    from a float one with it (loader).
    """
    q = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0], dtype=torch.float16)
    # In chunks of rows: fp32 temporaries of a whole 49152x576 head would add about 250 MB to the
    # agent's peak memory at load.
    for rows in range(0, weight.shape[0], ROW_CHUNK):
        w = weight[rows : rows + ROW_CHUNK].float()
        scale[rows : rows + ROW_CHUNK] = chunk_scale = fp16_scale(w.abs().amax(dim=1) / 127.0)
        q[rows : rows + ROW_CHUNK] = torch.round(w / chunk_scale.float()[:, None]).clamp_(-127, 127)
    return q, scale


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


def fp16_scale(scale: torch.Tensor) -> torch.Tensor:
    """Round scales to fp16 (what is stored), never to zero: all-zero rows get scale 1."""
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale.clamp(min=MIN_SCALE).to(torch.float16)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 + per-row scale -> fp32."""
    return q.float() * scale.float()[:, None]


def dequantize_int4(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, in_features: int
) -> torch.Tensor:
    """Packed int4 + group scales and zeros -> fp32 [out, in_features] (padding dropped)."""
    out_features = packed.shape[0]
    q = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(out_features, -1)
    group_size = q.shape[1] // scale.shape[1]
    zeros = zero.float().repeat_interleave(group_size, dim=1)
    scales = scale.float().repeat_interleave(group_size, dim=1)
    return ((q.float() - zeros) * scales)[:, :in_features]


def dequantize(name: str, quant: ModuleQuant | None, stored: dict[str, torch.Tensor]) -> torch.Tensor:
    """The fp32 weight `name` that the stored tensors represent under `quant`."""
    if quant is None:
        return stored[name].float()
    if quant.scheme == "int8":
        return dequantize_int8(stored[name], stored[f"{name}_scale"])
    if quant.scheme == "int4":
        return dequantize_int4(
            stored[name], stored[f"{name}_scale"], stored[f"{name}_zero"], quant.in_features
        )
    return stored[name].float()
