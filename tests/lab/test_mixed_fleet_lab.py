"""A mixed fleet: two x86-64 lab devices and an aarch64 one under qemu, end to end (marked `lab`).

From factory state, `apply` puts v1 on all three (bootstrap sends each device the agent's wheels
for its own platform, gathered by the controller: torch's aarch64 wheel for the arm64 device), then
v2 travels as a delta, then `rollback --to 1.0.0`. After each step the official `openai` client
gets an answer from the arm64 device, from the version that step put there. Once per engine, each
skipped, naming why, while the controller cannot gather that engine's aarch64 wheelhouse (llama.cpp:
no aarch64 llama-cpp-python wheel yet) or gathers one too big for CI's budget under emulation (torch:
PyPI's aarch64 build is CUDA's, 2.8 GB; see fixtures.EMULATED_WHEELHOUSE_MAX). Each step's time, and
when each device switched, is printed (`-s`): docs/operating.md, "Arm devices", records them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from deployer.demo.traffic import ask
from tests.fleet.conftest import Project, make_project
from tests.lab.api_key import LAB_API_KEY, lab_agent
from tests.lab.devices import AS_SERVICE
from tests.lab.fixtures import ARM64
from tests.lab.lab import Lab

pytestmark = pytest.mark.lab

T = TypeVar("T")
X86 = (1, 2)
PORT = 8080
STATE = "var/lib/sits/state.json"  # the agent rewrites it when it switches versions
# Emulated: torch's import and the first load take minutes, a short completion seconds.
HEALTH = {"readiness_timeout": "900s", "latency_budget_ms": 120000, "smoke_prompts": ["Hi"]}


@pytest.fixture(params=["torch", "llama.cpp"])
def engine(request: pytest.FixtureRequest, device_wheels: Callable[[int, str], str | None]) -> str:
    """The engine under test; skipped while the controller has no wheelhouse of it for aarch64."""
    why = device_wheels(ARM64, request.param)
    if why:
        pytest.skip(why)
    return str(request.param)


@pytest.fixture
def mixed(hub: Lab, engine: str, tmp_path: Path, tiny_model_dir: Path, tiny_model_dir_b: Path) -> Project:
    """A project for x86-64 devices 1, 2 and the arm64 device, all in factory state (agent runtime
    aside: a runtime bootstrap installed before stays, the rest goes)."""
    indices = (*X86, ARM64)
    for i in indices:
        hub.reset(i)
    project = make_project(
        tmp_path / "project", {"1.0.0": tiny_model_dir, "2.0.0": tiny_model_dir_b}, hub.inventory(indices)
    )
    project.write("1.0.0", agent={**lab_agent(project.dir, PORT), "engine": engine}, health=HEALTH)
    return project


def _timed(what: str, step: Callable[[], T]) -> T:
    started = time.monotonic()
    result = step()
    print(f"\n[arm64] {what}: {time.monotonic() - started:.1f} s")
    return result


def _apply(hub: Lab, what: str, project: Project, *args: str) -> None:
    """Run `apply` or `rollback` on all three devices at once; every one must end up updated.

    Prints the whole step's time and, per device, when its agent state was last written (the
    switch to the new version) counted from the step's start: x86-64 and arm64 side by side.
    """
    started = time.time()
    result = _timed(what, lambda: project.run(*args, "--output", "json", "--parallel", "3"))
    assert result.exit_code == 0, result.output
    report: dict = json.loads(result.stdout)
    assert {r["status"] for r in report["results"]} == {"updated"}, report["results"]
    for i in (*X86, ARM64):
        device = hub.device(i)
        switched = (device.root / STATE).stat().st_mtime - started
        print(f"[arm64]   {device.name} ({device.arch}) switched after {switched:.1f} s")


def _arm64_answers(hub: Lab, version: str) -> None:
    """The official openai client, from the hub, gets an answer from `version` on the arm64 device."""
    target = (hub.device(ARM64).address, PORT)
    answered = _timed("chat, 4 tokens", lambda: ask(target, "Hi", max_tokens=4, api_key=LAB_API_KEY))
    assert isinstance(answered, tuple) and answered[1] == version, answered


def _status(project: Project) -> dict[str, tuple[str | None, str]]:
    result = project.run("status", "--output", "json")
    assert result.exit_code == 0, result.output
    return {row["device"]: (row["version"], row["health"]) for row in json.loads(result.stdout)}


def test_mixed_fleet_installs_updates_and_rolls_back(hub: Lab, mixed: Project, engine: str) -> None:
    names = [hub.device(i).name for i in (*X86, ARM64)]
    assert hub.nsenter(ARM64, ["uname", "-m"]).strip() == "aarch64"
    assert {hub.nsenter(i, ["uname", "-m"]).strip() for i in X86} == {"x86_64"}
    assert mixed.run("build", "-q").exit_code == 0  # plan never builds (issue 18)

    _apply(hub, f"apply v1 ({engine}, bootstrap included)", mixed, "apply")
    assert _status(mixed) == dict.fromkeys(names, ("1.0.0", "ready"))
    python = [*AS_SERVICE, "/opt/sits/venv/bin/python", "-c", IMPORT_ENGINE[engine]]  # as the agent sees it
    imported = hub.nsenter(ARM64, python, timeout=300)
    assert imported.startswith("aarch64 "), imported  # its native library loads: an aarch64 build
    _arm64_answers(hub, "1.0.0")

    mixed.write("2.0.0")
    assert mixed.run("build", "-q").exit_code == 0
    plan = json.loads(mixed.run("plan", "--output", "json").stdout)
    assert {d["steps"][0]["kind"] for d in plan["devices"]} == {"send-patch"}, plan
    _apply(hub, f"apply v2 as a delta ({engine})", mixed, "apply")
    assert _status(mixed) == dict.fromkeys(names, ("2.0.0", "ready"))
    _arm64_answers(hub, "2.0.0")

    _apply(hub, f"rollback to v1 ({engine})", mixed, "rollback", "--to", "1.0.0")
    assert _status(mixed) == dict.fromkeys(names, ("1.0.0", "ready"))
    _arm64_answers(hub, "1.0.0")


# Imports the engine's native library (which fails for another architecture's build), prints the machine.
IMPORT_ENGINE = {
    "torch": "import platform, torch; print(platform.machine(), torch.__version__)",
    "llama.cpp": "import platform, llama_cpp; print(platform.machine(), llama_cpp.__version__)",
}
