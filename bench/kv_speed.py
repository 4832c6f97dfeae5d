"""What a narrower KV cache costs in speed: the torch engine's decode step (tokens/s) and first
token (a 64-token prompt's prefill and one step) on a CPU with its KV cache stored fp32, fp16 and
int8 (agent.kv_cache_type), at 1, 4 and 16 sequences a step, each attending 128 or 1,024 cached
positions, against fp32 in the same run.

Models: SmolLM2-135M-Instruct int8 (the serving bench's artifact) and the Qwen2.5-1.5B shape at
int4-g128 (random weights: bench/scale_load.py's artifact). Each model is loaded once and its
caches are set up anew for each storage (Transformer.setup_caches), the storages taking turns at
each measurement, through `--repeats` rounds; each figure is the best round's, because on a
shared machine a slow round measures the neighbours. The cached positions hold zeros: a step's
cost does not depend on their values.

    PYTHONPATH=. python bench/kv_speed.py --repeats 5
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from bench.llamacpp import artifacts
from bench.scale_load import artifact
from deployer.agent.engines.torch.loader import kv_cache_layout, load_model

TYPES = ("fp32", "fp16", "int8")
BATCHES = (1, 4, 16)
CACHED = (128, 1024)
PROMPT = 64
STEPS = 4


def _best(run: Callable[[], None], times: int) -> float:
    """The fastest of `times` calls of `run`, in seconds."""
    best = float("inf")
    for _ in range(times):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def measure(directory: Path, repeats: int) -> dict[tuple[str, str, int, int], float]:
    """{(storage, "step" or "first", batch, cached positions): best seconds} of one model."""
    context = max(CACHED) + 1
    loaded = load_model(directory, device="cpu", dtype="auto", max_context=context, slots=max(BATCHES))
    model, vocab = loaded.model, loaded.args.vocab_size
    best: dict[tuple[str, str, int, int], float] = {}
    with torch.inference_mode():
        for _ in range(repeats):
            # The storages take turns at each measurement, so a busy neighbour slows all alike.
            for batch, cached in [(1, PROMPT), *((b, c) for b in BATCHES for c in CACHED)]:
                for kv in TYPES:
                    storage, attention = kv_cache_layout(kv, loaded.device, loaded.dtype)
                    model.setup_caches(max(BATCHES), context, loaded.device, storage, attention)
                    if cached == PROMPT:
                        prompt = torch.randint(vocab, (1, PROMPT))

                        def first(prompt: torch.Tensor = prompt) -> None:
                            model.prefill(prompt, slot=0, start=0)
                            model.decode(prompt[0, -1:], torch.tensor([PROMPT]), kv_len=PROMPT + 1)

                        key, seconds = (kv, "first", 1, PROMPT), _best(first, 1)
                    else:
                        tokens, pos = torch.randint(vocab, (batch,)), torch.full((batch,), cached)

                        def step(tokens: torch.Tensor = tokens, pos: torch.Tensor = pos) -> None:
                            model.decode(tokens, pos, kv_len=int(pos.max()) + 1)

                        step()  # the first step of a shape allocates
                        key, seconds = (kv, "step", batch, cached), _best(step, STEPS)
                    best[key] = min(best.get(key, float("inf")), seconds)
    return best


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    # One thread: on a shared machine a step of two waits for whichever thread was descheduled.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", nargs="+", default=["smollm2", "qwen2.5-1.5b"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {"smollm2": ("SmolLM2-135M int8", lambda: artifacts("int8")[1])}
    models["qwen2.5-1.5b"] = ("Qwen2.5-1.5B shape int4-g128", lambda: artifact("qwen2.5-1.5b"))
    table = Table(
        title=f"torch engine, CPU, {args.threads} threads: KV cache storage against fp32 "
        f"(best of {args.repeats} rounds)"
    )
    for column in ("model", "kv cache", "first token ms", "vs fp32"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for batch in BATCHES:
        for cached in CACHED:
            table.add_column(f"{batch} seq @{cached} tok/s", justify="right")
            table.add_column("vs fp32", justify="right")
    for name in args.models:
        label, directory = models[name]
        best = measure(directory(), args.repeats)
        for kv in TYPES:
            first, base = best[kv, "first", 1, PROMPT], best["fp32", "first", 1, PROMPT]
            cells = [label, kv, f"{first * 1000:.0f}", f"{first / base:.2f}x"]
            for batch in BATCHES:
                for cached in CACHED:
                    rate = batch / best[kv, "step", batch, cached]
                    fp32 = batch / best["fp32", "step", batch, cached]
                    cells += [f"{rate:.1f}", f"{rate / fp32:.2f}x"]
            table.add_row(*cells)
            print(cells, flush=True)
    Console(width=250).print(table)
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
