"""The demo: a local 3-device fleet goes from nothing to v1 (one device, with a deadline no model
meets, answering through another's agent: the edge-cloud fallback), to a fine-tuned v2 by delta
patch under canary with live traffic, and back to v1 - through the real `sits-deployer` commands,
with the agents on the torch engine (int8 safetensors) or the llama.cpp engine (a Q8_0 GGUF,
patched as a GGUF). On the torch engine, a LoRA adapter of v1 then rolls out, answers by its name,
moves to its next version by a patch and rolls back, all while the base keeps answering.

Each step prints the command a user would type and runs it in a subprocess, so the demo exercises
exactly what the README documents. Everything lives in one work directory, removed at the end
(unless asked to keep it); the agents are stopped even when a step fails.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import yaml
from rich.console import Console

from deployer.demo.ports import PortReservation
from deployer.errors import SitsError

if TYPE_CHECKING:  # imported lazily where used, like the modules of the demo's other steps
    from deployer.demo.traffic import TrafficReport

_T = TypeVar("_T")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "quickstart" / "deploy.yaml"
PROBES = ("What is SITS-Deployer?", "What is the capital of France?")
PASSPHRASE_ENV = "SITS_SIGNING_PASSPHRASE"
FALLBACK_DEVICE = "dev3"  # the demo device that falls back to dev1's agent
ADAPTER = "support"  # the demo's LoRA adapter: the model id its clients select it by
# What `build` makes of the example's int8 for each agent engine.
ARTIFACTS = {"torch": "int8 safetensors", "llama.cpp": "int8 as a Q8_0 GGUF"}


@dataclass(frozen=True)
class DemoQuantization:
    """A quantization the demo can build its model with (`--quantization`): deploy.yaml's
    `model.quantization`, the quality gate's limits beside it, and how the build step says it."""

    settings: dict[str, object]
    gate: dict[str, float]
    label: str


# int8: the quickstart as written. int4-g128: activation-aware, 4.6 bits a weight, with a gate
# loosened to what it keeps of SmolLM2, with a margin for the fine-tuned v2 and the adapter: on the
# quickstart's 256 eval tokens v1 measured +15.2 % perplexity, 0.753 top-1 agreement, mean KL 0.162
# against the fp32 source, and the adapter (int4 base, fp16 factors) +20.5 %, 0.733, 0.168.
QUANTIZATIONS = {
    "int8": DemoQuantization({"scheme": "int8"}, {}, "int8"),
    "int4-g128": DemoQuantization(
        {"scheme": "int4", "group_size": 128, "awq": True},
        {"max_perplexity_increase_pct": 25.0, "min_top1_agreement": 0.7},
        "int4 group 128 with awq",
    ),
}


@dataclass(frozen=True)
class DemoOptions:
    """How the demo runs: where, how many fine-tune steps, which agent engine, and whether to keep
    the work dir."""

    workdir: Path | None = None
    keep: bool = False
    finetune_steps: int = 30
    engine: str = "torch"
    quantization: str = "int8"


@dataclass
class DemoProject:
    """The demo's project on disk: deploy.yaml, keys, device roots, and the agent ports, reserved
    until `close()` (the agents bind them when `apply` starts them)."""

    dir: Path
    reservations: dict[str, PortReservation]
    env: dict[str, str]

    @property
    def config(self) -> Path:
        return self.dir / "deploy.yaml"

    @property
    def ports(self) -> dict[str, int]:
        """Each device's agent port, by device name."""
        return {name: r.port for name, r in self.reservations.items()}

    def close(self) -> None:
        """Give the ports back (once the agents are stopped)."""
        for reservation in self.reservations.values():
            reservation.close()


