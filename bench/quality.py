"""Quantization quality bench: ours (int8, int4 group 32 / 128, with and without AWQ) against
llama.cpp's Q4_0, Q4_1, Q8_0 written by our GGUF writer, and llama.cpp's own quantizer
(llama_model_quantize) on the f16 GGUF our writer produces: Q4_K_M without and with our importance
matrix (on deployer/core/calibration.txt), Q5_K_M, Q6_K, Q8_0 (these rows are builds with
`quantization.gguf_type`), and Q4_0, Q4_1 quantized directly. `--llama-tools` (llama.cpp's
build/bin) adds Q4_K_M with llama-imatrix's own matrix on the same text. Same source weights,
one run, one held-out text.

Two models:
* SmolLM2-135M-Instruct (`builtin:`): its fp32 checkpoint is itself dequantized Q4_1 blocks of 32,
  so group-32 int4 with an exact range reproduces it almost losslessly; judge methods on group 128;
* a tiny Llama (4 layers, hidden 256, one kv head per head, so AWQ also scales o_proj) trained
  here for --steps steps on the project's docs/*.md: weights that were never quantized.

Every row is scored by the build's own quality gate on examples/data/eval.txt (held out: neither
the calibration text deployer/core/calibration.txt nor the docs contain it): perplexity change,
mean KL(reference || quantized), top-1 agreement against the fp32 source; bits per weight of the
decoder's linear layers; quantization seconds (wall, gate excluded); decode tokens per second
of each GGUF on llama.cpp (2 threads, greedy, 64 tokens after a short prompt). `--baseline-repo`
adds the int4 rows of another checkout (e.g. main before exact-range int4) built in a subprocess.

`--rows auto` builds the measured mixed precision (`scheme: auto`) at three budgets: halfway from
int4-g128's stored size to int4-g32's, int4-g32's, and halfway from int4-g32's to int8's; beside
the same run's int4-g128, int4-g32, int8 and the fixed `layered` preset.

Run: PYTHONPATH=. .venv/bin/python bench/quality.py [--models smollm2,trained] [--baseline-repo ../main]
     [--llama-tools ~/.cache/sits-deployer/llama-cpp/<key>/llama_cpp_python-<v>/vendor/llama.cpp/build/bin]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from deployer.build import llama_quant, quality
from deployer.build.artifact import module_quants, read_manifest
from deployer.build.demo_model import make_tiny_checkpoint, prepare_smollm2
from deployer.build.gguf_writer import GGUF_NAME
from deployer.build.pipeline import build_artifact
from deployer.build.progress import SilentProgress
from deployer.build.source import open_source
from deployer.build.spec import AwqSpec, BuildRequest, GateSpec, LlamaQuantSpec, QuantSpec
from deployer.core.calibration import DEFAULT_CALIBRATION
from deployer.core.safetensors_io import DTYPE_SIZES

ROOT = Path(__file__).resolve().parents[1]
EVAL_TEXT = ROOT / "examples" / "data" / "eval.txt"
# (label, scheme, group size, awq, gptq) of our safetensors builds.
OURS = [
    ("int8", "int8", 128, False, False),
    ("int4-g32", "int4", 32, False, False),
    ("int4-g32 + awq", "int4", 32, True, False),
    ("int4-g128", "int4", 128, False, False),
    ("int4-g128 + awq", "int4", 128, True, False),
    ("int4-g128 + gptq", "int4", 128, False, True),
    ("int4-g128 + awq + gptq", "int4", 128, True, True),
]
# (label, scheme, GGUF int4 type) of our GGUF writer's builds.
GGUF = [
    ("GGUF Q4_0 (our writer)", "int4", "Q4_0"),
    ("GGUF Q4_1 (our writer)", "int4", "Q4_1"),
    ("GGUF Q8_0 (our writer)", "int8", "Q4_1"),
]
# llama.cpp types the pipeline's gguf_type does not offer, quantized directly from the same f16 GGUF.
BY_HAND = ["Q4_0", "Q4_1"]
# (gguf_type, importance matrix) of the `gguf_type` builds: llama.cpp's quantizer in the pipeline.
LLAMA = [("Q4_K_M", False), ("Q4_K_M", True), ("Q5_K_M", True), ("Q6_K", True), ("Q8_0", False)]
DECODE_TOKENS = 64
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
    decode_tps: float | None = None  # llama.cpp's decode speed (GGUF rows)


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


def _row(label: str, q, timer: _GateTimer, gguf: Path | None = None) -> Row:
    tps = decode_tps(gguf) if gguf is not None and quality.llama_cpp_available() else None
    return Row(label, q.bits_per_weight, q.increase_pct, q.mean_kl, q.top1_agreement, *timer.seconds(), tps)


def decode_tps(path: Path) -> float:
    """Greedy decode tokens per second of the GGUF at `path` on llama.cpp (2 threads): the time
    from the first generated token to the last, after the prompt."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=256, n_threads=2, n_threads_batch=2, verbose=False, seed=0)
    tokens = llm.tokenize(b"The history of the city begins", add_bos=True)
    produced, first = 0, 0.0
    for _ in llm.generate(tokens, temp=0.0, top_k=1):
        produced += 1
        if produced == 1:
            first = time.perf_counter()
        if produced > DECODE_TOKENS:
            break
    seconds = time.perf_counter() - first
    llm.close()
    return (produced - 1) / seconds


