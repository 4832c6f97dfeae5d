"""examples/fleet-ssh, run as a user would, on lab devices: five x86-64 and the aarch64 one (marked `lab`).

The example's own deploy.yaml drives the run: its model (builtin SmolLM2-135M-Instruct, prepared
offline by `smollm2_dir`), its "layered" GGUF for the llama.cpp engine, its Jetson Orin NX
profiles, its canary on `env: prod` (steps 1, 50%, 100%; halt and roll back at 10% failed), its
health checks and its hooks. It is copied with the files it names (examples/data, hooks/), so that
its relative paths hold. Substituted, because they cannot be the same in the lab:

- inventory.yaml: the example's six devices, with their names, profiles and labels, at the lab's
  six addresses, as root with the lab's client key. orin-01, the canary's first device, is the
  aarch64 one; orin-02..06 are x86-64. All four prod devices are needed: with fewer, validate
  refuses the canary's steps [1, 50%, 100%] (a step that adds no device).
- known_hosts: the lab devices' host keys.
- the signing key: made with `sits-deployer keygen` under the passphrase variable deploy.yaml
  names (the example commits only a public key), and the commented `private_key` line enabled.
- strategy.analysis_window and strategy.pause, 5m and 10m: the canary's two analysis windows and
  pauses would keep the test waiting 30 min. They become 10s and 5s; the waves, the analysis of
  each (readiness, smoke latency, errors) and the failure threshold are the example's.
- health.readiness_timeout and health.latency_budget_ms, 3m and 3000 ms, are a Jetson's: under
  qemu the aarch64 device is far slower (a 4-token smoke answer took 44 s, a swap 114 s). They
  become 15m and 120000 ms; the smoke prompts are the example's.

As a user would: validate, build, plan (each device's architecture shown), apply, status. Each
step's time is printed (`-s`); measured on 2 shared cores: build 33 s, apply 459-552 s (three waves,
the aarch64 one first, each from factory state with bootstrap), 9.8-11.4 min with the lab's up.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from click.testing import CliRunner, Result

from deployer.cli.main import cli
from tests.lab.fixtures import ARM64, PROJECT
from tests.lab.lab import Lab

pytestmark = pytest.mark.lab

T = TypeVar("T")
# The example's devices by lab device index: the canary's first device is the aarch64 one.
LAB_DEVICES = {"orin-01": ARM64, "orin-02": 1, "orin-03": 2, "orin-04": 3, "orin-05": 4, "orin-06": 5}
PROD = ("orin-01", "orin-02", "orin-03", "orin-04")  # the strategy's selector, env: prod
# What cannot be the same in the lab (see the module's docstring): the strategy's waits, cut to the
# test's budget, and the health limits, raised for a device emulated under qemu.
LAB_VALUES = {
    "  analysis_window: 5m\n": "  analysis_window: 10s\n",
    "  pause: 10m\n": "  pause: 5s\n",
    "  readiness_timeout: 3m\n": "  readiness_timeout: 15m\n",
    "  latency_budget_ms: 3000\n": "  latency_budget_ms: 120000\n",
}
PASSPHRASE = "lab-example-passphrase"
JOURNAL = ["journalctl", "-u", "sits-agent", "--no-pager", "-n", "60"]
PRIVATE_KEY = "  # private_key: ../keys/release.key"


def _timed(what: str, step: Callable[[], T]) -> T:
    started = time.monotonic()
    result = step()
    print(f"\n[fleet-ssh] {what}: {time.monotonic() - started:.1f} s")
    return result


@pytest.fixture
def example(
    lab: Lab,
    device_wheels: Callable[[int, str], str | None],
    smollm2_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Path:
    """The example's deploy.yaml in a copy of the tree it names, with the lab's substitutions (see
    the module's docstring); its devices in factory state (the agent's runtime aside)."""
    why = device_wheels(ARM64, "llama.cpp")  # gathered here, outside the hub, which has no network
    if why:
        pytest.skip(why)
    for name in ("examples/fleet-ssh", "examples/data", "hooks"):
        shutil.copytree(PROJECT / name, tmp_path / name)
    home = tmp_path / "examples/fleet-ssh"
    monkeypatch.setenv("SITS_SIGNING_PASSPHRASE", PASSPHRASE)
    monkeypatch.setenv("COLUMNS", "200")  # plan's table, unwrapped
    (tmp_path / "examples/keys").mkdir()  # its own key pair: the example commits only a public key
    keygen = _cli("keygen", "-o", str(tmp_path / "examples/keys/release"))
    assert keygen.exit_code == 0, keygen.output
    deploy = (home / "deploy.yaml").read_text()
    for old, new in {PRIVATE_KEY: PRIVATE_KEY.replace("# ", "", 1), **LAB_VALUES}.items():
        assert deploy.count(old) == 1, old
        deploy = deploy.replace(old, new)
    (home / "deploy.yaml").write_text(deploy)

    inventory = yaml.safe_load((home / "inventory.yaml").read_text())
    devices = inventory["devices"]
    assert {d["name"] for d in devices} == set(LAB_DEVICES)
    for device in devices:
        lab_device = lab.device(LAB_DEVICES[device["name"]])
        device.pop("port", None)
        device.update(host=lab_device.address, user="root", identity_file=str(lab.client_key))
        lab.reset(lab_device.index)
    (home / "inventory.yaml").write_text(yaml.safe_dump({**inventory, "devices": devices}, sort_keys=False))
    shutil.copyfile(lab.known_hosts, home / "known_hosts")
    return home / "deploy.yaml"


def _cli(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _run(config: Path, command: str, *args: str) -> Result:
    return _cli(command, "-f", str(config), *args)


def _ok(result: Result) -> Result:
    assert result.exit_code == 0, result.output
    return result


def _json(result: Result) -> Any:
    return json.loads(_ok(result).stdout)


def test_fleet_ssh_example_runs_on_lab_devices_one_aarch64(hub: Lab, example: Path) -> None:
    arches = {name: hub.device(i).arch for name, i in LAB_DEVICES.items()}
    assert {name: hub.nsenter(LAB_DEVICES[name], ["uname", "-m"]).strip() for name in PROD} == {
        name: arches[name] for name in PROD
    }
    assert arches["orin-01"] == "aarch64" and {arches[name] for name in PROD[1:]} == {"x86_64"}
    _ok(_timed("validate", partial(_run, example, "validate")))
    _ok(_timed("build (layered GGUF, quality gate)", partial(_run, example, "build", "-q")))

    plan = _json(_run(example, "plan", "--output", "json"))
    assert [(d["device"], d["arch"], d["status"]) for d in plan["devices"]] == [
        (name, arches[name], "change") for name in PROD
    ]
    for device in plan["devices"]:
        kinds = [step["kind"] for step in device["steps"]]  # from factory state, with the example's hooks
        assert kinds[:2] == ["pre-deploy-hook", "bootstrap"] and kinds[-1] == "post-deploy-hook", kinds
        wheels = device["wheels"]  # those that a runtime left by an earlier lab test lacks
        assert wheels and all(device["arch"] in w for w in wheels if w.startswith("llama_cpp_python")), device
    table = _ok(_run(example, "plan")).stdout
    assert all(name in table for name in PROD) and {"aarch64", "x86_64"} <= set(table.split()), table

    applied = _timed(
        "apply (canary: 1, 50%, 100% of env: prod)", partial(_run, example, "apply", "--output", "json")
    )
    report = json.loads(applied.stdout)
    failed = [r["device"] for r in report["results"] if r["status"] == "failed"]
    for name in failed:  # why, in the failed agent's own words
        journal = hub.nsenter(LAB_DEVICES[name], JOURNAL, timeout=60)
        print(f"[fleet-ssh] {name} failed; its agent's journal:\n{journal}")
    assert applied.exit_code == 0 and report["halted"] is None, applied.output
    assert [(r["device"], r["status"]) for r in report["results"]] == [(name, "updated") for name in PROD], (
        report
    )
    rows = _json(_run(example, "status", "--output", "json"))
    assert [(r["device"], r["arch"], r["version"], r["health"]) for r in rows] == [
        (name, arches[name], "1.4.0", "ready") for name in PROD
    ]
