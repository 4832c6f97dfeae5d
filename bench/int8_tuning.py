"""Which block shapes each way of timing picks for the Triton int8 kernel (GPU only).

The autotuner of `deployer/agent/engines/torch/triton_int8.py` times every config after an L2 flush.
A decode step streams 30 layers of weights, so what counts is a config's cold cost: here each
config runs in a CUDA graph over enough weight copies to fill three L2s, and each timing method
is scored by the cold cost of the config it picks, against the best (1.00x). Shapes: the fused
projections of SmolLM2-135M and of a Qwen2.5-1.5B-like model, at 1 and 16 rows (decode).

    PYTHONPATH=. python bench/int8_tuning.py

Measured on the H200 (2026-12-02, this file): triton's own do_bench (a 256 MB flush) 1.018x the
best cold cost on average, worst 1.11x; an L2-sized flush, 50 runs, 1.213x, worst 1.64x; 200 runs
1.290x, worst 1.92x; twice the L2 (the engine's choice) 1.051x, worst 1.52x; four times 1.021x,
worst 1.10x. The day before, by the one-off script this file was cleaned up from: 1.016x, 1.186x,
1.144x, 1.010x and 1.005x on average (docs/torch-engine.md).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deployer.agent.engines.torch import triton_int8

# (N, K) of the qkv, o, gate+up and down projections, as the loader fuses them.
SHAPES = {
    "SmolLM2-135M": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
    "Qwen2.5-1.5B": [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)],
}
QUANTILES = (0.5, 0.2, 0.8)  # what triton's autotuner asks for
GRAPH_REPLAYS = 10


def launcher(args: tuple, m: int, n: int, config: Any) -> Callable[[], None]:
    """One launch of the kernel under `config` (a triton.Config) for M rows (BLOCK_M 16)."""
    import triton

    kernel = triton_int8._int8_weight_matmul.fn  # the jitted kernel under the autotuner
    kw = config.all_kwargs()
    grid = (triton.cdiv(n, kw["BLOCK_N"]), triton.cdiv(m, triton_int8.SMALL_M))

    def run() -> None:
        kernel[grid](*args, BLOCK_M=triton_int8.SMALL_M, **kw)

    return run


def cold_us(calls: list[Callable[[], None]]) -> float:
    """Microseconds per call of `calls` (one per weight copy) replayed in a CUDA graph."""
    for call in calls:
        call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(GRAPH_REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / (GRAPH_REPLAYS * len(calls))


def main() -> None:
    """Print, per shape, each config's cold cost and each method's pick; then each method's score."""
    import triton.testing

    methods = {
        "triton do_bench (256 MB flush)": lambda call, q: triton.testing.do_bench(call, quantiles=q),
        "L2 flush, 50 runs": triton_int8.flushed_bench(1),
        "L2 flush, 200 runs": triton_int8.flushed_bench(1, 200),
        "2 x L2 flush, 50 runs (the engine's)": triton_int8.flushed_bench(2),
        "4 x L2 flush, 50 runs": triton_int8.flushed_bench(4),
    }
    l2 = torch.cuda.get_device_properties().L2_cache_size
    configs = triton_int8._CONFIGS
    scores: dict[str, list[float]] = {name: [] for name in methods}
    for model, shapes in SHAPES.items():
        for n, k in shapes:
            copies = min(1024, max(4, math.ceil(3 * l2 / (n * k))))
            weights = [
                torch.randint(-127, 127, (n, k), dtype=torch.int8, device="cuda") for _ in range(copies)
            ]
            scales = torch.rand(n, dtype=torch.bfloat16, device="cuda")
            for m in (1, 16):
                x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
                y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
                cold = [
                    cold_us([launcher((x, w, scales, y, m, n, k), m, n, c) for w in weights]) for c in configs
                ]
                best = min(cold)
                line = f"{model} N={n} K={k} M={m}: cold us per config " + " ".join(f"{t:.1f}" for t in cold)
                for name, bench in methods.items():
                    timed = [
                        bench(launcher((x, weights[0], scales, y, m, n, k), m, n, c), QUANTILES)
                        for c in configs
                    ]
                    pick = min(range(len(configs)), key=lambda i: timed[i])
                    scores[name].append(cold[pick] / best)
                    line += f" | {name}: #{pick} {cold[pick] / best:.2f}x"
                print(line, flush=True)
    for name, got in scores.items():
        print(f"{name}: {sum(got) / len(got):.3f}x the best cold cost on average, worst {max(got):.2f}x")


if __name__ == "__main__":
    main()
