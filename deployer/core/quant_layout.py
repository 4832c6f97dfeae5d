"""How quantized weights are stored in an artifact (docs/artifact-format.md), and how to read
them back to fp32: what the builder writes and the device agent reads. Quantization itself
lives here too, because the agent also uses it (an int8 output head and an int4 draft model,
see the torch loader).

* int8: symmetric, one fp16 scale per output channel; ``w = q * scale``.
* int4: asymmetric, per group of `g` input columns, fp16 scale and fp16 zero point; two values
  per byte, low nibble = even column; ``w = (q - zero) * scale``. The zero point is a float, so a
  group's range need not include 0 (Q4_1's float minimum in other units); each group takes that
  exact range or format 1's range through 0, whichever fits it better (`_int4_groups`). Columns
  are padded up to a multiple of `g` by repeating each row's last column (so padding never widens
  a group's range), and the padding is dropped when dequantizing. Artifact format 1 stored the
  zero point as uint8 0..15 (ranges always through 0); it reads back with the same formula.

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
# How far (in steps) a group's range may sit from 0: the zero point then stays within
# ZERO_LIMIT + 15, where fp16 holds it to 2^-6 of a step; a range further out is widened towards 0.
ZERO_LIMIT = 64.0


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
    zero fp16 [out, in_p/g]).

    (Clipping each group's range to minimize weight error was tried: it lowered the weight
    error on SmolLM2 but raised perplexity, so the plain min..max range is used.)
    """
    out_features, in_features = weight.shape
    in_padded = math.ceil(in_features / group_size) * group_size
    packed = torch.empty(out_features, in_padded // 2, dtype=torch.uint8)
    scale = torch.empty(out_features, in_padded // group_size, dtype=torch.float16)
    zero = torch.empty(out_features, in_padded // group_size, dtype=torch.float16)
    for rows in range(0, out_features, ROW_CHUNK):
        chunk = slice(rows, rows + ROW_CHUNK)
        q, scale[chunk], zero[chunk] = _int4_groups(_groups(weight[chunk].float(), group_size))
        packed[chunk] = pack_int4(q.reshape(q.shape[0], in_padded))
    return packed, scale, zero


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Levels 0..15 uint8 [out, in_p] -> two per byte, low nibble = even column: [out, in_p/2]."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def int4_grid(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) fp16 [out] that `quantize_int4` picks for one group of columns `weight`
    [out, <= group_size] (a last group narrower than `group_size` padded as it pads it); the
    error-compensating rounding (build/gptq.py) fixes a group's grid this way when it starts."""
    _, scale, zero = _int4_groups(_groups(weight.float(), group_size)[:, :1])
    return scale[:, 0], zero[:, 0]


def fake_quantize_int4(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32 [out, in]: what `quantize_int4` then `dequantize_int4` give, without packing (the
    activation-aware search quantizes every candidate scaling this way)."""
    q, scale, zero = _int4_groups(_groups(weight.float(), group_size))
    back = (q.float() - zero.float()[..., None]) * scale.float()[..., None]
    return back.reshape(weight.shape[0], -1)[:, : weight.shape[1]]


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """[rows, in] -> [rows, n, group_size], the columns padded by repeating the last one."""
    pad = -w.shape[1] % group_size
    if pad:
        w = torch.cat((w, w[:, -1:].expand(-1, pad)), dim=1)
    return w.reshape(w.shape[0], -1, group_size)


def _int4_groups(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize [rows, n, g] groups: (q, scale fp16, zero fp16), each group on the better of two
    grids (see `_grid_cost`):

    * its own min..max range with a fractional zero point: no level is wasted (Q4_1's grid);
    * a range stretched to include 0 with an integer zero point (format 1's grid): 0 is a level,
      so the many near-zero weights of a heavy-tailed group are not all shifted the same way.
    """
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    exact = _grid(groups, *_exact_range(low, high))
    through_zero = _grid(groups, *_range_through_zero(low, high))
    pick = _grid_cost(groups, *exact) <= _grid_cost(groups, *through_zero)
    q = torch.where(pick[..., None], exact[0], through_zero[0])
    scale = torch.where(pick, exact[1], through_zero[1])
    zero = torch.where(pick, exact[2], through_zero[2])
    return q.to(torch.uint8), scale, zero


def _exact_range(low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) fp16 spanning low..high, the range widened towards 0 only where |zero|
    would pass ZERO_LIMIT; the scale rounded up so the whole range fits in 0..15."""
    reach = ZERO_LIMIT / (15.0 + ZERO_LIMIT)
    low = torch.minimum(low, torch.where(low > 0, high * reach, low))
    high = torch.maximum(high, torch.where(high < 0, low * reach, high))
    scale = fp16_scale((high - low) / 15.0 * (1.0 + 2.0**-10))
    return scale, (-low / scale.float()).to(torch.float16)


def _range_through_zero(low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) fp16 with an integer zero point 0..15: the zero point is rounded first and
    the scale then widened just enough that both ends fit (the largest weights matter most)."""
    low, high = low.clamp(max=0.0), high.clamp(min=0.0)
    zero = torch.round(-low / ((high - low) / 15.0).clamp(min=MIN_SCALE)).clamp_(0, 15)
    fit_high = torch.where(zero < 15, high / (15.0 - zero), torch.zeros_like(high))
    fit_low = torch.where(zero > 0, -low / zero.clamp(min=1.0), torch.zeros_like(low))
    return fp16_scale(torch.maximum(fit_high, fit_low) * (1.0 + 2.0**-10)), zero.to(torch.float16)


def _grid(
    groups: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q as float, scale, zero): `groups` rounded to the levels (q - zero) * scale, q in 0..15."""
    q = torch.round(groups / scale.float()[..., None] + zero.float()[..., None]).clamp_(0, 15)
    return q, scale, zero


def _grid_cost(
    groups: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> torch.Tensor:
    """How much a grid's errors e of a group can move a layer's output sum(x * e): sum(e^2) for
    inputs that vary independently, plus sum(e)^2 for what they have in common (a mean); the two
    weigh the same when an input's mean is about its spread, what no calibration tells otherwise.
    Errors that all lean one way (a grid without 0 for a group of near-zero weights) cost more
    than their squares say."""
    error = (q - zero.float()[..., None]) * scale.float()[..., None] - groups
    return error.pow(2).sum(dim=-1) + error.sum(dim=-1).pow(2)


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
    """Packed int4 + group scales and zero points (uint8 in format 1, fp16 since) -> fp32
    [out, in_features] (padding dropped)."""
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
