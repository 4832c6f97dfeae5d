"""The torch agent's memory on real model shapes: artifact bytes, steady and peak load RSS.

For each shape of bench/shapes.py (random weights; 1.5B and 3B by default, `--with-8b` adds
Llama-3-8B), the int4-g128 artifact (fp16 embedding and head, as the builder writes them) is
built once without the quality gate into a store under the cache, then loaded by the torch
engine's loader on the CPU with `slots` sequences of `context` positions, in a fresh process per
row so each peak is its own:

* steady: the process's RSS once the model is loaded (python and torch included);
* peak: its high-water mark (VmHWM) during the load;
* baseline: the same load keeping every mapped page of the weights until the load ends (as the
  loader did before `WeightFiles.release`), measured in the same run;
* estimate: what validate estimates for that model and agent (deployer/config/estimate.py),
  against the measured peak.

    python -m bench.scale_load                # 1.5B and 3B rows
    python -m bench.scale_load --with-8b      # and Llama-3-8B (about 4.5 GB artifact, 16 GB source)
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.shapes import SHAPES, checkpoint
from deployer.build.demo_model import cache_root
from deployer.build.pipeline import build_artifact
from deployer.build.spec import BuildRequest, QuantSpec
from deployer.config.estimate import ModelShape, estimate_memory
from deployer.config.models import AgentSettings, ModelSpec, Quantization

STORE = cache_root() / "scale-artifacts" / "store"
GB = 1e9


def artifact(shape: str) -> Path:
    """The int4-g128 artifact of `shape`, built (no gate) on first use."""
    request = BuildRequest(checkpoint(shape), shape, "1.0.0", QuantSpec("int4", 128), STORE)
    return build_artifact(request).artifact_dir


def _status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def child(directory: Path, slots: int, context: int, baseline: bool) -> None:
    """Load `directory` and print its steady and peak RSS as JSON (one row's process)."""
    import torch

    from deployer.agent.engines.torch import loader

    if baseline:
        loader.WeightFiles.release = lambda self, names: None  # type: ignore[method-assign]
    torch.set_num_threads(2)
    started = time.perf_counter()
    loaded = loader.load_model(directory, device="cpu", dtype="auto", max_context=context, slots=slots)
    seconds = time.perf_counter() - started
    gc.collect()
    status = _status()
    print(json.dumps({"steady": status["VmRSS"], "peak": status["VmHWM"], "seconds": seconds}))
    del loaded


def _measure(directory: Path, slots: int, context: int, baseline: bool) -> dict[str, float]:
    argv = [sys.executable, "-m", "bench.scale_load", "--child", str(directory)]
    argv += ["--slots", str(slots), "--context", str(context)] + (["--baseline"] if baseline else [])
    done = subprocess.run(argv, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def estimate(shape: str, slots: int, context: int) -> int:
    """Validate's estimate of one agent serving `shape` at int4-g128 (one copy: unload-first)."""
    model = ModelSpec(
        name="bench", version="1.0.0", source=".", quantization=Quantization(scheme="int4", group_size=128)
    )
    agent = AgentSettings(
        engine="torch", max_concurrent=slots, max_tokens=context, swap_policy="unload-first"
    )
    return estimate_memory(ModelShape.from_config_json(checkpoint(shape) / "config.json"), model, agent).total


def main() -> None:
    """Print the table (or, with --child, one row's measurement)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--with-8b", action="store_true", help="add the Llama-3-8B row")
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, help="only these rows")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--no-baseline", action="store_true", help="skip the keep-every-page loads")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.slots, args.context, args.baseline)
        return
    shapes = args.shapes or ["qwen2.5-1.5b", "qwen2.5-3b"] + (["llama-3-8b"] if args.with_8b else [])
    table = Table(title=f"torch agent load, int4-g128, CPU, {args.slots} slots x {args.context} positions")
    for column in (
        "shape",
        "artifact GB",
        "steady GB",
        "peak GB",
        "peak/steady",
        "steady/artifact",
        "load s",
        "baseline peak GB",
        "baseline peak/steady",
        "estimate GB",
        "estimate/peak",
    ):
        table.add_column(column, justify="left" if column == "shape" else "right")
    for shape in shapes:
        directory = artifact(shape)
        size = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
        row = _measure(directory, args.slots, args.context, baseline=False)
        base = None if args.no_baseline else _measure(directory, args.slots, args.context, baseline=True)
        guess = estimate(shape, args.slots, args.context)
        print(
            json.dumps({"shape": shape, "artifact": size, "row": row, "baseline": base, "estimate": guess}),
            flush=True,
        )
        table.add_row(
            shape,
            f"{size / GB:.2f}",
            f"{row['steady'] / GB:.2f}",
            f"{row['peak'] / GB:.2f}",
            f"{row['peak'] / row['steady']:.2f}",
            f"{row['steady'] / size:.2f}",
            f"{row['seconds']:.0f}",
            "-" if base is None else f"{base['peak'] / GB:.2f}",
            "-" if base is None else f"{base['peak'] / base['steady']:.2f}",
            f"{guess / GB:.2f}",
            f"{guess / row['peak']:.2f}",
        )
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
