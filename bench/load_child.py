"""One row of bench/scale_load.py: load an artifact on one engine in this fresh process and print
its steady and peak RSS as JSON. Imports only that engine (a llama.cpp row holds no torch).

    python -m bench.load_child ARTIFACT_DIR ENGINE SLOTS CONTEXT [--baseline] [--kv-cache-type T]
        [--generate N]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import resource
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deployer.agent.engines.base import Engine

# A prompt of a few dozen tokens, as a chat turn: what a first token waits for on a device.
PROMPT = "Explain in two sentences why an edge device verifies a signed update before installing it."


def _cpu() -> float:
    """CPU seconds (user + system) this process has used so far, all its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def child(
    directory: Path,
    engine: str,
    slots: int,
    context: int,
    baseline: bool,
    kv_cache_type: str = "auto",
    generate: int = 0,
) -> None:
    """Load `directory` on `engine` (llama.cpp: and warm it up, as the agent does before serving)
    and print its steady and peak RSS and the seconds it took, as JSON. `baseline` (torch): keep
    every mapped page of the weights until the load ends; `kv_cache_type` (torch): the KV cache's
    storage (agent.kv_cache_type). `generate` > 0: load through the engine, warm up, then answer
    once (see the module docstring)."""
    started = time.perf_counter()
    if engine == "torch" and not generate:
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
        engine_ = _engine(engine, slots, context, kv_cache_type)
        engine_.load(directory)
        engine_.warmup()
        loaded = engine_
    seconds = time.perf_counter() - started
    gc.collect()
    status = _status()
    # What glibc keeps of the load's freed transients: RSS once malloc_trim hands it back.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    row: dict[str, object] = {
        "steady": status["VmRSS"],
        "peak": status["VmHWM"],
        "seconds": seconds,
        "trimmed": _status()["VmRSS"],
        "cpu": _cpu(),
    }
    if generate:
        row |= _answer(engine_, generate)
    print(json.dumps(row))
    del loaded


def _engine(name: str, slots: int, context: int, kv_cache_type: str = "auto") -> Engine:
    """The agent's engine `name` on the CPU with 2 threads (imported lazily: one engine a process)."""
    if name == "torch":
        from deployer.agent.engines.torch.engine import TorchEngine

        return TorchEngine(
            device="cpu", max_context=context, threads=2, slots=slots, kv_cache_type=kv_cache_type
        )
    from deployer.agent.engines.llamacpp.engine import LlamaCppEngine

    return LlamaCppEngine(max_context=context, threads=2, slots=slots)


def _answer(engine: Engine, tokens: int) -> dict[str, object]:
    """One greedy chat answer of `tokens` tokens: first-token ms, decode tokens/s, RSS peak after."""
    from deployer.agent.types import ChatMessage, SamplingParams

    prompt = engine.chat_prompt([ChatMessage("user", PROMPT)])
    banned = tuple((token, -1e9) for token in sorted(engine.end_ids))
    params = SamplingParams(max_tokens=tokens, temperature=0, logit_bias=banned)
    start, cpu = time.perf_counter(), _cpu()
    stamps, pieces = [], []
    for event in engine.stream(prompt, params):
        if event.token_id is not None:  # the closing event may carry only its finish reason
            stamps.append(time.perf_counter())
            if len(stamps) == 1:
                first_cpu = _cpu() - cpu
        pieces.append(event.text)
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")
    return {
        "prompt_tokens": len(prompt),
        "tokens": len(stamps),
        "first_token_s": stamps[0] - start,
        "first_token_cpu": first_cpu,
        "decode_cpu": _cpu() - cpu - first_cpu,
        "decode_tps": decode,
        "peak_after": _status()["VmHWM"],
        "text": "".join(pieces)[:40],
    }


def main() -> None:
    """Parse the row's arguments and measure it."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory", type=Path)
    parser.add_argument("engine", choices=("torch", "llama.cpp"))
    parser.add_argument("slots", type=int)
    parser.add_argument("context", type=int)
    parser.add_argument("--baseline", action="store_true")
    parser.add_argument("--kv-cache-type", default="auto")
    parser.add_argument("--generate", type=int, default=0, help="then answer once with this many tokens")
    args = parser.parse_args()
    child(
        args.directory,
        args.engine,
        args.slots,
        args.context,
        args.baseline,
        args.kv_cache_type,
        args.generate,
    )


if __name__ == "__main__":
    main()
