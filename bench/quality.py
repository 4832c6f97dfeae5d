"""Quantization quality bench: ours (int8, int4 group 32 / 128, with and without AWQ) against
llama.cpp's Q4_0, Q4_1, Q8_0 (our GGUF pipeline, scored by llama.cpp) and Q4_K_M (llama.cpp's own
quantizer on our f16 GGUF), from the same source weights, in one run, on one held-out text.

Two models:
* SmolLM2-135M-Instruct (`builtin:`): its fp32 checkpoint is itself dequantized Q4_1 blocks of 32,
  so group-32 int4 with an exact range reproduces it almost losslessly; judge methods on group 128;
* a tiny Llama (4 layers, hidden 256, one kv head per head, so AWQ also scales o_proj) trained
  here for --steps steps on the project's docs/*.md: weights that were never quantized.

Every row is scored by the build's own quality gate on examples/data/eval.txt (held out: neither
the calibration text deployer/core/calibration.txt nor the docs contain it): perplexity change,
mean KL(reference || quantized), top-1 agreement against the fp32 source; bits per weight of the
decoder's linear layers; quantization seconds (wall, gate excluded). `--baseline-repo` adds the
int4 rows of another checkout (e.g. main before exact-range int4) built in a subprocess.

Run: PYTHONPATH=. .venv/bin/python bench/quality.py [--models smollm2,trained] [--baseline-repo ../main]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from deployer.build import quality
from deployer.build.artifact import module_quants, read_manifest
from deployer.build.demo_model import make_tiny_checkpoint, prepare_smollm2
from deployer.build.pipeline import build_artifact
from deployer.build.progress import SilentProgress
from deployer.build.source import open_source
from deployer.build.spec import AwqSpec, BuildRequest, GateSpec, QuantSpec

ROOT = Path(__file__).resolve().parents[1]
EVAL_TEXT = ROOT / "examples" / "data" / "eval.txt"
# (label, scheme, group size, awq) of our safetensors builds.
OURS = [
    ("int8", "int8", 128, False),
    ("int4-g32", "int4", 32, False),
    ("int4-g32 + awq", "int4", 32, True),
    ("int4-g128", "int4", 128, False),
    ("int4-g128 + awq", "int4", 128, True),
]
# (label, scheme, GGUF int4 type) of our GGUF builds.
GGUF = [
    ("llama.cpp Q4_0", "int4", "Q4_0"),
    ("llama.cpp Q4_1", "int4", "Q4_1"),
    ("llama.cpp Q8_0", "int8", "Q4_1"),
]
Q4_K_M = 15  # llama_ftype LLAMA_FTYPE_MOSTLY_Q4_K_M
# What a baseline checkout builds in a subprocess: prints its quality and quantization seconds.
CHILD = """
import json, sys, time
from pathlib import Path
import torch
torch.set_num_threads(2)
from deployer.build.pipeline import build_artifact
from deployer.build.spec import BuildRequest, GateSpec, QuantSpec
class Timer:
    gate_at = None
    def stage(self, text):
        if text.startswith("quality gate") and self.gate_at is None:
            self.gate_at = (time.perf_counter(), time.process_time())
    def start_tensors(self, total, total_bytes): pass
    def tensor_done(self, name, nbytes): pass
    def close(self): pass
timer, started = Timer(), (time.perf_counter(), time.process_time())
gate = GateSpec(Path(sys.argv[3]), max_tokens=int(sys.argv[5]))
request = BuildRequest(Path(sys.argv[1]), "bench", "1.0.0", QuantSpec("int4", int(sys.argv[2])),
                       Path(sys.argv[4]), gate, use_cache=False)
result = build_artifact(request, progress=timer)
print(json.dumps({**result.quality.to_json(), "seconds": timer.gate_at[0] - started[0],
                  "cpu_seconds": timer.gate_at[1] - started[1],
                  "artifact_dir": str(result.artifact_dir)}))
"""


@dataclass(frozen=True)
class Row:
    """One build's figures."""

    label: str
    bits: float
    increase_pct: float
    mean_kl: float
    top1: float
    seconds: float
    cpu_seconds: float


class _GateTimer(SilentProgress):
    """Wall and CPU seconds (this process, all threads) from its creation until the quality gate
    starts (or `seconds()` is called): the quantization time."""

    def __init__(self) -> None:
        self.started = (time.perf_counter(), time.process_time())
        self.gate_at: tuple[float, float] | None = None

    def stage(self, text: str) -> None:
        if text.startswith("quality gate") and self.gate_at is None:
            self.gate_at = (time.perf_counter(), time.process_time())

    def seconds(self) -> tuple[float, float]:
        end = self.gate_at or (time.perf_counter(), time.process_time())
        return end[0] - self.started[0], end[1] - self.started[1]


def _row(label: str, q, timer: _GateTimer) -> Row:
    return Row(label, q.bits_per_weight, q.increase_pct, q.mean_kl, q.top1_agreement, *timer.seconds())


def ours(source: Path, work: Path, gate: GateSpec) -> list[Row]:
    rows = []
    for label, scheme, group, awq in OURS:
        timer = _GateTimer()
        request = BuildRequest(
            source,
            "bench",
            "1.0.0",
            QuantSpec(scheme, group),
            work / label.replace(" ", ""),
            gate,
            use_cache=False,
            awq=AwqSpec() if awq else None,
        )
        result = build_artifact(request, progress=timer)
        rows.append(_row(label, result.quality, timer))
    return rows