def ours(source: Path, work: Path, gate: GateSpec) -> list[Row]:
    rows = []
    for label, scheme, group, awq, gptq in OURS:
        timer = _GateTimer()
        request = BuildRequest(
            source,
            "bench",
            "1.0.0",
            QuantSpec(scheme, group),
            work / label.replace(" ", ""),
            gate,
            use_cache=False,
            awq=AwqSpec(scales=awq, gptq=gptq) if awq or gptq else None,
        )
        result = build_artifact(request, progress=timer)
        rows.append(_row(label, result.quality, timer))
    return rows


def auto(source: Path, work: Path, gate: GateSpec) -> list[Row]:
    """`scheme: auto` at three budgets set by the same run's int4-g128, int4-g32 and int8 builds
    (their stored tensors' bytes), and the fixed `layered` preset."""
    rows, sizes = [], {}
    for label, spec in (
        ("int4-g128", QuantSpec("int4", 128)),
        ("int4-g32", QuantSpec("int4", 32)),
        ("int8", QuantSpec("int8")),
        ("layered (fixed)", QuantSpec("layered")),
    ):
        timer = _GateTimer()
        request = BuildRequest(source, "bench", "1.0.0", spec, work / "auto", gate, use_cache=False)
        result = build_artifact(request, progress=timer)
        rows.append(_row(label, result.quality, timer))
        manifest = read_manifest(result.artifact_dir)
        sizes[label] = sum(DTYPE_SIZES[t.dtype] * math.prod(t.shape) for t in manifest.tensors.values())
    small, g32, large = sizes["int4-g128"], sizes["int4-g32"], sizes["int8"]
    for budget in ((small + g32) // 2, g32, (g32 + large) // 2):
        timer = _GateTimer()
        spec = QuantSpec("auto", max_size=budget)
        request = BuildRequest(source, "bench", "1.0.0", spec, work / "auto", gate, use_cache=False)
        result = build_artifact(request, progress=timer)
        choices = read_manifest(result.artifact_dir).quantization.spec.auto
        counts = Counter(m.choice for m in choices.modules.values()) if choices else Counter()
        mix = ", ".join(f"{counts[c]} {c}" for c in ("int4-g128", "int4-g32", "int8") if counts[c])
        rows.append(_row(f"auto, max_size {budget / 1e6:.1f}M ({mix})", result.quality, timer))
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
        rows.append(_row(label, result.quality, timer, result.artifact_dir / GGUF_NAME))
    return rows


def llama(source: Path, work: Path, gate: GateSpec) -> list[Row]:
    """`gguf_type` builds: llama.cpp's quantizer (and llama-imatrix) on our f16 GGUF."""
    rows = []
    for gguf_type, imatrix in LLAMA:
        timer = _GateTimer()
        request = BuildRequest(
            source,
            "bench",
            "1.0.0",
            QuantSpec("fp16"),
            work / f"{gguf_type}{imatrix}",
            gate,
            use_cache=False,
            format="gguf",
            llama_quant=LlamaQuantSpec(gguf_type, imatrix),
        )
        result = build_artifact(request, progress=timer)
        label = f"llama.cpp {gguf_type}" + (" + imatrix" if request.llama_quant.uses_imatrix else "")
        rows.append(_row(label, result.quality, timer, result.artifact_dir / GGUF_NAME))
    return rows


def by_hand(source: Path, work: Path, gate: GateSpec, tools: Path | None) -> list[Row]:
    """llama.cpp's quantizer called directly on our f16 GGUF: Q4_0 and Q4_1 (types the pipeline's
    gguf_type does not offer), and, with llama.cpp's programs in `tools`, Q4_K_M weighted by
    llama-imatrix's own matrix on the same calibration text (to compare with ours)."""
    request = BuildRequest(source, "bench", "1.0.0", QuantSpec("fp16"), work / "f16", format="gguf")
    f16 = build_artifact(request).artifact_dir / GGUF_NAME
    model = open_source(source)
    jobs: list[tuple[str, str, Callable[[], llama_quant.Imatrix | None]]] = [
        (f"llama.cpp {t} (llama_model_quantize)", t, lambda: None) for t in BY_HAND
    ]
    if tools is not None:
        jobs.append(("llama.cpp Q4_K_M + llama-imatrix", "Q4_K_M", lambda: llama_imatrix(tools, f16, work)))
    rows = []
    for label, gguf_type, imatrix in jobs:
        timer = _GateTimer()
        out = work / f"{gguf_type}-{len(rows)}.gguf"
        llama_quant.quantize(f16, out, gguf_type, imatrix(), 2)
        timer.stage("quality gate")
        bits = quality.bits_per_weight(llama_quant.gguf_records(out), {})
        with quality.llama_cpp_scorer(out, quality.window(model)) as scorer:
            report = quality.measure(model, scorer, gate, bits)
        rows.append(_row(label, report, timer, out))
    return rows


def llama_imatrix(tools: Path, f16: Path, work: Path) -> llama_quant.Imatrix:
    """llama-imatrix's matrix of `f16` on the shipped calibration text (chunks of 128 tokens),
    read from its GGUF file as llama-quantize reads it: each entry's sums over its count."""
    from gguf import GGUFReader

    out = work / "llama-imatrix.gguf"
    command = [tools / "llama-imatrix", "-m", f16, "-f", DEFAULT_CALIBRATION, "-o", out]
    subprocess.run([*command, "-c", "128", "-t", "2", "--no-ppl"], check=True, capture_output=True)
    tensors = {t.name: np.asarray(t.data, dtype=np.float32).reshape(-1) for t in GGUFReader(out).tensors}
    values, tokens = {}, 0
    for name, sums in tensors.items():
        if name.endswith(".in_sum2"):
            counts = tensors[name.removesuffix(".in_sum2") + ".counts"]
            values[name.removesuffix(".in_sum2")] = sums / counts[0]
            tokens = int(counts[0])
    return llama_quant.Imatrix(values, tokens)


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
    for col in (
        "build",
        "bits/weight",
        "ppl change",
        "mean KL",
        "top-1",
        "quantize s",
        "CPU s",
        "decode tok/s",
    ):
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
            "" if r.decode_tps is None else f"{r.decode_tps:.0f}",
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2,trained")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument(
        "--rows",
        default="ours,gguf",
        help="ours (torch engine), gguf (llama.cpp), auto (measured mixed precision)",
    )
    parser.add_argument("--steps", type=int, default=300, help="training steps of the second model")
    parser.add_argument("--baseline-repo", type=Path, help="also build int4 with this checkout's code")
    parser.add_argument(
        "--llama-tools", type=Path, help="llama.cpp's build/bin: adds Q4_K_M with llama-imatrix's matrix"
    )
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
            rows = [*ours(source, out, gate)] if "ours" in args.rows else []
            if "auto" in args.rows:
                rows += auto(source, out, gate)
            if "gguf" in args.rows:
                rows += [*gguf(source, out, gate), *llama(source, out, gate)]
                if quality.llama_cpp_available():
                    rows += by_hand(source, out, gate, args.llama_tools)
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
