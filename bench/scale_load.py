"""The agent's memory on real model shapes: artifact bytes, steady and peak load RSS, per engine.

For each shape of bench/shapes.py (random weights; 1.5B and 3B by default, `--with-8b` adds
Llama-3-8B), two artifacts are built once without the quality gate into a store under the cache:

* torch: int4-g128 (fp16 embedding and head, as the builder writes them), loaded by the torch
  engine's loader on the CPU;
* llama.cpp: a GGUF quantized by llama.cpp's quantizer to Q4_K_M without an importance matrix
  (the weights are random: there is nothing for one to weigh), loaded by the llama.cpp engine and
  warmed up as the agent does before serving;

each with `slots` sequences of `context` positions (the torch engine's KV cache stored as each of
`--kv-cache-types`, agent.kv_cache_type: fp32 by default), in a fresh process per row
(bench/load_child.py, which imports only the engine it loads) so each peak is its own:

* steady: the process's RSS once the model is loaded (python and the engine's library included);
* peak: its high-water mark (VmHWM) during the load;
* baseline (torch): the same load keeping every mapped page of the weights until the load ends
  (as the loader did before `WeightFiles.release`), measured in the same run;
* estimate: what validate estimates for that model and agent (deployer/config/estimate.py),
  against the measured peak.

    python -m bench.scale_load                # 1.5B and 3B rows, both engines
    python -m bench.scale_load --with-8b      # and Llama-3-8B (about 4.5 GB artifact, 16 GB source)
    python -m bench.scale_load --shapes llama-3-8b --engines torch --kv-cache-types fp32 fp16 int8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.shapes import SHAPES, checkpoint
from deployer.build.demo_model import cache_root
from deployer.build.pipeline import build_artifact
from deployer.build.spec import BuildRequest, LlamaQuantSpec, QuantSpec
from deployer.config.estimate import ModelShape, estimate_memory
from deployer.config.models import AgentSettings, ModelSpec, Quantization

STORE = cache_root() / "scale-artifacts" / "store"
GB = 1e9
ENGINES = ("torch", "llama.cpp")
KV_TYPES = ("auto", "fp32", "fp16", "bf16", "int8")
GGUF_TYPE = "Q4_K_M"


def artifact(shape: str, engine: str = "torch") -> Path:
    """The artifact of `shape` for `engine` (int4-g128, or a Q4_K_M GGUF), built (no gate) on first use."""
    if engine == "torch":
        request = BuildRequest(checkpoint(shape), shape, "1.0.0", QuantSpec("int4", 128), STORE)
    else:
        quant = LlamaQuantSpec(GGUF_TYPE, imatrix=False)
        request = BuildRequest(
            checkpoint(shape), shape, "1.0.0", QuantSpec("fp16"), STORE, format="gguf", llama_quant=quant
        )
    return build_artifact(request).artifact_dir


def _measure(
    directory: Path, engine: str, slots: int, context: int, baseline: bool, kv: str
) -> dict[str, float]:
    argv = [sys.executable, "-m", "bench.load_child", str(directory), engine, str(slots), str(context)]
    argv += ["--baseline"] if baseline else []
    argv += ["--kv-cache-type", kv]
    done = subprocess.run(argv, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def estimate(shape: str, engine: str, slots: int, context: int, kv: str = "auto") -> int:
    """Validate's estimate of one agent serving `shape` on `engine` (one copy: unload-first) with
    its KV cache stored as `kv`."""
    quantization = (
        Quantization(scheme="int4", group_size=128)
        if engine == "torch"
        else Quantization(gguf_type=GGUF_TYPE)
    )
    model = ModelSpec(name="bench", version="1.0.0", source=".", quantization=quantization)
    agent = AgentSettings(
        engine=engine,
        max_concurrent=slots,
        max_tokens=context,
        swap_policy="unload-first",
        kv_cache_type=kv,  # type: ignore[arg-type]  # argparse's choices are the Literal's
    )
    return estimate_memory(ModelShape.from_config_json(checkpoint(shape) / "config.json"), model, agent).total


def main() -> None:
    """Print the table (or, with --child, one row's measurement)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--with-8b", action="store_true", help="add the Llama-3-8B row")
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, help="only these shapes")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=ENGINES, help="only these engines")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--no-baseline", action="store_true", help="skip the keep-every-page loads")
    parser.add_argument(
        "--kv-cache-types",
        nargs="+",
        choices=KV_TYPES,
        default=["auto"],
        help="the torch rows' KV cache storage (agent.kv_cache_type), a row each",
    )
    args = parser.parse_args()
    shapes = args.shapes or ["qwen2.5-1.5b", "qwen2.5-3b"] + (["llama-3-8b"] if args.with_8b else [])
    engines = f"torch int4-g128, llama.cpp {GGUF_TYPE}"
    table = Table(title=f"agent load, CPU: {engines}; {args.slots} slots x {args.context} positions")
    for column in (
        "shape",
        "engine",
        "kv cache",
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
    rows = [
        (shape, engine, kv)
        for shape in shapes
        for engine in args.engines
        for kv in (args.kv_cache_types if engine == "torch" else ["auto"])  # llama.cpp: its fp16
    ]
    for shape, engine, kv in rows:
        directory = artifact(shape, engine)
        size = sum(p.stat().st_size for p in directory.iterdir() if p.suffix in (".safetensors", ".gguf"))
        row = _measure(directory, engine, args.slots, args.context, False, kv)
        keep_pages = engine == "torch" and not args.no_baseline  # llama.cpp reads its weights
        base = _measure(directory, engine, args.slots, args.context, True, kv) if keep_pages else None
        guess = estimate(shape, engine, args.slots, args.context, kv)
        record = {"shape": shape, "engine": engine, "kv": kv, "artifact": size, "row": row}
        print(json.dumps(record | {"baseline": base, "estimate": guess}), flush=True)
        table.add_row(
            shape,
            engine,
            ("fp32" if kv == "auto" else kv) if engine == "torch" else "fp16",
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