def gguf(source: Path, work: Path, gate: GateSpec) -> list[Row]:
    rows = []
    for label, scheme, int4_type in GGUF:
        timer = _GateTimer()
        request = BuildRequest(
            source,
            "bench",
            "1.0.0",
            QuantSpec(scheme, 32),
            work / label.replace(" ", ""),
            gate,
            use_cache=False,
            format="gguf",
            gguf_int4=int4_type,
        )
        result = build_artifact(request, progress=timer)
        rows.append(_row(label, result.quality, timer))
    return rows


def q4_k_m(source: Path, work: Path, gate: GateSpec) -> Row:
    """llama.cpp's own Q4_K_M quantizer (no importance matrix) on our f16 GGUF, scored by llama.cpp."""
    import llama_cpp
    from gguf import GGUFReader

    from deployer.build.gguf_writer import GGUF_NAME

    timer = _GateTimer()
    request = BuildRequest(
        source, "bench", "1.0.0", QuantSpec("fp16"), work / "f16", use_cache=False, format="gguf"
    )
    f16 = build_artifact(request).artifact_dir / GGUF_NAME
    out = work / "q4_k_m.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = Q4_K_M
    params.nthread = 2
    if llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), params) != 0:
        raise RuntimeError("llama_model_quantize failed")
    timer.stage("quality gate")
    model = open_source(source)
    records = {
        t.name: _Stored(t.tensor_type.name, tuple(int(d) for d in t.shape)) for t in GGUFReader(out).tensors
    }
    bits = quality.bits_per_weight(records, {})
    with quality.llama_cpp_scorer(out, quality.window(model)) as scorer:
        report = quality.measure(model, scorer, gate, bits)
    return _row("llama.cpp Q4_K_M (no imatrix)", report, timer)


@dataclass(frozen=True)
class _Stored:
    dtype: str
    shape: tuple[int, ...]


def baseline(repo: Path, source: Path, work: Path, max_tokens: int) -> list[Row]:
    rows = []
    for group in (32, 128):
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                CHILD,
                str(source),
                str(group),
                str(EVAL_TEXT),
                str(work / f"base{group}"),
                str(max_tokens),
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=repo,
            env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"},
        )
        q = json.loads(out.stdout.strip().splitlines()[-1])
        manifest = read_manifest(Path(q["artifact_dir"]))  # format 1: this checkout reads it too
        bits = quality.bits_per_weight(manifest.tensors, module_quants(manifest))
        label = f"int4-g{group}, {repo.name}"
        increase, kl, top1 = q["perplexity"]["increase_pct"], q["mean_kl"], q["top1_agreement"]
        rows.append(Row(label, bits, increase, kl, top1, q["seconds"], q["cpu_seconds"]))
    return rows


def trained_model(dest: Path, corpus: str, steps: int) -> tuple[Path, float]:
    """A tiny Llama (hidden 256, 4 layers, 4 heads with 4 kv heads) trained for `steps` steps of
    next-token prediction on `corpus` (seeded), saved in HF layout; and its last training loss."""
    from transformers import AutoModelForCausalLM

    from deployer.build.quality import encode

    source = make_tiny_checkpoint(
        dest,
        hidden_size=256,
        intermediate_size=704,
        num_layers=4,
        num_heads=4,
        num_kv_heads=4,
        vocab_corpus=corpus,
    )
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    ids = torch.tensor(encode(open_source(source), corpus))
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - 128, (8,))
        batch = torch.stack([ids[s : s + 128] for s in starts.tolist()])
        loss = model(batch, labels=batch).loss  # transformers shifts the labels by one
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    model.eval()
    model.save_pretrained(source, safe_serialization=True)
    return source, float(loss)


def table(title: str, rows: list[Row]) -> Table:
    result = Table(title=title)
    for col in ("build", "bits/weight", "ppl change", "mean KL", "top-1", "quantize s", "CPU s"):
        result.add_column(col, justify="right")
    for r in rows:
        result.add_row(
            r.label,
            f"{r.bits:.2f}",
            f"{r.increase_pct:+.2f}%",
            f"{r.mean_kl:.3g}",
            f"{r.top1:.3f}",
            f"{r.seconds:.1f}",
            f"{r.cpu_seconds:.1f}",
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2,trained")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=300, help="training steps of the second model")
    parser.add_argument("--baseline-repo", type=Path, help="also build int4 with this checkout's code")
    args = parser.parse_args()
    torch.set_num_threads(2)
    console = Console(width=150)  # the table whole, also when piped
    gate = GateSpec(EVAL_TEXT, max_tokens=args.max_tokens)
    with tempfile.TemporaryDirectory(prefix="sits-bench-quality-") as tmp:
        work = Path(tmp)
        models = {}
        if "smollm2" in args.models:
            models["SmolLM2-135M-Instruct"] = prepare_smollm2()
        if "trained" in args.models:
            corpus = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
            trained, loss = trained_model(work / "trained", corpus, args.steps)
            models[f"tiny Llama trained {args.steps} steps on docs/ (last loss {loss:.2f})"] = trained
        for i, (name, source) in enumerate(models.items()):
            out = work / f"model{i}"
            rows = [*ours(source, out, gate), *gguf(source, out, gate)]
            if quality.llama_cpp_available():
                rows.append(q4_k_m(source, out, gate))
            if args.baseline_repo:
                rows += baseline(args.baseline_repo.resolve(), source, out, args.max_tokens)
            console.print(table(f"{name}: quantized vs fp32 source on examples/data/eval.txt", rows))
    runtime = "llama.cpp" if quality.llama_cpp_available() else "torch (llama.cpp not installed)"
    threads = torch.get_num_threads()
    console.print(
        f"[dim]torch {torch.__version__}, {threads} threads, CPU; GGUF rows scored by {runtime}[/dim]"
    )


if __name__ == "__main__":
    main()
