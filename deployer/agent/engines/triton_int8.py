"""int8 weight-only matmul for CUDA in Triton: the weights stream as int8 and become bf16 in
registers, so a decode step reads half the bytes of bf16 weights.

torch's own `_weight_int8pack_mm` runs four kernels per call on CUDA and moves weights at 5-265
GB/s (FACTS.md), slower than bf16. This kernel is one launch: each program owns BLOCK_N output
columns for up to BLOCK_M rows of activations and walks K, `tl.dot` on the dequantized tile,
the per-channel scale applied once at the end. Made for decode batches (M <= MAX_M); larger M
(a long prefill) dequantizes the weight once and calls the bf16 matmul instead.

Imported only on CUDA devices (it needs triton); `qlinear` tries it and falls back when it is
missing or disagrees with the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# Rows of activations the kernel takes; a prefill beyond this uses dequantize + F.linear.
MAX_M = 64
BLOCK_K = 128


@triton.jit
def _int8_weight_matmul(  # unannotated: triton reads annotations as its own type hints
    x_ptr,  # noqa: ANN001
    w_ptr,  # noqa: ANN001
    s_ptr,  # noqa: ANN001
    y_ptr,  # noqa: ANN001
    M,  # noqa: ANN001
    N,  # noqa: ANN001
    K,  # noqa: ANN001
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(
            x_ptr + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0
        )
        w = tl.load(
            w_ptr + rn[None, :] * K + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0
        )
        acc += tl.dot(x, w.to(x.dtype))
    scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    y = acc * scale[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def int8_weight_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16/fp16) @ (weight int8 [N, K] * scales [N]).T -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_M:
        return F.linear(x, weight.to(x.dtype)) * scales.to(x.dtype)
    x = x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else MAX_M  # tl.dot needs 16 rows at least
    # Narrow column blocks for narrow layers, so enough programs fill the multiprocessors.
    block_n = 16 if n <= 4096 else 32
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _int8_weight_matmul[grid](
        x, weight, scales, y, m, n, k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K
    )
    return y
