"""The linear kernels of the torch engine on CUDA, one projection at a time: which scheme streams
its weights fastest at decode batch sizes (the evidence behind the CUDA rows of
docs/torch-engine.md's "which weights suit which target").

For every projection of the GPU bench's shapes (bench/engine_gpu.py), bf16 `F.linear`, int4-g32
`_weight_int4pack_mm`, int8 through the Triton kernel and int8 through `_weight_int8pack_mm`,
each built by `qlinear` from the builder's own quantized tensors, at M = 1, 16 and 32 rows. Times
are medians of CUDA-graph replays (no launch gaps, as inside the engine's decode graph) over
enough copies of the layer that the weights do not sit in the 60 MB L2 between calls.

    PYTHONPATH=. python bench/linear_kernels.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bench.engine_gpu import SHAPES
from deployer.agent.engines.torch.qlinear import (
    FloatLinear,
    Int4PackLinear,
    Int8PackLinear,
    Int8TritonLinear,
    LinearWeights,
)
from deployer.core.quant_layout import ModuleQuant, quantize_int4, quantize_int8

ROWS = (1, 16, 32)
KERNELS = ("bf16", "int4-g32", "int8 triton", "int8 aten")
# Enough copies of a layer that one pass over them is several L2s; at most this many.
STREAMED_BYTES, MAX_COPIES = 256 * 2**20, 64


def projections(c: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each matmul of one decoder layer (fused as the loader fuses them) and the head."""
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    dim, inter = c["hidden_size"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    return {
        "qkv": (q + 2 * kv, dim),
        "o": (dim, q),
        "gate_up": (2 * inter, dim),
        "down": (dim, inter),
        "lm_head": (c["vocab_size"], dim),
    }


def makers(out: int, n_in: int) -> dict[str, Callable[[], torch.nn.Module]]:
    """A maker of each kernel's layer for one random weight."""
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    w = torch.randn(out, n_in, device=dev) * 0.02
    q8, s8 = quantize_int8(w)
    packed, s4, z4 = quantize_int4(w.cpu(), 32)
    int8 = LinearWeights(q8.cpu(), scale=s8.cpu())
    int4 = LinearWeights(packed, scale=s4, zero=z4)
    layout4 = ModuleQuant("int4", 32, n_in, s4.shape[1] * 32, out)
    return {
        "bf16": lambda: FloatLinear(w.to(bf16).clone(), None),
        "int4-g32": lambda: Int4PackLinear(int4, layout4, bf16, dev),
        "int8 triton": lambda: Int8TritonLinear(int8, bf16, dev),
        "int8 aten": lambda: Int8PackLinear(int8, bf16, dev),
    }


@torch.inference_mode()
def time_kernel(make: Callable[[], torch.nn.Module], rows: int, n_in: int) -> tuple[float, int]:
    """Median microseconds of one call with the weights streamed from HBM, and the weight bytes."""
    import triton.testing

    first = make()
    nbytes = sum(t.nbytes for t in (*first.parameters(), *first.buffers()))
    copies = [first] + [make() for _ in range(min(MAX_COPIES, STREAMED_BYTES // nbytes) - 1)]
    x = torch.randn(rows, n_in, device="cuda", dtype=torch.bfloat16)
    for c in copies:
        c(x)  # autotune and warm up outside the graph

    def run() -> None:
        for c in copies:
            c(x)

    ms = triton.testing.do_bench_cudagraph(run, rep=50, return_mode="median")
    return 1000 * ms / len(copies), nbytes


def main() -> None:
    """Print one line per (shape, projection, rows, kernel): microseconds and weight GB/s."""
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'shape':14} {'proj':8} {'M':>3} " + " ".join(f"{k:>22}" for k in KERNELS))
    for shape, config in SHAPES.items():
        if shape == "tiny":
            continue
        for proj, (out, n_in) in projections(config).items():
            made = makers(out, n_in)
            for rows in ROWS:
                cells = []
                for kernel in KERNELS:
                    if proj == "lm_head" and kernel != "bf16":
                        cells.append(f"{'-':>22}")
                        continue
                    us, nbytes = time_kernel(made[kernel], rows, n_in)
                    cells.append(f"{us:9.1f} us {nbytes / us / 1e3:6.0f} GB/s")
                print(f"{shape:14} {proj:8} {rows:3} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
