"""int8 weight-only matmul for CUDA in Triton: the weights stream as int8 and become bf16 in
registers, so a decode step reads half the bytes of bf16 weights.

torch's own `_weight_int8pack_mm` runs four kernels per call on CUDA and moves weights at 5-265
GB/s (FACTS.md), slower than bf16. This kernel is one launch: each program owns BLOCK_N output
columns for up to BLOCK_M rows of activations and walks K, `tl.dot` on the dequantized tile,
the per-channel scale applied once at the end. Block shapes are autotuned per weight shape and
row bucket (16 rows for decode batches, 64 for short prefills) the first time a shape runs,
which the loader's probe and the warm-up before a CUDA-graph capture do. Larger M (a long
prefill) dequantizes the weight once and calls the bf16 matmul instead.

The kernel is registered as the custom op `sits::int8_weight_matmul`, so torch.compile treats it
as one opaque call (it neither traces into Triton nor re-tunes it) and CUDA graphs capture the
launch. Imported only on CUDA devices (it needs triton); `qlinear` tries it and falls back when
it is missing or disagrees with the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# Rows of activations the kernel takes; a prefill beyond this uses dequantize + F.linear.
MAX_M = 64
# tl.dot needs 16 rows at least: decode batches run in one 16-row block.
SMALL_M = 16

# (BLOCK_N, BLOCK_K, warps, stages): narrow column blocks put enough programs on the 132
# multiprocessors for narrow layers; deep K blocks and stages keep loads in flight.
_CONFIGS = [
    triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
    for n, k, w, s in (
        (16, 128, 4, 4),
        (16, 256, 4, 4),
        (32, 128, 4, 4),
        (32, 256, 4, 3),
        (64, 128, 4, 3),
        (64, 256, 4, 3),
        (128, 128, 8, 3),
    )
]


@triton.autotune(configs=_CONFIGS, key=["N", "K", "BLOCK_M"])
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
    x_ptrs = x_ptr + rm[:, None] * K + rk[None, :]
    w_ptrs = w_ptr + rn[None, :] * K + rk[:, None]  # [BLOCK_K, BLOCK_N] of the row-major [N, K]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_left = K - k0
        x = tl.load(x_ptrs, mask=(rm[:, None] < M) & (rk[None, :] < k_left), other=0.0)
        w = tl.load(w_ptrs, mask=(rn[None, :] < N) & (rk[:, None] < k_left), other=0)
        acc += tl.dot(x, w.to(x.dtype))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    y = acc * scale[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@torch.library.custom_op("sits::int8_weight_matmul", mutates_args=())
def int8_weight_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16/fp16) @ (weight int8 [N, K] * scales [N]).T -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_M:
        return F.linear(x, weight.to(x.dtype)) * scales.to(x.dtype)
    x = x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = SMALL_M if m <= SMALL_M else MAX_M

    def grid(meta: dict) -> tuple[int, int]:
        return (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, block_m))

    _int8_weight_matmul[grid](x, weight, scales, y, m, n, k, BLOCK_M=block_m)
    return y


@int8_weight_matmul.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))
