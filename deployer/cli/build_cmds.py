"""`sits-deployer build`: quantize the model named in deploy.yaml into the local artifact store."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from deployer.build.request import request_from_config
from deployer.build.spec import BuildRequest, BuildResult
from deployer.cli.common import console, emit_json, examples, info, output_option, verbosity
from deployer.errors import QualityGateError

if TYPE_CHECKING:
    from deployer.build.adapter import AdapterBuild
    from deployer.build.progress import BuildProgress

PROGRESS_STEP_PCT = 10  # a plain progress line each time this much more of the source is done


class LineProgress:
    """Build progress as plain lines, for a log or a pipe (a progress bar shows only on a terminal)."""

    def __init__(self) -> None:
        self._done = self._total = self._bytes = self._total_bytes = 0
        self._next_pct = PROGRESS_STEP_PCT

    def stage(self, text: str) -> None:
        """Print the phase on its own line."""
        info(text)

    def start_tensors(self, total: int, total_bytes: int) -> None:
        """Remember the totals that the lines report against."""
        self._total, self._total_bytes = total, max(total_bytes, 1)

    def tensor_done(self, name: str, nbytes: int) -> None:
        """Print a line at each PROGRESS_STEP_PCT percent of the source bytes."""
        self._done += 1
        self._bytes += nbytes
        pct = 100 * self._bytes // self._total_bytes
        if pct >= self._next_pct:
            info(f"quantized {self._done}/{self._total} tensors ({pct}%)")
            self._next_pct = (pct // PROGRESS_STEP_PCT + 1) * PROGRESS_STEP_PCT

    def close(self) -> None:
        """Nothing to remove."""


def build_progress(output: str) -> BuildProgress | None:
    """A bar on a terminal, plain lines otherwise; nothing with --output json or -q."""
    from deployer.build.progress import RichProgress

    if output != "text" or verbosity() < 0:
        return None
    return RichProgress(console()) if console().is_terminal else LineProgress()


def result_json(result: BuildResult) -> dict[str, Any]:
    """The machine-readable summary printed by `--output json`."""
    return {
        "ok": True,
        "artifact_id": result.artifact_id,
        "artifact_dir": str(result.artifact_dir),
        "cached": result.cached,
        "tensors": result.tensors,
        "bytes_written": result.bytes_written,
        "seconds": round(result.seconds, 3),
        "quality": result.quality.summary() if result.quality else None,
    }


@click.command(
    "build",
    epilog=examples(
        "sits-deployer build -f deploy.yaml",
        "sits-deployer build -f deploy.yaml --output json",
        "sits-deployer build -f deploy.yaml --no-cache",
    ),
)
@click.option(
    "-f",
    "--file",
    "config_path",
    type=click.Path(path_type=Path, dir_okay=False),
    default="deploy.yaml",
    show_default=True,
    help="The deploy.yaml naming the model, its quantization and quality gate.",
)
@click.option("--no-cache", is_flag=True, help="Rebuild even when these inputs were built before.")
@output_option
def build(config_path: Path, no_cache: bool, output: str) -> None:
    """Quantize the model into a content-addressed artifact in .sits/store/ next to deploy.yaml.

    The same inputs always give the same artifact id; an unchanged rebuild does no work.
    The build fails (exit 1, nothing stored) when the quality gate's limits are passed.
    """
    from deployer.build.adapter import adapter_requests, build_adapter
    from deployer.build.pipeline import build_artifact
    from deployer.config import load_config

    config = load_config(config_path, secrets=False)
    request = request_from_config(config, use_cache=not no_cache)
    try:
        result = build_artifact(request, progress=build_progress(output))
        # model.adapters: each built for this base artifact, its id bound to the base's.
        adapters = [
            build_adapter(r) for r in adapter_requests(config, result.artifact_id, result.artifact_dir)
        ]
    except QualityGateError as exc:
        if output == "json":
            emit_json({"ok": False, "error": "quality gate failed", "quality": exc.report})
        raise
    if output == "json":
        extra = {"adapters": [_adapter_json(a) for a in adapters]} if adapters else {}
        emit_json({**result_json(result), **extra})
        return
    _print_result(request, result)
    for a in adapters:
        info(f"adapter {a.name} {a.version}: {a.artifact_bytes:,} bytes, artifact {a.artifact_id}")
        info(f"  at {a.artifact_dir}")


def _adapter_json(build: AdapterBuild) -> dict[str, Any]:
    return {
        "name": build.name,
        "version": build.version,
        "artifact_id": build.artifact_id,
        "artifact_dir": str(build.artifact_dir),
        "bytes": build.artifact_bytes,
        "quality": build.quality.to_json() if build.quality is not None else None,
    }


def _print_result(request: BuildRequest, result: BuildResult) -> None:
    what = f"{request.name} {request.version} ({request.quant.label})"
    if result.cached:
        info(f"[green]unchanged[/green] {what}: cache hit, nothing rebuilt")
    else:
        size_mb = result.bytes_written / 1e6
        info(
            f"[green]built[/green] {what}: {result.tensors} tensors, {size_mb:.1f} MB of weights "
            f"in {result.seconds:.1f}s"
        )
    q = result.quality
    if q is not None:
        info(
            f"quality on {q.tokens} tokens: perplexity {q.reference_perplexity:.4g} -> "
            f"{q.quantized_perplexity:.4g} ({q.increase_pct:+.2f}%), top-1 agreement "
            f"{q.top1_agreement:.3f}, mean KL {q.mean_kl:.4g}, {q.bits_per_weight:g} bits per weight"
        )
    info(f"artifact {result.artifact_id}")
    info(f"  at {result.artifact_dir}")