def run_demo(options: DemoOptions) -> None:
    """Run every step; raise SitsError naming the step that failed (AgentError, before any step,
    when the llama.cpp engine is asked for and llama-cpp-python is not installed)."""
    if options.quantization != "int8" and options.engine != "torch":
        raise SitsError(
            f"the demo builds {options.quantization} for the torch engine only",
            hint="drop --engine llama.cpp, or --quantization",
        )
    if options.engine == "llama.cpp":
        from deployer.agent.engines.llamacpp.engine import require_llama_cpp

        require_llama_cpp()  # the agents would only fail to load their model, later and less clearly
    base = options.workdir or Path(tempfile.mkdtemp(prefix="sits-demo-"))
    base.mkdir(parents=True, exist_ok=True)
    project: DemoProject | None = None
    started = time.monotonic()
    try:
        project = _step(
            "Create signing keys and the demo project",
            lambda: make_project(base, engine=options.engine, quantization=options.quantization),
        )
        _story(project, options)
        console().print(f"\n[bold green]Demo finished[/bold green] in {time.monotonic() - started:.0f} s.")
    finally:
        if project is not None:
            stop_agents(project.config, project.env)
            project.close()
        if options.keep:
            console().print(f"The demo project is kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)


def _story(project: DemoProject, options: DemoOptions) -> None:
    _cli(project, "Validate deploy.yaml", ["validate", "-f", "deploy.yaml"])
    quantization = QUANTIZATIONS[options.quantization]
    what = (
        ARTIFACTS[options.engine] if options.quantization == "int8" else f"{quantization.label} safetensors"
    )
    _cli(project, f"Build v1: SmolLM2-135M-Instruct, {what}, quality-gated", ["build", "-f", "deploy.yaml"])
    _cli(project, "Plan the rollout (nothing is changed)", ["plan", "-f", "deploy.yaml"])
    _cli(project, "Apply v1 to the fleet", ["apply", "-f", "deploy.yaml"])
    _step(f"Edge-cloud fallback: {FALLBACK_DEVICE} has a 1 ms deadline", lambda: _show_fallback(project))
    _ask_fleet(project, "v1 answers")

    from deployer.build.demo_model import prepare_smollm2
    from deployer.demo.finetune import finetune

    v2_dir = project.dir / "models" / "smollm2-v2"
    _step(
        f"Fine-tune v2 ({options.finetune_steps} AdamW steps on a few chat exchanges)",
        lambda: finetune(prepare_smollm2(), v2_dir, steps=options.finetune_steps),
    )
    _set_model(project, "1.1.0", str(v2_dir))
    _cli(project, "Build v2", ["build", "-f", "deploy.yaml"])
    _cli(project, "Plan v2: a delta patch per device", ["plan", "-f", "deploy.yaml"])
    report = _apply_under_traffic(project)
    _print_sizes(project)
    _ask_fleet(project, "v2 answers")
    console().print(
        f"Traffic during the canary rollout: [bold]{report.ok} ok, {report.failed} failed[/bold] "
        f"(answered by {dict(report.versions)})"
    )
    if report.failed:
        raise SitsError(f"{report.failed} requests failed during the update: {dict(report.errors)}")
    _cli(
        project,
        "Roll the fleet back to v1 (a new signed release)",
        ["rollback", "-f", "deploy.yaml", "--to", "1.0.0"],
    )
    _cli(project, "Fleet status", ["status", "-f", "deploy.yaml"])
    _ask_fleet(project, "after rollback")
    if options.engine == "torch":
        _adapter_story(project)
    else:
        # The quickstart gates every build, and an adapter's quality gate needs a safetensors base.
        console().print(
            "(The LoRA adapter part runs on the torch engine: an adapter's quality gate, which "
            "this deploy.yaml sets, needs a safetensors base, not a GGUF one.)"
        )


def _adapter_story(project: DemoProject) -> None:
    """A LoRA adapter of v1 rolled out, served by name, updated by a patch and rolled back, with
    clients on the base and on the adapter counting failed requests throughout."""
    from deployer.build.demo_model import prepare_smollm2
    from deployer.config.models import BUILTIN_SMOLLM2
    from deployer.demo.finetune import ADAPTER_LESSONS, finetune_adapter
    from deployer.demo.traffic import Traffic

    # deploy.yaml follows the fleet back to v1, so that the next apply leaves the base as it is.
    _set_model(project, "1.0.0", BUILTIN_SMOLLM2)
    first, update = ADAPTER_LESSONS
    sources = {v: Path("adapters") / f"{ADAPTER}-{v}" for v in (first, update)}
    _step(
        f"Train a LoRA adapter of v1 with peft: {ADAPTER} {first}, then {update} on a new answer",
        lambda: finetune_adapter(prepare_smollm2(), {v: project.dir / p for v, p in sources.items()}),
    )
    _set_adapter(project, first, sources[first])
    _cli(
        project,
        f"Build adapter {ADAPTER} {first} for the v1 artifact, quality-gated",
        ["build", "-f", "deploy.yaml"],
    )
    # The fallback device answers through dev1's base model: the adapter's clients ask the others.
    tuned = [port for name, port in project.ports.items() if name != FALLBACK_DEVICE]
    with Traffic(list(project.ports.values()), question=PROBES[1]) as base:
        _cli(
            project,
            f"Apply: adapter {ADAPTER} {first} to every device, hot-loaded beside the serving base",
            ["apply", "-f", "deploy.yaml"],
        )
        _ask_adapter(project, tuned, f"{ADAPTER} {first} answers, selected by model name")
        with Traffic(tuned, question=PROBES[1], model=ADAPTER) as adapter:
            _set_adapter(project, update, sources[update])
            _cli(project, f"Build adapter {ADAPTER} {update}", ["build", "-f", "deploy.yaml"])
            _cli(
                project,
                f"Apply {ADAPTER} {update}: a patch from {first} per device",
                ["apply", "-f", "deploy.yaml"],
            )
            _ask_adapter(project, tuned, f"{ADAPTER} {update} answers")
            _cli(
                project,
                f"Roll adapter {ADAPTER} back (a new signed adapter release), the base untouched",
                ["rollback", "-f", "deploy.yaml", "--adapter", ADAPTER],
            )
    _ask_adapter(project, tuned, f"{ADAPTER} after its rollback")
    for what, during, report in (
        ("the base", "the adapter's rollout, update and rollback", base.report),
        (f"adapter {ADAPTER}", "its update and rollback", adapter.report),
    ):
        console().print(
            f"Traffic to {what} during {during}: "
            f"[bold]{report.ok} ok, {report.failed} failed[/bold] (answered by {dict(report.versions)})"
        )
        if report.failed:
            raise SitsError(f"{report.failed} requests to {what} failed: {dict(report.errors)}")


def make_project(base: Path, *, engine: str = "torch", quantization: str = "int8") -> DemoProject:
    """The quickstart example, made runnable here: fresh keys, device roots and ports in `base`, the
    agents on `engine`, the model built at `quantization` (a key of QUANTIZATIONS)."""
    env = dict(os.environ)
    env[PASSPHRASE_ENV] = secrets.token_urlsafe(24)  # never printed; lives only in this process tree
    env.setdefault("COLUMNS", "150")  # tables in the subcommands stay readable when piped
    keys = base / "keys"
    keys.mkdir(parents=True, exist_ok=True)
    _run(
        [*_sits(), "keygen", "--passphrase-env", PASSPHRASE_ENV, "-o", str(keys / "release")], env, quiet=True
    )
    doc = yaml.safe_load(EXAMPLE.read_text())
    example_dir = EXAMPLE.parent
    doc["model"]["quality_gate"]["eval_text"] = str(
        (example_dir / doc["model"]["quality_gate"]["eval_text"]).resolve()
    )
    doc["agent"]["engine"] = engine
    _set_quantization(doc, quantization)
    doc["signing"] = {
        "private_key": "keys/release.key",
        "passphrase_env": PASSPHRASE_ENV,
        "trusted_keys": ["keys/release.pub"],
    }
    for phase, hook in list(doc.get("hooks", {}).items()):
        path = hook["path"] if isinstance(hook, dict) else hook
        resolved = str((example_dir / path).resolve())
        doc["hooks"][phase] = {**hook, "path": resolved} if isinstance(hook, dict) else resolved
    reservations = {}
    for device in doc["fleet"]["devices"]:
        device["root"] = f"fleet/{device['name']}"
        device["python"] = sys.executable  # the agent runs from this environment, no wheel install
        reservations[device["name"]] = reservation = PortReservation()
        device["agent_port"] = reservation.port
        (base / device["root"]).mkdir(parents=True, exist_ok=True)
    # One device falls back to another's agent: its deadline is too short for any first token.
    upstream = doc["fleet"]["devices"][0]["name"]
    doc["fallback"] = {
        "policy": "off",
        "upstream": {
            "base_url": f"http://127.0.0.1:{reservations[upstream].port}/v1",
            "model": doc["model"]["name"],
        },
    }
    edge = next(d for d in doc["fleet"]["devices"] if d["name"] == FALLBACK_DEVICE)
    edge["fallback"] = {"policy": "on-trigger", "triggers": {"deadline_ms": 1}}
    (base / "deploy.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return DemoProject(base, reservations, env)


def _set_quantization(doc: dict, name: str) -> None:
    """deploy.yaml's `model.quantization` and gate limits for `name`, said on the console when
    they are not the quickstart's own."""
    chosen = QUANTIZATIONS[name]
    if not chosen.gate and chosen.settings == doc["model"]["quantization"]:
        return
    doc["model"]["quantization"] = chosen.settings
    doc["model"]["quality_gate"].update(chosen.gate)
    shown = {"quantization": chosen.settings, "quality_gate": doc["model"]["quality_gate"]}
    console().print(
        f"[cyan]deploy.yaml ({name}):[/cyan]\n" + yaml.safe_dump({"model": shown}, sort_keys=False)
    )


def _set_model(project: DemoProject, version: str, source: str) -> None:
    doc = yaml.safe_load(project.config.read_text())
    doc["model"]["version"] = version
    doc["model"]["source"] = source
    project.config.write_text(yaml.safe_dump(doc, sort_keys=False))


def _set_adapter(project: DemoProject, version: str, source: Path) -> None:
    """Put the demo's adapter at `version` under the model in deploy.yaml, with an all-at-once
    strategy: a canary's analysis window would triple the act's time, and each device smoke-tests
    the adapter and rolls it back alone if it fails."""
    doc = yaml.safe_load(project.config.read_text())
    doc["model"]["adapters"] = [{"name": ADAPTER, "version": version, "source": str(source)}]
    doc["strategy"] = {"type": "all-at-once"}
    project.config.write_text(yaml.safe_dump(doc, sort_keys=False))
    console().print(
        "[cyan]deploy.yaml:[/cyan]\n"
        + yaml.safe_dump({"model": {"adapters": doc["model"]["adapters"]}, "strategy": doc["strategy"]})
    )


def _apply_under_traffic(project: DemoProject) -> TrafficReport:
    from deployer.demo.traffic import Traffic

    with Traffic(list(project.ports.values()), question=PROBES[1]) as traffic:
        _cli(
            project,
            "Apply v2 under canary while a client keeps sending requests",
            ["apply", "-f", "deploy.yaml"],
        )
    return traffic.report


def _show_fallback(project: DemoProject) -> None:
    from deployer.demo.traffic import ask_who

    answer, by, reason, model = ask_who(project.ports[FALLBACK_DEVICE], PROBES[1])
    console().print(
        f"{FALLBACK_DEVICE} answered {answer!r}: served by [bold]{by}[/bold] ({model}), "
        f"fallback reason: {reason or '-'}"
    )
    _cli(project, "Fleet status: edge status and fallbacks per device", ["status", "-f", "deploy.yaml"])


def _ask_fleet(project: DemoProject, title: str) -> None:
    from rich.table import Table

    from deployer.demo.traffic import ask, serving

    table = Table(title=title, title_justify="left")
    for column in ("device", "version", "engine", "question", "answer"):
        table.add_column(column)
    for name, port in project.ports.items():
        engine = serving(port)
        for question in PROBES:
            answer, model = ask(port, question)
            table.add_row(name, model.rpartition("@")[2], engine, question, answer)
    console().print(table)


def _ask_adapter(project: DemoProject, ports: list[int], title: str) -> None:
    from rich.table import Table

    from deployer.demo.traffic import ask

    table = Table(title=title, title_justify="left")
    for column in ("device", "model", "question", "answer"):
        table.add_column(column)
    for name, port in project.ports.items():
        if port in ports:
            answer, version = ask(port, PROBES[1], model=ADAPTER)
            table.add_row(name, f"{ADAPTER}@{version}", PROBES[1], answer)
    console().print(table)


def _print_sizes(project: DemoProject) -> None:
    patches = sorted((project.dir / ".sits" / "patches").rglob("*.patch"), key=lambda p: p.stat().st_mtime)
    artifacts = project.dir / ".sits" / "store" / "artifacts"
    full = max((_dir_size(a) for a in artifacts.iterdir()), default=0) if artifacts.is_dir() else 0
    if patches and full:
        size = patches[-1].stat().st_size
        console().print(
            f"Patch v1 -> v2: [bold]{size / 1e6:.1f} MB[/bold] against {full / 1e6:.1f} MB for the full "
            f"artifact ({100 * size / full:.1f}%)"
        )


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def stop_agents(config_path: Path, environ: dict[str, str]) -> None:
    """Stop every local device's agent (the demo fleet runs them as background processes)."""
    from deployer.config import load_config
    from deployer.push.bootstrap import stop_agent
    from deployer.push.facts import DeviceSite
    from deployer.transport import LocalTransport

    config = load_config(config_path, environ=environ)
    for device in config.fleet.devices:
        root = config.resolve(device.root)
        if device.transport == "local" and root.is_dir():
            stop_agent(DeviceSite.of(config, device), LocalTransport(root))


@functools.cache
def console() -> Console:
    """The demo's narration on stderr (the CLI's own console lives in deployer/cli, above the demo)."""
    return Console(stderr=True, highlight=False, soft_wrap=True)


def _step(title: str, action: Callable[[], _T]) -> _T:
    console().rule(f"[bold]{title}")
    started = time.monotonic()
    result = action()
    console().print(f"[dim]({time.monotonic() - started:.1f} s)[/dim]")
    return result


def _cli(
    project: DemoProject, title: str, args: list[str], *, check: bool = True, quiet: bool = False
) -> None:
    def go() -> None:
        if not quiet:
            console().print(f"[cyan]$ sits-deployer {' '.join(args)}[/cyan]")
        rc = _run([*_sits(), *args], project.env, cwd=project.dir, quiet=quiet)
        if rc != 0 and check:
            raise SitsError(f"demo step failed: sits-deployer {' '.join(args)} (exit {rc})")

    if quiet:
        go()
    else:
        _step(title, go)


def _run(argv: list[str], env: dict[str, str], *, cwd: Path | None = None, quiet: bool = False) -> int:
    out = subprocess.DEVNULL if quiet else None
    return subprocess.run(argv, env=env, cwd=cwd, stdout=out, stderr=out, check=False).returncode


def _sits() -> list[str]:
    return [sys.executable, "-m", "deployer"]
