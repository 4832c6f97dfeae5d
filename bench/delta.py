"""Real weight pairs from SmolLM2-135M-Instruct for bench/delta.py, made once and cached.

Variants of the base checkpoint (HF layout, fp32):
  finetune    a short real fine-tune: AdamW, lr 5e-5, 30 steps of 2x64 tokens of repository text
  lora        a merged rank-8 LoRA on every q_proj and v_proj (alpha 16; A ~ kaiming, B ~ 2e-3)
  lastlayers  the last two decoder layers nudged (every tensor, noise at 1% of its std)
Each variant and the base are then built into artifacts by deployer.build (fp32, bf16, int8,
int4-g128), so the pairs compared are real artifacts with the builder's byte layout.

With --scale SHAPE (qwen2.5-1.5b, qwen2.5-3b, llama-3-8b: bench/shapes.py's random checkpoints at
int4-g128; --base reuses an artifact already built) it measures instead what issue #38 asks at real
model sizes: create throughput and apply's peak RSS for a new version touching every tensor a little
and one touching two layers, against hashing and copying the same artifact in the same run. The
versions are written to a scratch directory (--work) and removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from deployer.build.demo_model import cache_root, prepare_smollm2
from deployer.build.pipeline import build_artifact
from deployer.build.spec import BuildRequest, QuantSpec
from deployer.core.hashing import sha256_file
from deployer.core.patch_format import read_header as read_patch_header
from deployer.core.safetensors_io import read_header
from deployer.release.delta import create_patch

VARIANTS = ("finetune", "lora", "lastlayers")
SCHEMES = {
    "fp32": QuantSpec("fp32"),
    "bf16": QuantSpec("bf16"),
    "int8": QuantSpec("int8"),
    "int4-g128": QuantSpec("int4", group_size=128),
}
ROOT = cache_root() / "bench-delta"
REPO = Path(__file__).resolve().parent.parent
_TEXT_FILES = ("docs/artifact-format.md", "deployer/errors.py")


def source_dirs() -> dict[str, Path]:
    """The base and every variant as HF-layout directories (made on first use)."""
    base = prepare_smollm2()
    dirs = {"base": base}
    for name in VARIANTS:
        dest = ROOT / "sources" / name
        if not (dest / ".complete").is_file():
            _make_variant(name, base, dest)
        dirs[name] = dest
    return dirs


def artifacts(scheme: str) -> dict[str, Path]:
    """Artifacts of the base and every variant in `scheme` (the builder caches them)."""
    out = {}
    for name, src in source_dirs().items():
        request = BuildRequest(
            source_dir=src,
            name="smollm2-135m-instruct",
            version=f"1.0.0-{name}",
            quant=SCHEMES[scheme],
            store_dir=ROOT / "store",
        )
        out[name] = build_artifact(request).artifact_dir
    return out


def _make_variant(name: str, base: Path, dest: Path) -> None:
    from transformers import LlamaForCausalLM

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    {"finetune": _finetune, "lora": _merge_lora, "lastlayers": _nudge_last_layers}[name](model)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for f in base.iterdir():
        if f.is_file() and f.name != "model.safetensors" and not f.name.startswith("."):
            shutil.copyfile(f, dest / f.name)
    model.save_pretrained(dest, safe_serialization=True)
    (dest / ".complete").write_text("ok\n")


def _finetune(model: torch.nn.Module) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prepare_smollm2())
    text = "\n".join((REPO / f).read_text() for f in _TEXT_FILES)
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    model.train()
    for step in range(30):
        start = (step * 128) % max(1, len(ids) - 129)
        batch = ids[start : start + 128].reshape(2, 64)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


@torch.no_grad()
def _merge_lora(model: torch.nn.Module, rank: int = 8, alpha: float = 16.0) -> None:
    gen = torch.Generator().manual_seed(1)
    for layer in model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.v_proj):
            out_f, in_f = proj.weight.shape
            a = (torch.rand(rank, in_f, generator=gen) * 2 - 1) / in_f**0.5
            b = torch.randn(out_f, rank, generator=gen) * 2e-3
            proj.weight += (b @ a) * (alpha / rank)


@torch.no_grad()
def _nudge_last_layers(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(2)
    for layer in model.model.layers[-2:]:
        for p in layer.parameters():
            p += torch.randn(p.shape, generator=gen) * p.std() * 0.01


# ---------------------------------------------------------------------------------------------
# Real model sizes (issue #38): int4-g128 artifacts of bench/shapes.py's random checkpoints, and two
# new versions of each: one touching every tensor a little, one touching the last two layers.

SCALE_SHAPES = ("qwen2.5-1.5b", "qwen2.5-3b", "llama-3-8b")
SCALE_VARIANTS = ("every-tensor", "two-layers")
# Each new version's model version, so a device can install it over the base (1.0.0).
SCALE_VERSIONS = {"every-tensor": "1.1.0", "two-layers": "1.2.0"}
# A new version's float tensors move by this much of their std; of its packed int4 weights, this
# share of the bytes has a nibble one step up or down: what requantizing a model whose weights
# moved by about 1% of their std does to an int4-g128 artifact.
NUDGE = 0.01
NIBBLE_SHARE = 0.025


def scale_artifacts(shape: str, work: Path, base: Path | None) -> dict[str, Path]:
    """The int4-g128 artifact of `shape`'s checkpoint (`base` when given, else built into `work`
    without the quality gate) and each SCALE_VARIANTS version of it, written into `work`. The
    versions are made from the artifact itself, a tensor at a time: requantizing a changed 8B
    checkpoint would take longer than the bench. Nothing is cached: the caller removes `work`
    (two 8B versions are 10 GB)."""
    if base is None:
        sys.path.insert(0, str(REPO))  # `python bench/delta.py` puts bench/ on the path, not the repository
        from bench.shapes import checkpoint

        request = BuildRequest(
            source_dir=checkpoint(shape),
            name=shape,
            version="1.0.0",
            quant=SCHEMES["int4-g128"],
            store_dir=work / "store",
        )
        base = build_artifact(request).artifact_dir
    out = {"base": base}
    for variant in SCALE_VARIANTS:
        out[variant] = work / variant
        _nudged_copy(base, out[variant], variant)
    return out


def _nudged_copy(src: Path, dest: Path, variant: str) -> None:
    """`src` with its weights nudged per `variant` (a new version's artifact), at `dest`."""
    from deployer.core.canonical import canonical_json, parse_json

    shutil.copytree(src, dest)
    manifest = parse_json((dest / "sits-manifest.json").read_bytes(), "manifest")
    last = manifest["quantization"]["modules"]
    layers = 1 + max(int(name.split(".")[2]) for name in last if name.startswith("model.layers."))
    touched = (f"model.layers.{layers - 2}.", f"model.layers.{layers - 1}.")
    rng = np.random.default_rng(3)
    weights = dest / WEIGHTS
    data = np.memmap(weights, dtype=np.uint8, mode="r+")
    for t in read_header(weights).tensors:
        if variant == "every-tensor" or t.name.startswith(touched):
            _nudge(data[t.offset : t.offset + t.length], t.dtype, rng)
    data.flush()
    del data
    manifest["files"][WEIGHTS] = {"sha256": sha256_file(weights), "size": weights.stat().st_size}
    manifest["model"]["version"] = SCALE_VERSIONS[variant]
    (dest / "sits-manifest.json").write_bytes(canonical_json(manifest))


_FLOATS = {"F16": np.float16, "F32": np.float32, "BF16": np.uint16}


def _nudge(raw: np.ndarray, dtype: str, rng: np.random.Generator) -> None:
    """Nudge one tensor's bytes in place, 8 Mi elements at a time (see NUDGE and NIBBLE_SHARE)."""
    step = 8 * 2**20
    if dtype == "U8":  # packed int4: the low nibble of some bytes one step up or down, clamped
        for start in range(0, len(raw), step):
            chunk = raw[start : start + step]
            picked = np.flatnonzero(rng.random(len(chunk)) < NIBBLE_SHARE)
            low = chunk[picked] & 0x0F
            moved = np.clip(low.astype(np.int16) + rng.choice((-1, 1), len(picked)), 0, 15)
            chunk[picked] = (chunk[picked] & 0xF0) | moved.astype(np.uint8)
        return
    values = raw.view(_FLOATS[dtype])
    as_f32 = (lambda v: (v.astype(np.uint32) << 16).view(np.float32)) if dtype == "BF16" else np.float32
    std = float(np.asarray(as_f32(values[:: max(1, len(values) // 65536)])).std()) or 1.0
    for start in range(0, len(values), step):
        chunk = np.asarray(as_f32(values[start : start + step]), dtype=np.float32)
        chunk += rng.standard_normal(len(chunk), dtype=np.float32) * (std * NUDGE)
        if dtype == "BF16":
            values[start : start + step] = (chunk.view(np.uint32) >> 16).astype(np.uint16)
        else:
            values[start : start + step] = chunk.astype(values.dtype)


# ---------------------------------------------------------------------------------------------
# Measuring: ours against bsdiff4 (whole file), xdelta3 -9 and zstd -19 --long=27 --patch-from.

WEIGHTS = "model.safetensors"
APPLY_OURS = (
    "import sys; from pathlib import Path; from deployer.core.patch_apply import apply_patch; "
    "apply_patch(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))"
)
IMPORTS_ONLY = "import deployer.core.patch_apply"
BSDIFF_DIFF = "import sys, bsdiff4; bsdiff4.file_diff(*sys.argv[1:4])"
BSDIFF_PATCH = "import sys, bsdiff4; bsdiff4.file_patch(*sys.argv[1:4])"


@dataclass(frozen=True)
class Run:
    """One child process: wall seconds, peak RSS in MiB, whether it finished in time, and its CPU
    seconds (user + system, its threads and children included: on a shared machine the wall time
    grows with the load, this barely does)."""

    seconds: float
    rss_mib: float
    ok: bool
    cpu_s: float = float("nan")


@dataclass(frozen=True)
class Result:
    """One tool on one scenario. `size` is None when creating timed out or was skipped."""

    tool: str
    size: int | None
    create: Run | None
    apply: Run | None
    note: str = ""


def run(cmd: list[str], timeout: float) -> Run:
    """Run `cmd`, killing it after `timeout` s; wall time and the peak RSS of `cmd` alone.

    The command runs under a small Python wrapper that forks it: a child spawned straight from
    this large process would inherit our RSS as its high-water mark, so the wrapper's own wait4
    is what measures the peak.
    """
    start = time.perf_counter()
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(
            [sys.executable, "-c", _MEASURE, *cmd],
            stdout=subprocess.DEVNULL,
            stderr=errors,
            env=os.environ | {"PYTHONPATH": str(REPO)},
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return Run(time.perf_counter() - start, float("nan"), ok=False)
        seconds = time.perf_counter() - start
        errors.seek(0)
        text = errors.read().decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed: {text[-500:]}")
    words = text.rsplit("MAXRSS ", 1)[1].split()
    return Run(seconds, int(words[0]) / 1024, ok=True, cpu_s=float(words[2]))


_MEASURE = (
    "import os, sys\n"
    "pid = os.fork()\n"
    "if pid == 0:\n    os.execvp(sys.argv[1], sys.argv[1:])\n"
    "_, status, usage = os.wait4(pid, 0)\n"
    "sys.stderr.write(f'MAXRSS {usage.ru_maxrss} CPU {usage.ru_utime + usage.ru_stime}\\n')\n"
    "sys.exit(os.waitstatus_to_exitcode(status))\n"
)


def ours(base: Path, target: Path, work: Path) -> Result:
    """Our patch: created in this process (timed), applied in a child (timed, peak RSS)."""
    patch, out = work / "ours.patch", work / "ours-out"
    start = time.perf_counter()
    create_patch(base, target, patch)
    create = Run(time.perf_counter() - start, float("nan"), ok=True)
    out.mkdir()
    applied = run([sys.executable, "-c", APPLY_OURS, str(patch), str(base), str(out)], 600)
    _same(out / WEIGHTS, target / WEIGHTS)
    header, header_len = read_patch_header(patch)
    coders = "+".join(s.coder.value for s in header.streams) or "no streams"
    note = f"header {header_len / 1024:.1f} KiB; {coders}"
    return Result("ours", patch.stat().st_size, create, applied, note=note)


def anchor(tool: str, base: Path, target: Path, work: Path, timeout: float) -> Result:
    """A whole-file tool on the weights file; 'timeout' when creating takes longer than allowed."""
    patch, out = work / f"{tool}.patch", work / f"{tool}.out"
    make, apply = _commands(tool, base / WEIGHTS, target / WEIGHTS, patch, out)
    created = run(make, timeout)
    if not created.ok:
        return Result(tool, None, created, None, note=f"timeout > {timeout:.0f} s")
    applied = run(apply, 600)
    _same(out, target / WEIGHTS)
    size = patch.stat().st_size
    patch.unlink()
    out.unlink()
    return Result(tool, size, created, applied)


def _commands(tool: str, old: Path, new: Path, patch: Path, out: Path) -> tuple[list, list]:
    py = sys.executable
    if tool == "bsdiff4":
        return (
            [py, "-c", BSDIFF_DIFF, str(old), str(new), str(patch)],
            [py, "-c", BSDIFF_PATCH, str(old), str(out), str(patch)],
        )
    if tool == "xdelta3 -9":
        return (
            ["xdelta3", "-9", "-e", "-f", "-s", str(old), str(new), str(patch)],
            ["xdelta3", "-d", "-f", "-s", str(old), str(patch), str(out)],
        )
    return (
        ["zstd", "-q", "-f", "-19", "--long=27", f"--patch-from={old}", str(new), "-o", str(patch)],
        ["zstd", "-q", "-f", "-d", "--long=31", f"--patch-from={old}", str(patch), "-o", str(out)],
    )


def _same(a: Path, b: Path) -> None:
    if sha256_file(a) != sha256_file(b):
        raise RuntimeError(f"{a} does not reproduce {b}: the bench is wrong, not the figures")


def largest_tensor_mib(artifact: Path) -> float:
    """The largest tensor of the artifact's weights, MiB."""
    return max(t.length for t in read_header(artifact / WEIGHTS).tensors) / 2**20


def scenario(scheme: str, variant: str, arts: dict[str, Path], args: argparse.Namespace) -> list[Result]:
    """Every tool on base -> variant in one scheme (bsdiff4 only on the integer schemes)."""
    base, target = arts["base"], arts[variant]
    with tempfile.TemporaryDirectory(prefix="sits-bench-", dir=args.work) as tmp:
        work = Path(tmp)
        results = [ours(base, target, work)]
        for tool in ("bsdiff4", "xdelta3 -9", "zstd -19 --long=27"):
            if tool == "bsdiff4" and scheme in ("fp32", "bf16"):
                results.append(Result(tool, None, None, None, note="skipped: float (FACTS.md)"))
                continue
            results.append(anchor(tool, base, target, work, args.timeout))
    return results


def _fmt_mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _fmt_run(r: Run | None, rss: bool = False) -> str:
    if r is None or not r.ok:
        return "-"
    return f"{r.rss_mib:.0f}" if rss else f"{r.seconds:.1f}"


def print_table(rows: list[tuple[str, str, float, float, list[Result]]], baseline_rss: float) -> None:
    """One table, every scenario and tool side by side, then the targets checked."""
    table = Table(title="Delta patches of SmolLM2-135M-Instruct weights (model.safetensors)")
    for col in (
        "scheme",
        "change",
        "tool",
        "patch MiB",
        "% of target",
        "create s",
        "apply s",
        "apply RSS MiB",
        "note",
    ):
        table.add_column(col, justify="left" if col in ("scheme", "change", "tool", "note") else "right")
    verdicts = []
    for scheme, variant, target_mib, tensor_mib, results in rows:
        for r in results:
            pct = "-" if r.size is None else f"{100 * r.size / 2**20 / target_mib:.2f}"
            table.add_row(
                scheme,
                variant,
                r.tool,
                _fmt_mib(r.size),
                pct,
                _fmt_run(r.create),
                _fmt_run(r.apply),
                _fmt_run(r.apply, rss=True),
                r.note,
            )
        table.add_section()
        verdicts.append(_verdict(scheme, variant, tensor_mib, results))
    console = Console(width=150)
    console.print(table)
    console.print(f"python + numpy + zstandard import alone: {baseline_rss:.0f} MiB peak RSS")
    for line in verdicts:
        console.print(line)


def _verdict(scheme: str, variant: str, tensor_mib: float, results: list[Result]) -> str:
    mine, anchors = results[0], [r for r in results[1:] if r.size is not None]
    best = min(anchors, key=lambda r: r.size or 0, default=None)
    size_ok = best is None or (mine.size or 0) <= (best.size or 0)
    bsdiff = results[1]
    if bsdiff.create is not None and mine.create is not None:
        prefix = ">=" if not bsdiff.create.ok else ""
        speed = f"{prefix}{bsdiff.create.seconds / mine.create.seconds:.0f}x bsdiff4"
    else:
        speed = "bsdiff4 not run"
    rss = mine.apply.rss_mib if mine.apply else float("nan")
    return (
        f"{scheme}/{variant}: size {'OK' if size_ok else 'LARGER'} vs best anchor "
        f"({best.tool if best else 'none finished'}); create {speed}; apply RSS "
        f"{rss:.0f} MiB = {rss / tensor_mib:.2f}x largest tensor ({tensor_mib:.0f} MiB)"
    )


# ---------------------------------------------------------------------------------------------
# Real model sizes: every step in a child process (wall time, peak RSS), against the two things any
# delta must beat or match on the same files in the same run: hashing the artifact and copying it.

CREATE_OURS = (
    "import sys; from pathlib import Path; from deployer.release.delta import create_patch; "
    "create_patch(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))"
)
HASH_DIR = (
    "import sys; from pathlib import Path; from deployer.core.hashing import sha256_file; "
    "[sha256_file(p) for p in sorted(Path(sys.argv[1]).iterdir()) if p.is_file()]"
)
CREATE_TARGET_MB_S = 100.0
APPLY_TARGET_MIB = 128.0


@dataclass(frozen=True)
class Step:
    """One measured step of the scale table."""

    change: str
    step: str
    run: Run
    note: str = ""


def artifact_bytes(directory: Path) -> int:
    """Bytes of every file of an artifact directory."""
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def scale_steps(arts: dict[str, Path], work: Path, keep: str | None = None) -> list[Step]:
    """Baselines (hash, copy) on the base artifact, then create and apply for every variant. The
    patch of variant `keep` is left at work/<keep>.patch (for an install from it); the rest go."""
    base = arts["base"]
    # Hashed first, so every later step finds the base in the page cache as the baselines do.
    steps = [Step("-", "sha256 (baseline)", run([sys.executable, "-c", HASH_DIR, str(base)], 600))]
    copy = work / "copy"
    steps.append(Step("-", "cp -r (baseline)", run(["cp", "-r", str(base), str(copy)], 600)))
    shutil.rmtree(copy)
    for variant in SCALE_VARIANTS:
        patch, out = work / f"{variant}.patch", work / f"{variant}-out"
        made = run([sys.executable, "-c", CREATE_OURS, str(base), str(arts[variant]), str(patch)], 600)
        header, _ = read_patch_header(patch)
        coders = "+".join(s.coder.value for s in header.streams) or "no streams"
        size = f"patch {patch.stat().st_size / 2**20:.1f} MiB ({coders})"
        steps.append(Step(variant, "create", made, size))
        out.mkdir()
        applied = run([sys.executable, "-c", APPLY_OURS, str(patch), str(base), str(out)], 600)
        _same(out / WEIGHTS, arts[variant] / WEIGHTS)
        steps.append(Step(variant, "apply (verifies base, patch, output)", applied))
        shutil.rmtree(out)
        if variant != keep:
            patch.unlink()
    return steps


def print_scale(shape: str, arts: dict[str, Path], steps: list[Step], baseline_rss: float) -> None:
    """The scale table (throughput in MB/s of artifact bytes), then the targets checked."""
    size = artifact_bytes(arts["base"])
    tensor_mib = largest_tensor_mib(arts["base"])
    table = Table(
        title=f"Delta at {shape} int4-g128: artifact {size / 1e9:.2f} GB, largest tensor {tensor_mib:.0f} MiB"
    )
    for col in ("change", "step", "s", "MB/s", "peak RSS MiB", "note"):
        table.add_column(col, justify="left" if col in ("change", "step", "note") else "right")
    for st in steps:
        rate = size / 1e6 / st.run.seconds
        table.add_row(
            st.change, st.step, f"{st.run.seconds:.1f}", f"{rate:.0f}", f"{st.run.rss_mib:.0f}", st.note
        )
    console = Console(width=150)
    console.print(table)
    console.print(f"python + numpy + zstandard import alone: {baseline_rss:.0f} MiB peak RSS")
    for st in steps:
        if st.step == "create":
            rate = size / 1e6 / st.run.seconds
            verdict = "OK" if rate >= CREATE_TARGET_MB_S else "BELOW"
            console.print(
                f"{st.change}: create {rate:.0f} MB/s, target >= {CREATE_TARGET_MB_S:.0f}: {verdict}"
            )
        elif st.step.startswith("apply"):
            verdict = "OK" if st.run.rss_mib <= APPLY_TARGET_MIB else "ABOVE"
            rss = st.run.rss_mib
            console.print(
                f"{st.change}: apply peak RSS {rss:.0f} MiB, target <= {APPLY_TARGET_MIB:.0f}: {verdict}"
            )


def scale_main(args: argparse.Namespace) -> None:
    """--scale: artifacts and versions in a scratch directory, measured, printed, removed."""
    with tempfile.TemporaryDirectory(prefix="sits-bench-scale-", dir=args.work) as tmp:
        work = Path(tmp)
        print(f"{args.scale}: writing the new versions into {work} ...", file=sys.stderr, flush=True)
        arts = scale_artifacts(args.scale, work, Path(args.base).resolve() if args.base else None)
        steps = scale_steps(arts, work)
        baseline = run([sys.executable, "-c", IMPORTS_ONLY], 60).rss_mib
        print_scale(args.scale, arts, steps, baseline)


def main() -> None:
    """Build (or reuse) the pairs, run every tool on every scenario, print one table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="bf16 and int8 only, anchors capped at 60 s")
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="cap on each anchor's create time, s (default 120, --quick 60)",
    )
    parser.add_argument("--schemes", default=None, help="comma-separated subset of " + ",".join(SCHEMES))
    parser.add_argument("--work", default=None, help="scratch directory (default: system temp)")
    parser.add_argument(
        "--scale",
        choices=SCALE_SHAPES,
        default=None,
        help="instead: create and apply at a real model size (bench/shapes.py, int4-g128)",
    )
    parser.add_argument(
        "--base", default=None, help="with --scale: an int4-g128 artifact of that shape to reuse"
    )
    args = parser.parse_args()
    if args.scale:
        scale_main(args)
        return
    args.timeout = args.timeout or (60.0 if args.quick else 120.0)
    schemes = (args.schemes or ("bf16,int8" if args.quick else ",".join(SCHEMES))).split(",")
    torch.set_num_threads(2)
    rows = []
    for scheme in schemes:
        arts = artifacts(scheme)
        target_mib = (arts["base"] / WEIGHTS).stat().st_size / 2**20
        tensor_mib = largest_tensor_mib(arts["base"])
        for variant in VARIANTS:
            print(f"{scheme} {variant} ...", file=sys.stderr, flush=True)
            rows.append((scheme, variant, target_mib, tensor_mib, scenario(scheme, variant, arts, args)))
    baseline = run([sys.executable, "-c", IMPORTS_ONLY], 60).rss_mib
    print_table(rows, baseline)


if __name__ == "__main__":
    main()
