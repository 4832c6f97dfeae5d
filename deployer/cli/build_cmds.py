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
    pass


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
        "quality": result.quality.to_json() if result.quality else None,
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
    from deployer.build.pipeline import build_artifact
    from deployer.build.progress import RichProgress
    from deployer.config import load_config

    request = request_from_config(load_config(config_path), use_cache=not no_cache)
    show = output == "text" and verbosity() >= 0
    try:
        result = build_artifact(request, progress=RichProgress(console()) if show else None)
    except QualityGateError as exc:
        if output == "json":
            emit_json({"ok": False, "error": "quality gate failed", "quality": exc.report})
        raise
    if output == "json":
        emit_json(result_json(result))
        return
    _print_result(request, result)


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
            f"{q.top1_agreement:.3f}, mean KL {q.mean_kl:.4g}"
        )
    info(f"artifact {result.artifact_id}")
    info(f"  at {result.artifact_dir}")
