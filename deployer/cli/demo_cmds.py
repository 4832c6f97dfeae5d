"""`sits-deployer demo`: the whole story on a local fleet, with the embedded model."""

from __future__ import annotations

from pathlib import Path

import click

from deployer.cli.common import examples


@click.command(
    epilog=examples(
        "sits-deployer demo",
        "sits-deployer demo --engine llama.cpp",
        "sits-deployer demo --quantization int4-g128",
        "sits-deployer demo --workdir /tmp/sits-demo --keep",
    )
)
@click.option(
    "--workdir",
    type=click.Path(path_type=Path, file_okay=False),
    help="Where the demo project lives (default: a new temporary directory).",
)
@click.option("--keep", is_flag=True, help="Keep the demo project (keys, store, device roots) afterwards.")
@click.option(
    "--finetune-steps", default=30, show_default=True, type=click.IntRange(min=1), help="AdamW steps for v2."
)
@click.option(
    "--engine",
    type=click.Choice(["torch", "llama.cpp"]),
    default="torch",
    show_default=True,
    help="The agents' engine; llama.cpp serves a GGUF artifact (needs the llamacpp extra).",
)
@click.option(
    "--quantization",
    type=click.Choice(["int8", "int4-g128"]),
    default="int8",
    show_default=True,
    help="How the model is built: int8, or int4 group 128 with awq (torch engine), under a looser "
    "quality gate that the demo prints when it starts.",
)
def demo(workdir: Path | None, keep: bool, finetune_steps: int, engine: str, quantization: str) -> None:
    """Run the demo: 3 local devices, v1 (int8, or --quantization int4-g128), a fine-tuned v2 as a
    canary delta under live traffic, a fleet rollback to v1, then (torch engine) a LoRA adapter
    rolled out, updated and rolled back under live traffic. Stops its agents and cleans up after
    itself."""
    from deployer.demo.run import DemoOptions, run_demo

    options = DemoOptions(workdir, keep, finetune_steps, engine, quantization)
    run_demo(options)
