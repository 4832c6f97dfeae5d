"""Fused elementwise kernels for the CUDA decode step, in Triton: one launch where torch runs two
or three.

A decode step of a small model is launch-bound: SmolLM2-135M's 30 layers read their weights in
well under a millisecond on an H100, and each extra kernel a layer launches costs a few
microseconds of it. exact_ops keeps RMSNorm, SiLU and softmax opaque to inductor (so compiled
and eager steps agree bit for bit), which also stops inductor from fusing them with their
neighbours. These kernels do those fusions by hand, and exact_ops calls them both compiled and
eager, so the agreement stays:

* `add_rms_norm`: the residual add and the next RMSNorm (two kernels in torch);
* `silu_mul`: SwiGLU's silu(gate) * up (two);
* `masked_softmax`: the decode step's scale, mask, fp32 softmax and the cast back (three).

Each computes in fp32 and rounds once, where torch rounds after each op: the results differ
from torch's by a rounding, which is why exact_ops uses them for both paths or for neither.
Imported only on CUDA devices (it needs triton); exact_ops falls back to torch's ops without it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns one program of masked_softmax reads at a time: it walks longer caches in chunks.
SOFTMAX_BLOCK = 1024
# Columns one program of silu_mul owns.
SILU_BLOCK = 1024


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, h_ptr, y_ptr, n, eps, BLOCK: tl.constexpr):  # noqa: ANN001 (Triton kernel)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    keep = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=keep, other=0.0)
    d = tl.load(d_ptr + row * n + cols, mask=keep, other=0.0)
    h = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)  # the residual stream keeps its dtype
    tl.store(h_ptr + row * n + cols, h, mask=keep)
    hf = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n + cols, (hf * inv * w).to(x.dtype), mask=keep)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, n, g_stride, u_stride, BLOCK: tl.constexpr):  # noqa: ANN001 (Triton kernel)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < n
    g = tl.load(g_ptr + row * g_stride + cols, mask=keep, other=0.0)
    u = tl.load(u_ptr + row * u_stride + cols, mask=keep, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    tl.store(y_ptr + row * n + cols, (gf / (1.0 + tl.exp(-gf)) * u).to(g.dtype), mask=keep)


@triton.jit
def _scaled_chunk(s_row, m_row, cols, n, scale):  # noqa: ANN001 (Triton function)
    """Scores at `cols` of one row times scale, in fp32; -inf where hidden or past the row."""
    hidden = tl.load(m_row + cols, mask=cols < n, other=1) != 0
    s = tl.load(s_row + cols, mask=cols < n, other=0.0).to(tl.float32) * scale
    return tl.where(hidden, float("-inf"), s)


@triton.jit
def _masked_softmax_kernel(s_ptr, m_ptr, y_ptr, n, rows_per_mask, scale, BLOCK: tl.constexpr):  # noqa: ANN001 (Triton kernel)
    row = tl.program_id(0).to(tl.int64)
    s_row, m_row = s_ptr + row * n, m_ptr + (row // rows_per_mask) * n
    top = tl.full((), float("-inf"), tl.float32)
    total = tl.zeros((), tl.float32)  # of exp(s - top)
    for start in range(0, n, BLOCK):  # the running max and sum (online softmax)
        s = _scaled_chunk(s_row, m_row, start + tl.arange(0, BLOCK), n, scale)
        new_top = tl.maximum(top, tl.max(s, axis=0))
        # While every key so far is hidden (a sliding window), top is -inf and total 0: no
        # exp(-inf - -inf) then.
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)
        kept = tl.where(top == float("-inf"), 0.0, total * tl.exp(top - shift))
        total = kept + tl.sum(tl.exp(s - shift), axis=0)
        top = new_top
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        s = _scaled_chunk(s_row, m_row, cols, n, scale)
        tl.store(y_ptr + row * n + cols, (tl.exp(s - top) / total).to(y_ptr.dtype.element_ty), mask=cols < n)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y): h = x + delta, y = RMSNorm(h) * weight over the last dimension, in one launch."""
    n = x.shape[-1]
    x, delta = x.contiguous(), delta.contiguous()
    h, y = torch.empty_like(x), torch.empty_like(x)
    _add_rms_norm_kernel[(x.numel() // n,)](x, delta, weight, h, y, n, eps, BLOCK=triton.next_power_of_2(n))
    return h, y


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [..., n] gate and up whose rows may be strided (the two halves of one
    gate_up projection), in one launch; the result is contiguous."""
    n = gate.shape[-1]
    g, u = gate.reshape(-1, n), up.reshape(-1, n)  # views: rows of a chunk are evenly strided
    if g.stride(-1) != 1:
        g = g.contiguous()
    if u.stride(-1) != 1:
        u = u.contiguous()
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    grid = (g.shape[0], triton.cdiv(n, SILU_BLOCK))
    _silu_mul_kernel[grid](g, u, y, n, g.stride(0), u.stride(0), BLOCK=SILU_BLOCK)
    return y


def masked_softmax(scores: torch.Tensor, hidden: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scores * scale) over the last dimension with the keys where `hidden` is True
    left out, in fp32, returned in scores' dtype. `hidden` [B, 1, 1, L] masks scores
    [B, ..., L] (every row of one batch row alike)."""
    n = scores.shape[-1]
    s = scores.contiguous()
    m = hidden.reshape(hidden.shape[0], n).contiguous().view(torch.uint8)
    y = torch.empty_like(s)
    rows = s.numel() // n
    _masked_softmax_kernel[(rows,)](s, m, y, n, rows // m.shape[0], scale, BLOCK=SOFTMAX_BLOCK)
    return y
