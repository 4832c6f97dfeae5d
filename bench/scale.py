"""Every stage of a release at real model sizes: build, gate, delta, install, load, first token and
decode, each with its wall time and peak RSS, against the checkpoint size and its largest tensor.

Per shape of bench/shapes.py (cached random checkpoints: sharded bf16 safetensors with an index;
Qwen2.5's q/k/v biases and tied head, Llama 3's GQA, rope scaling and untied head), in one run:

* build: `sits-deployer build --no-cache` of int4-g128 with the quality gate off (the baseline),
  then on (`--max-tokens` eval tokens; limits wide open: the weights are random, so only its cost
  is measured, never its verdict);
* delta: bench/delta.py's scale steps on the gate-off artifact: hashing and copying it (the
  baselines), then `create_patch` and `apply_patch` to two new versions made from the artifact
  itself a tensor at a time (every tensor nudged a little: 1 % of each float tensor's std and 2.5 %
  of the packed int4 bytes one step; or the last two decoder layers only), so the int4 bytes
  change as requantizing a slightly fine-tuned model would change them, without a second 16 GB
  checkpoint or a second quantization;
* install: `sits-deployer release` (signed) and the agent's own `sits-agent install` into a fresh
  device root (what the local transport runs on a device): the base from its artifact directory,
  then the every-tensor version from its patch (the agent's apply, verify and promote);
* serve: the artifact loaded by the agent's torch engine (CPU, 2 threads) and, as the anchor, the
  same checkpoint built as GGUF (`agent.engine: llama.cpp`) on the llama.cpp engine, each in its own
  process (bench/load_child.py): load and warm-up, then one greedy chat answer: first token, decode
  tokens/s, and the process's peak RSS.

Every child's peak RSS is its own high-water mark (wait4 in a small wrapper, or VmHWM in the load
child). Scratch goes to a temporary directory (--work), emptied stage by stage (an 8B artifact is
5.8 GB). With --lock, each stage holds that file's flock while it runs (not while it waits), so
other heavy jobs on the machine run between stages, not during them.

    PYTHONPATH=. .venv/bin/python bench/scale.py                                 # 1.5B and 3B
    PYTHONPATH=. .venv/bin/python bench/scale.py --shapes llama-3-8b --max-tokens 256 --gguf Q4_1
    PYTHONPATH=. .venv/bin/python bench/scale.py --shapes tiny --max-tokens 64   # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.delta import (
    APPLY_TARGET_MIB,
    CREATE_TARGET_MB_S,
    SCALE_VERSIONS,
    Run,
    artifact_bytes,
    run,
    scale_artifacts,
    scale_steps,
)
from bench.shapes import SHAPES, checkpoint
from deployer.agent.ota.store import DeviceStore
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
{quantization}{gate}fleet:
  devices:
    - name: dev1
      transport: local
      root: ./fleet/dev1
{agent}"""
INT4 = "    scheme: int4\n    group_size: 128\n"
# GGUF for the llama.cpp rows: a K-quant through llama.cpp's quantizer (it first writes the f16
# GGUF: 16 GB at 8B), or a type our GGUF writer makes directly from the checkpoint.
GGUF = {
    "Q4_K_M": "    gguf_type: Q4_K_M\n    imatrix: false\n",  # random weights: nothing to weigh
    "Q4_1": "    scheme: int4\n    group_size: 32\n",
    "Q8_0": "    scheme: int8\n",
}
# Random weights: any figure passes, so the gate's whole cost is paid and the build completes.
GATE = """\
  quality_gate:
    eval_text: {eval_text}
    max_tokens: {max_tokens}
    max_perplexity_increase_pct: 1000000
    min_top1_agreement: 0
"""
TIMEOUT_S = 3600.0
SLOTS, CONTEXT = 4, 2048  # the agent's defaults for the serve rows, as bench/scale_load.py
BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Row:
    """One stage of one shape: wall seconds, peak RSS (MiB), CPU seconds, a rate and a note."""

    stage: str
    seconds: float
    rss_mib: float
    cpu_s: float
    rate: str = ""
    note: str = ""


