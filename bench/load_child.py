"""One row of bench/scale_load.py: load an artifact on one engine in this fresh process and print
its steady and peak RSS as JSON. Imports only that engine (a llama.cpp row holds no torch).

    python -m bench.load_child ARTIFACT_DIR ENGINE SLOTS CONTEXT [--baseline] [--kv-cache-type T]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import time
from pathlib import Path


def _status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def child(
    directory: Path, engine: str, slots: int, context: int, baseline: bool, kv_cache_type: str = "auto"
) -> None:
    """Load `directory` on `engine` (llama.cpp: and warm it up, as the agent does before serving)
    and print its steady and peak RSS and the seconds it took, as JSON. `baseline` (torch): keep
    every mapped page of the weights until the load ends; `kv_cache_type` (torch): the KV cache's
    storage (agent.kv_cache_type)."""
    started = time.perf_counter()
    if engine == "torch":
        import torch

        from deployer.agent.engines.torch import loader

        if baseline:
            loader.WeightFiles.release = lambda self, names: None  # type: ignore[method-assign]
        torch.set_num_threads(2)
        started = time.perf_counter()
        loaded: object = loader.load_model(
            directory,
            device="cpu",
            dtype="auto",
            max_context=context,
            slots=slots,
            kv_cache_type=kv_cache_type,
        )
    else:
        from deployer.agent.engines.llamacpp.engine import LlamaCppEngine

        engine_ = LlamaCppEngine(max_context=context, threads=2, slots=slots)
        engine_.load(directory)
        engine_.warmup()
        loaded = engine_
    seconds = time.perf_counter() - started
    gc.collect()
    status = _status()
    # What glibc keeps of the load's freed transients: RSS once malloc_trim hands it back.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    trimmed = _status()["VmRSS"]
    out = {"steady": status["VmRSS"], "peak": status["VmHWM"], "seconds": seconds, "trimmed": trimmed}
    print(json.dumps(out))
    del loaded


def main() -> None:
    """Parse the row's arguments and measure it."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory", type=Path)
    parser.add_argument("engine", choices=("torch", "llama.cpp"))
    parser.add_argument("slots", type=int)
    parser.add_argument("context", type=int)
    parser.add_argument("--baseline", action="store_true")
    parser.add_argument("--kv-cache-type", default="auto")
    args = parser.parse_args()
    child(args.directory, args.engine, args.slots, args.context, args.baseline, args.kv_cache_type)


if __name__ == "__main__":
    main()
