"""Benchmark `sits-deployer build` on SmolLM2-135M-Instruct (CPU, fp32 source, 2 threads).

Prints three tables:
  1. build throughput (source MB/s) per scheme, against reading + hashing the source (baseline);
  2. peak RSS of a build in a fresh subprocess against model size and an import-only
     subprocess (baseline). The child reports VmHWM from /proc/self/status: ru_maxrss would
     carry over the RSS of this (large) parent process through fork + exec;
  3. quality on examples/data/eval.txt: perplexity, top-1 agreement and mean KL vs fp32.

Run: PYTHONPATH=. .venv/bin/python bench/build.py [--max-tokens 512] [--tables rss,quality]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from deployer.build.demo_model import prepare_smollm2
from deployer.build.pipeline import build_artifact
from deployer.build.source import open_source
from deployer.build.spec import BuildRequest, GateSpec, QuantSpec
from deployer.core.hashing import sha256_file

ROOT = Path(__file__).resolve().parents[1]
EVAL_TEXT = ROOT / "examples" / "data" / "eval.txt"
THROUGHPUT_SCHEMES = [
    ("fp16", 128),
    ("bf16", 128),
    ("int8", 128),
    ("int4", 32),
    ("int4", 128),
    ("layered", 128),
]
QUALITY_SCHEMES = [("fp32", 128), ("int8", 128), ("int4", 128), ("layered", 128)]
CHILD = """
import sys
from pathlib import Path
import torch
torch.set_num_threads(2)
from deployer.build.pipeline import build_artifact
from deployer.build.spec import BuildRequest, QuantSpec
if sys.argv[1] != "import-only":
    build_artifact(BuildRequest(Path(sys.argv[1]), "bench", "1.0.0", QuantSpec(sys.argv[2]),
                                Path(sys.argv[3]), use_cache=False))
status = Path("/proc/self/status").read_text()
print(next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")))
"""


def _request(source: Path, store: Path, scheme: str, group_size: int, gate: GateSpec | None = None):
    return BuildRequest(source, "bench", "1.0.0", QuantSpec(scheme, group_size), store, gate, use_cache=False)


def throughput(source: Path, work: Path) -> Table:
    size_mb = sum((source / f).stat().st_size for f in open_source(source).weight_files) / 1e6
    table = Table(title=f"Build throughput, SmolLM2-135M fp32 source ({size_mb:.0f} MB), no gate")
    for col in ("scheme", "seconds", "source MB/s", "artifact MB", "vs baseline"):
        table.add_column(col, justify="right")
    started = time.perf_counter()
    sha256_file(source / "model.safetensors")
    base = time.perf_counter() - started
    table.add_row("baseline: read+sha256", f"{base:.2f}", f"{size_mb / base:.0f}", "-", "1.00x")
    for scheme, g in THROUGHPUT_SCHEMES:
        result = build_artifact(_request(source, work / f"{scheme}{g}", scheme, g))
        mbs = size_mb / result.seconds
        label = QuantSpec(scheme, g).label
        table.add_row(
            label,
            f"{result.seconds:.2f}",
            f"{mbs:.0f}",
            f"{result.bytes_written / 1e6:.0f}",
            f"{base / result.seconds:.2f}x",
        )
    return table


def _child_rss_mb(*args: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, *args],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    return int(out.stdout.strip().splitlines()[-1]) / 1024


def peak_rss(source: Path, tiny: Path, work: Path) -> Table:
    table = Table(title="Peak RSS (VmHWM) of a build in a subprocess, int8, no gate")
    for col in ("model", "weights MB", "largest tensor MB", "peak RSS MB", "over import-only"):
        table.add_column(col, justify="right")
    base = _child_rss_mb("import-only")
    table.add_row("baseline: import only", "-", "-", f"{base:.0f}", "0")
    for name, path in (("tiny (2 layers)", tiny), ("SmolLM2-135M", source)):
        model = open_source(path)
        weights = sum(t.entry.length for t in model.tensors) / 1e6
        largest = max(t.entry.length for t in model.tensors) / 1e6
        rss = _child_rss_mb(str(path), "int8", str(work / f"rss-{path.name}"))
        table.add_row(name, f"{weights:.1f}", f"{largest:.1f}", f"{rss:.0f}", f"{rss - base:.0f}")
    return table


def quality_table(source: Path, work: Path, max_tokens: int) -> Table:
    gate = GateSpec(EVAL_TEXT, max_tokens=max_tokens)
    table = Table(title="Quality vs fp32 on examples/data/eval.txt (SmolLM2-135M-Instruct)")
    for col in ("scheme", "tokens", "perplexity", "ppl change", "top-1 agreement", "mean KL", "weights MB"):
        table.add_column(col, justify="right")
    for scheme, g in QUALITY_SCHEMES:
        result = build_artifact(_request(source, work / f"q-{scheme}{g}", scheme, g, gate))
        q = result.quality
        if scheme == "fp32":
            table.add_row(
                "fp32 (reference)",
                str(q.tokens),
                f"{q.reference_perplexity:.3f}",
                "-",
                "-",
                "-",
                f"{result.bytes_written / 1e6:.0f}",
            )
        table.add_row(
            QuantSpec(scheme, g).label,
            str(q.tokens),
            f"{q.quantized_perplexity:.3f}",
            f"{q.increase_pct:+.2f}%",
            f"{q.top1_agreement:.3f}",
            f"{q.mean_kl:.4f}",
            f"{result.bytes_written / 1e6:.0f}",
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--tables", default="throughput,rss,quality", help="which tables to print")
    args = parser.parse_args()
    tables = set(args.tables.split(","))
    torch.set_num_threads(2)
    console = Console()
    source = prepare_smollm2()
    with tempfile.TemporaryDirectory(prefix="sits-bench-") as tmp:
        work = Path(tmp)
        from deployer.build.demo_model import make_tiny_checkpoint

        tiny = make_tiny_checkpoint(work / "tiny")
        if "throughput" in tables:
            console.print(throughput(source, work))
        if "rss" in tables:
            console.print(peak_rss(source, tiny, work))
        if "quality" in tables:
            console.print(quality_table(source, work, args.max_tokens))
    console.print(f"[dim]torch {torch.__version__}, {torch.get_num_threads()} threads, CPU[/dim]")


if __name__ == "__main__":
    main()
