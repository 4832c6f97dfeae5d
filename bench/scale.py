"""`sits-deployer build` at real model sizes: int4-g128 with the quality gate on, against the same
build with the gate off (the baseline), in the same run.

Each build runs the CLI in a child process (`sits-deployer build -f deploy.yaml --no-cache`) on a
cached random checkpoint of bench/shapes.py (sharded bf16 safetensors with an index; Qwen2.5's
q/k/v biases and tied head, Llama 3's GQA, rope scaling and untied head). The table gives the wall
time and peak RSS of each build (the child's own high-water mark, measured by wait4 in a small
wrapper: see bench/delta.py's `run`) against the checkpoint size and its largest tensor. The gate's
limits are wide open: the weights are random, so only its cost is measured, never its verdict.

    PYTHONPATH=. .venv/bin/python bench/scale.py                        # 1.5B and 3B
    PYTHONPATH=. .venv/bin/python bench/scale.py --shapes llama-3-8b --max-tokens 256
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.delta import Run, run
from bench.shapes import SHAPES, checkpoint
from deployer.build.source import open_source

EVAL_TEXT = Path(__file__).resolve().parents[1] / "examples" / "data" / "eval.txt"
DEPLOY = """\
apiVersion: sits.dev/v1
kind: Deployment
application: scale
model:
  name: {shape}
  version: 1.0.0
  source: {source}
  quantization:
    scheme: int4
    group_size: 128
{gate}fleet:
  devices:
    - name: dev1
      transport: local
      root: ./fleet/dev1
"""
# Random weights: any figure passes, so the gate's whole cost is paid and the build completes.
GATE = """\
  quality_gate:
    eval_text: {eval_text}
    max_tokens: {max_tokens}
    max_perplexity_increase_pct: 1000000
    min_top1_agreement: 0
"""
TIMEOUT_S = 3600.0


def build(shape: str, source: Path, work: Path, max_tokens: int | None) -> tuple[Run, int]:
    """One CLI build of `source` (gate on unless `max_tokens` is None): its run and artifact bytes.
    The store is removed afterwards (an 8B artifact is several GB)."""
    work.mkdir(parents=True)
    gate = "" if max_tokens is None else GATE.format(eval_text=EVAL_TEXT, max_tokens=max_tokens)
    deploy = work / "deploy.yaml"
    deploy.write_text(DEPLOY.format(shape=shape.replace(".", "-"), source=source, gate=gate))
    cli = str(Path(sys.executable).with_name("sits-deployer"))
    result = run([cli, "build", "-f", str(deploy), "--no-cache"], TIMEOUT_S)
    size = sum(p.stat().st_size for p in (work / ".sits" / "store" / "artifacts").rglob("*") if p.is_file())
    shutil.rmtree(work)
    return result, size


def main() -> None:
    """Build each shape with the gate off, then on; print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen2.5-1.5b", "qwen2.5-3b"], choices=sorted(SHAPES))
    parser.add_argument("--max-tokens", type=int, default=512, help="eval tokens the gate scores")
    args = parser.parse_args()
    console = Console(width=140)  # the table whole, also when written to a file
    table = Table(title=f"sits-deployer build, int4-g128, gate on {args.max_tokens} tokens vs gate off")
    for col in (
        "shape",
        "checkpoint GB",
        "largest tensor MB",
        "artifact GB",
        "gate",
        "wall s",
        "peak RSS MB",
        "gate cost s",
    ):
        table.add_column(col, justify="right")
    with tempfile.TemporaryDirectory(prefix="sits-scale-") as tmp:
        for shape in args.shapes:
            source = checkpoint(shape)
            tensors = open_source(source).tensors
            total = sum(t.entry.length for t in tensors) / 1e9
            largest = max(t.entry.length for t in tensors) / 1e6
            off, size = build(shape, source, Path(tmp) / f"{shape}-off", None)
            console.print(f"[dim]{shape} gate off: {off.seconds:.0f} s, {off.rss_mib:.0f} MiB[/dim]")
            on, _ = build(shape, source, Path(tmp) / f"{shape}-on", args.max_tokens)
            console.print(f"[dim]{shape} gate on: {on.seconds:.0f} s, {on.rss_mib:.0f} MiB[/dim]")
            for label, r, cost in (
                ("off (baseline)", off, "-"),
                ("on", on, f"{on.seconds - off.seconds:.0f}"),
            ):
                table.add_row(
                    shape,
                    f"{total:.2f}",
                    f"{largest:.0f}",
                    f"{size / 1e9:.2f}",
                    label,
                    f"{r.seconds:.0f}",
                    f"{r.rss_mib * 1.048576:.0f}",
                    cost,
                )
    console.print(table)
    console.print(
        f"[dim]{len(os.sched_getaffinity(0))} CPUs, 1-min load average {os.getloadavg()[0]:.1f} at the end "
        "(other jobs slow the wall times, not the peaks); wall time of the whole CLI, import included[/dim]"
    )


if __name__ == "__main__":
    main()