class Stages:
    """A shape's stages, each run under the heavy-work lock when one is named; their rows."""

    def __init__(self, shape: str, lock: Path | None, console: Console) -> None:
        self.shape, self.lock, self.console = shape, lock, console
        self.rows: list[Row] = []

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The lock (if any) for the duration of one stage."""
        if self.lock is None:
            yield
            return
        with self.lock.open("a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield

    def run(self, cmd: list[str]) -> Run:
        """One CLI stage in a child, timed with its peak RSS (bench/delta.py's `run`)."""
        with self.held():
            return run(cmd, TIMEOUT_S)

    def add(self, stage: str, result: Run, rate: str = "", note: str = "") -> None:
        """Record one row, and print it at once (a shape's stages take up to an hour)."""
        self.rows.append(Row(stage, result.seconds, result.rss_mib, result.cpu_s, rate, note))
        took = f"{result.seconds:.1f} s, CPU {result.cpu_s:.1f} s, {result.rss_mib:.0f} MiB"
        line = f"{self.shape} {stage}: {took} {rate} {note}"
        self.console.print(line, style="dim", markup=False, highlight=False)


def write_deploy(
    work: Path, shape: str, source: Path, quantization: str, gate: str = "", agent: str = ""
) -> Path:
    """A deploy.yaml in `work` (created) building `source` with `quantization`."""
    work.mkdir(parents=True)
    deploy = work / "deploy.yaml"
    name = shape.replace(".", "-")
    deploy.write_text(
        DEPLOY.format(shape=name, source=source, quantization=quantization, gate=gate, agent=agent)
    )
    return deploy


def build(stages: Stages, deploy: Path) -> tuple[Run, Path]:
    """`sits-deployer build` of `deploy`: its run and the artifact it left in the store beside it."""
    result = stages.run([str(BIN / "sits-deployer"), "build", "-f", str(deploy), "--no-cache"])
    (artifact,) = (p for p in (deploy.parent / ".sits" / "store" / "artifacts").iterdir() if p.is_dir())
    return result, artifact


def build_rows(stages: Stages, shape: str, source: Path, work: Path, max_tokens: int) -> Path:
    """Build with the gate off (the artifact is kept and returned), then on (its store removed)."""
    off, artifact = build(stages, write_deploy(work / "off", shape, source, INT4))
    stages.add(
        "build int4-g128, gate off (baseline)", off, note=f"artifact {artifact_bytes(artifact) / 1e9:.2f} GB"
    )
    gate = GATE.format(eval_text=EVAL_TEXT, max_tokens=max_tokens)
    on, _ = build(stages, write_deploy(work / "on", shape, source, INT4, gate))
    stages.add(
        f"build + gate, {max_tokens} eval tokens", on, note=f"gate cost {on.seconds - off.seconds:.0f} s"
    )
    shutil.rmtree(work / "on")
    return artifact


def delta_rows(stages: Stages, shape: str, artifact: Path, work: Path) -> dict[str, Path]:
    """bench/delta.py's scale steps on `artifact`. Returns the base, the every-tensor version and
    its patch (kept for the install rows); the two-layers version is removed."""
    size = artifact_bytes(artifact)
    with stages.held():  # the versions are written in this process (memory-mapped), then measured
        arts = scale_artifacts(shape, work, artifact)
        steps = scale_steps(arts, work, keep="every-tensor")
    for step in steps:
        change = "" if step.change == "-" else f"{step.change} "
        note = step.note or ("verifies base, patch and output" if step.step.startswith("apply") else "")
        stages.add(
            f"delta {change}{step.step.split(' (verifies')[0]}",
            step.run,
            f"{size / 1e6 / step.run.seconds:.0f} MB/s",
            note,
        )
    shutil.rmtree(arts["two-layers"])
    return {"base": artifact, "every-tensor": arts["every-tensor"], "patch": work / "every-tensor.patch"}


def install_rows(stages: Stages, versions: dict[str, Path], work: Path) -> None:
    """Sign releases and install them with the agent's CLI into a fresh device root: the base from
    its artifact, then the every-tensor version from its patch. Everything is removed after."""
    deployer, agent = str(BIN / "sits-deployer"), str(BIN / "sits-agent")
    work.mkdir(parents=True)
    key = work / "release"
    subprocess.run([deployer, "keygen", "-o", str(key), "--unencrypted", "-q"], check=True)
    device = DeviceStore(work / "device")
    device.ensure_layout()
    shutil.copyfile(key.with_suffix(".pub"), device.keys_dir / "release.pub")
    on_device = ["--root", str(device.root), "--config", str(work / "none.yaml"), "--no-reload"]
    base, new, patch = versions["base"], versions["every-tensor"], versions["patch"]
    release = [deployer, "release", "--key", str(key.with_suffix(".key")), "-q"]
    subprocess.run([*release, str(base), "--counter", "1", "-o", str(work / "r1.json")], check=True)
    subprocess.run(
        [
            *release,
            str(new),
            "--counter",
            "2",
            "--base",
            str(base),
            "--patch",
            str(patch),
            "-o",
            str(work / "r2.json"),
        ],
        check=True,
    )
    shutil.rmtree(new)  # the device needs only the patch now
    size = artifact_bytes(base)
    full = stages.run(
        [agent, "install", "--manifest", str(work / "r1.json"), "--artifact", str(base), *on_device]
    )
    stages.add("install 1.0.0 from its artifact (sits-agent)", full, f"{size / 1e6 / full.seconds:.0f} MB/s")
    patched = stages.run(
        [agent, "install", "--manifest", str(work / "r2.json"), "--patch", str(patch), *on_device]
    )
    note = f"patch {patch.stat().st_size / 2**20:.0f} MiB"
    version = SCALE_VERSIONS["every-tensor"]
    stages.add(
        f"install {version} from its patch (sits-agent)",
        patched,
        f"{size / 1e6 / patched.seconds:.0f} MB/s",
        note,
    )
    shutil.rmtree(device.root)
    patch.unlink()


def serve_rows(stages: Stages, engine: str, artifact: Path, tokens: int) -> float:
    """Load `artifact` on `engine` in its own process, answer once; rows for load and answer.
    Returns the decode rate, tokens/s."""
    argv = [sys.executable, "-m", "bench.load_child", str(artifact), engine, str(SLOTS), str(CONTEXT)]
    with stages.held():
        done = subprocess.run([*argv, "--generate", str(tokens)], check=True, capture_output=True, text=True)
    row = json.loads(done.stdout.strip().splitlines()[-1])
    mib = 2**20
    steady = f"steady {row['steady'] / mib:.0f} MiB, {SLOTS} slots x {CONTEXT}"
    loaded = Run(row["seconds"], row["peak"] / mib, ok=True, cpu_s=row["cpu"])
    stages.add(f"{engine}: agent load + warm-up", loaded, note=steady)
    first = Run(row["first_token_s"], row["peak_after"] / mib, ok=True, cpu_s=row["first_token_cpu"])
    stages.add(f"{engine}: first token", first, note=f"prompt {row['prompt_tokens']} tokens")
    decode = f"{row['decode_tps']:.2f} tok/s"
    spent = Run(
        (row["tokens"] - 1) / row["decode_tps"], row["peak_after"] / mib, ok=True, cpu_s=row["decode_cpu"]
    )
    stages.add(f"{engine}: decode", spent, decode, f"{row['tokens']} tokens, greedy")
    return float(row["decode_tps"])


def gguf_rows(stages: Stages, shape: str, source: Path, work: Path, gguf: str) -> Path:
    """Build the checkpoint as GGUF for the llama.cpp engine; the artifact."""
    deploy = write_deploy(work, shape, source, GGUF[gguf], agent="agent:\n  engine: llama.cpp\n")
    result, artifact = build(stages, deploy)
    stages.add(
        f"build GGUF {gguf} (agent.engine: llama.cpp)",
        result,
        note=f"artifact {artifact_bytes(artifact) / 1e9:.2f} GB",
    )
    return artifact


def measure(shape: str, work: Path, args: argparse.Namespace, console: Console) -> tuple[list[Row], str]:
    """Every stage of `shape`, in the order that keeps the scratch on disk smallest; its rows and
    the torch/llama.cpp decode ratio."""
    stages = Stages(shape, args.lock, console)
    source = checkpoint(shape)
    artifact = build_rows(stages, shape, source, work / "build", args.max_tokens)
    install_rows(stages, delta_rows(stages, shape, artifact, work / "delta"), work / "install")
    torch_tps = serve_rows(stages, "torch", artifact, args.tokens)
    shutil.rmtree(work / "build")
    gguf = gguf_rows(stages, shape, source, work / "gguf", args.gguf)
    llama_tps = serve_rows(stages, "llama.cpp", gguf, args.tokens)
    shutil.rmtree(work / "gguf")
    ratio = f"{shape}: torch int4-g128 decodes at {torch_tps / llama_tps:.2f}x llama.cpp {args.gguf}"
    return stages.rows, ratio


def main() -> None:
    """Measure each shape, print the table and the targets checked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen2.5-1.5b", "qwen2.5-3b"], choices=sorted(SHAPES))
    parser.add_argument("--max-tokens", type=int, default=512, help="eval tokens the gate scores")
    parser.add_argument("--tokens", type=int, default=32, help="tokens of the one answer")
    parser.add_argument(
        "--gguf", choices=sorted(GGUF), default="Q4_K_M", help="GGUF type of the llama.cpp rows"
    )
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: system temp)")
    parser.add_argument("--lock", type=Path, default=None, help="hold this file's flock during each stage")
    args = parser.parse_args()
    console = Console(width=160)  # the table whole, also when written to a file
    table = Table(
        title=f"Every stage at real sizes: int4-g128 (gate on {args.max_tokens} tokens), GGUF {args.gguf}"
    )
    for col in (
        "shape",
        "checkpoint GB",
        "largest tensor MB",
        "stage",
        "s",
        "CPU s",
        "peak RSS MiB",
        "rate",
        "note",
    ):
        table.add_column(col, justify="left" if col in ("shape", "stage", "note") else "right")
    verdicts = []
    for shape in args.shapes:
        tensors = open_source(checkpoint(shape)).tensors
        total = sum(t.entry.length for t in tensors) / 1e9
        largest = max(t.entry.length for t in tensors) / 1e6
        with tempfile.TemporaryDirectory(prefix="sits-scale-", dir=args.work) as tmp:
            rows, ratio = measure(shape, Path(tmp), args, console)
        for i, r in enumerate(rows):
            head = (shape, f"{total:.2f}", f"{largest:.0f}") if i == 0 else ("", "", "")
            table.add_row(
                *head,
                r.stage,
                _secs(r.seconds),
                _secs(r.cpu_s),
                f"{r.rss_mib:.0f}",
                r.rate,
                r.note,
            )
        table.add_section()
        verdicts += [ratio, *targets(shape, rows)]
    console.print(table)
    for line in verdicts:
        console.print(line)
    console.print(
        f"[dim]{len(os.sched_getaffinity(0))} CPUs, 1-min load average {os.getloadavg()[0]:.1f} at the end "
        "(other jobs slow the wall times, not the peaks); CLI rows include python's start[/dim]"
    )


def _secs(seconds: float) -> str:
    return f"{seconds:.2f}" if seconds < 10 else f"{seconds:.0f}"


def targets(shape: str, rows: list[Row]) -> list[str]:
    """Issue #38's targets checked against `rows`."""
    out = []
    for r in rows:
        if r.stage.startswith("delta") and r.stage.endswith("create"):
            mb_s = float(r.rate.split()[0])
            verdict = "OK" if mb_s >= CREATE_TARGET_MB_S else "BELOW"
            out.append(f"{shape} {r.stage}: {mb_s:.0f} MB/s, target >= {CREATE_TARGET_MB_S:.0f}: {verdict}")
        elif r.stage.startswith("delta") and "apply" in r.stage:
            verdict = "OK" if r.rss_mib <= APPLY_TARGET_MIB else "ABOVE"
            out.append(f"{shape} {r.stage}: {r.rss_mib:.0f} MiB, target <= {APPLY_TARGET_MIB:.0f}: {verdict}")
        elif r.stage.startswith("build + gate"):
            verdict = "OK" if r.rss_mib <= 4000 / 1.048576 and r.seconds <= 600 else "ABOVE"
            out.append(
                f"{shape} gate: {r.rss_mib:.0f} MiB, {r.seconds:.0f} s; target <= 4 GB, 10 min: {verdict}"
            )
    return out


if __name__ == "__main__":
    main()
