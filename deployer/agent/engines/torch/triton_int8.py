"""int8 weight-only matmul for CUDA in Triton: the weights stream as int8 and become bf16 in
registers, so a decode step reads half the bytes of bf16 weights.

torch's own `_weight_int8pack_mm` runs four kernels per call on CUDA and moves weights at 5-265
GB/s (FACTS.md), slower than bf16. This kernel is one launch: each program owns BLOCK_N output
columns for up to BLOCK_M rows of activations and walks K, `tl.dot` on the dequantized tile,
the per-channel scale applied once at the end. Block shapes are autotuned per weight shape and
row bucket (16 rows for decode batches, 64 for short prefills) the first time a shape runs,
which the loader's probe and the warm-up before a CUDA-graph capture do; the choice is kept in
Triton's cache directory, so a restart does not tune again. Tuning flushes the L2 cache between
runs with a buffer of twice its size (`_bench`), not the 256 MB one of triton's own `do_bench`,
which would be the largest allocation of a small model's load. Larger M (a long prefill) dequantizes
the weight once and calls the bf16 matmul instead.

The kernel is registered as the custom op `sits::int8_weight_matmul`, so torch.compile treats it
as one opaque call (it neither traces into Triton nor re-tunes it) and CUDA graphs capture the
launch. Imported only on CUDA devices (it needs triton); `qlinear` tries it and falls back when
it is missing or disagrees with the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


# Timed runs per config when tuning, and the flush buffer's size in L2 sizes.
_BENCH_RUNS = 50
_FLUSH_L2S = 2

Bench = Callable[[Callable[[], object], Sequence[float]], list[float]]


def flushed_bench(l2s: int, runs: int = _BENCH_RUNS) -> Bench:
    """An autotuner timing function: milliseconds of a kernel call at the asked quantiles over
    `runs` runs (CUDA events), each after zeroing a buffer of `l2s` times the L2's size."""

    def bench(kernel_call: Callable[[], object], quantiles: Sequence[float]) -> list[float]:
        kernel_call()  # compiles this config; a failure here is the autotuner's to handle
        size = l2s * torch.cuda.get_device_properties().L2_cache_size
        flush = torch.empty(size // 4, dtype=torch.int32, device="cuda")
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)
        ]
        for start, end in events:
            flush.zero_()
            start.record()
            kernel_call()
            end.record()
        torch.cuda.synchronize()
        times = sorted(start.elapsed_time(end) for start, end in events)
        return [times[min(len(times) - 1, int(q * len(times)))] for q in quantiles]

    return bench


# Twice the L2: on the H200, timed against each config's cold cost (bench/int8_tuning.py), an
# L2-sized flush (inductor's) left weights cached and picked configs 1.19x slower on average,
# twice the L2 1.01x, triton's 256 MB 1.02x. Transient memory of a few MB on an edge board, 120 MB
# on an H200.
_bench = flushed_bench(_FLUSH_L2S)


@triton.autotune(configs=_CONFIGS, key=["N", "K", "BLOCK_M"], do_bench=_bench, cache_results=True)
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
