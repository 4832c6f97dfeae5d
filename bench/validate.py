"""Config validation at fleet scale: deploy.yaml with an inventory of N ssh devices.

For each N it times, in the same run, `validate_file` (what `sits-deployer validate` does: YAML with
positions, ${VAR} interpolation, schema, checks) against a baseline of the same inventory read by
`yaml.load` with PyYAML's fastest loader (libyaml's CSafeLoader when present): what any YAML-based
tool pays at least. Every figure is the best of --repeat runs. The target (issue 14) is 10,000
devices in at most 5 s.

    PYTHONPATH=. .venv/bin/python bench/validate.py                 # 1,000 / 10,000 devices
    PYTHONPATH=. .venv/bin/python bench/validate.py --devices 500 --repeat 1
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from deployer.config.loader import validate_file

DEPLOY = """\
application: bench
model:
  name: m
  version: 1.0.0
  source: builtin:smollm2-135m-instruct
fleet:
  inventory: inventory.yaml
profiles:
  small: {memory: 4Gi, cpu: "2"}
"""


def write_project(root: Path, devices: int) -> Path:
    """deploy.yaml and an inventory of `devices` ssh devices under `root`; returns deploy.yaml."""
    lines = ["devices:"]
    for i in range(devices):
        lines += [
            f"  - name: d{i}",
            "    transport: ssh",
            f"    host: 10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}",
            "    user: sits",
            "    profile: small",
            f"    labels: {{ring: {'canary' if i % 10 == 0 else 'main'}}}",
        ]
    (root / "inventory.yaml").write_text("\n".join(lines) + "\n")
    deploy = root / "deploy.yaml"
    deploy.write_text(DEPLOY)
    return deploy


def best_of(repeat: int, work: Callable[[], object]) -> float:
    """The shortest wall time of `repeat` runs of `work`."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    """Print one table row per inventory size."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, nargs="+", default=[1_000, 10_000])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    table = Table(title=f"validate_file vs yaml.load ({loader.__name__}), best of {args.repeat}")
    for column in ("devices", "inventory MiB", "yaml.load s", "validate s", "ratio", "findings"):
        table.add_column(column, justify="right")
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.devices:
            root = Path(tmp) / str(n)
            root.mkdir()
            deploy = write_project(root, n)
            text = (root / "inventory.yaml").read_text()
            baseline = best_of(args.repeat, lambda text=text: yaml.load(text, Loader=loader))
            counts: list[int] = []
            ours = best_of(
                args.repeat,
                lambda deploy=deploy, counts=counts: counts.append(len(validate_file(deploy, {}))),
            )
            size = len(text.encode()) / 2**20
            table.add_row(
                f"{n:,}",
                f"{size:.2f}",
                f"{baseline:.2f}",
                f"{ours:.2f}",
                f"{ours / baseline:.1f}x",
                str(counts[-1]),
            )
    console = Console()
    console.print(table)
    console.print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, PyYAML {yaml.__version__} (libyaml: {yaml.__with_libyaml__})"
    )


if __name__ == "__main__":
    main()
