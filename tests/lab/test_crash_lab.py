"""A lab device whose install is killed mid-way keeps serving its old model (marked `lab`).

The crash-safety guarantees that tests/agent/ota/test_crash_safety.py checks step by step on one
machine, here on a booted lab device of each architecture: x86-64 and aarch64 under qemu. `apply`
puts 1.0.0 on the device; a bundle of 2.0.0 on its "stick" is installed by the device's own
`sits-agent install --from`, which SIGKILLs itself once the release is verified and staged. The
running agent goes on serving 1.0.0, a restart (recovery clears the staging) serves 1.0.0 again,
and the same install run once more moves the device to 2.0.0 by hot swap.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from deployer.demo.traffic import ask
from tests.fleet.conftest import Project, make_project
from tests.lab.api_key import LAB_API_KEY, lab_agent
from tests.lab.devices import AS_SERVICE
from tests.lab.fixtures import ARM64
from tests.lab.lab import Lab

pytestmark = pytest.mark.lab

PORT = 8080
USB = "media/usb"
KILL_AT = "staged"  # verified and unpacked into staging/, not yet promoted
HEALTH = {"readiness_timeout": "900s", "latency_budget_ms": 120000, "smoke_prompts": ["Hi"]}
# `sits-agent` as its console script runs it, except that the updater SIGKILLs its own process
# right after the step named in argv[1] (the hook test_crash_safety.py kills at, too).
CRASHING_AGENT = """
import os, signal, sys
from deployer.agent.ota.updater import Updater
from deployer.agent.cli import cli

init = Updater.__init__

def crashing_init(self, *args, **kwargs):
    init(self, *args, **kwargs)
    report = self.on_step
    def on_step(step):
        report(step)
        if step == sys.argv[1]:
            os.kill(os.getpid(), signal.SIGKILL)
    self.on_step = on_step

Updater.__init__ = crashing_init
cli(sys.argv[2:], prog_name="sits-agent")
"""


@pytest.fixture(params=[pytest.param(3, id="x86_64"), pytest.param(ARM64, id="aarch64")])
def v1_device(
    request: pytest.FixtureRequest,
    hub: Lab,
    device_wheels: Callable[[int, str], str | None],
    tmp_path: Path,
    tiny_model_dir: Path,
    tiny_model_dir_b: Path,
) -> tuple[int, Project]:
    """(index, project): the device from the factory, then on 1.0.0 by `apply`, on the lab network;
    skipped while the torch wheelhouse for its platform cannot be had or is beyond CI's budget."""
    index = int(request.param)
    if why := device_wheels(index, "torch"):
        pytest.skip(why)
    hub.reset(index)
    models = {"1.0.0": tiny_model_dir, "2.0.0": tiny_model_dir_b}
    project = make_project(tmp_path / "project", models, hub.inventory((index,)))
    project.write("1.0.0", agent=lab_agent(project.dir, PORT), health=HEALTH)
    applied = project.run("apply", "--output", "json")
    assert applied.exit_code == 0, applied.output
    return index, project


def _served(hub: Lab, index: int) -> str:
    return ask((hub.device(index).address, PORT), "Hi", max_tokens=4, api_key=LAB_API_KEY)[1]


def _install(hub: Lab, index: int, python_args: str) -> tuple[int, str]:
    """Run the agent's CLI inside the device as its service user: (exit code, output)."""
    command = f"runuser -u sits -- /opt/sits/venv/bin/python {python_args} 2>&1; echo rc=$?"
    output = hub.nsenter(index, [*AS_SERVICE, "sh", "-c", command], timeout=600)  # as the agent sees it
    text, _, rc = output.rstrip().rpartition("rc=")
    return int(rc), text


def test_a_device_killed_mid_install_keeps_serving_its_old_model(
    hub: Lab, v1_device: tuple[int, Project], tmp_path: Path
) -> None:
    index, project = v1_device
    project.write("2.0.0")
    written = project.run("bundle", "-o", str(tmp_path / "bundle"))
    assert written.exit_code == 0, written.output
    shutil.copytree(tmp_path / "bundle", hub.device(index).root / USB / "v2")
    bundle = f"/{USB}/v2"

    (hub.device(index).root / "opt/crashing_agent.py").write_text(CRASHING_AGENT)
    rc, output = _install(hub, index, f"/opt/crashing_agent.py {KILL_AT} install --from {bundle}")
    assert rc == 137, output  # SIGKILLed by its own hook: it got as far as KILL_AT
    staging = hub.nsenter(index, ["ls", "-A", "/var/lib/sits/staging"])
    assert staging.strip(), "the kill came before anything was staged"
    state = json.loads(hub.nsenter(index, ["cat", "/var/lib/sits/state.json"]))
    assert (state["installed_version"], state["pending"]) == ("1.0.0", None), state
    assert _served(hub, index) == "1.0.0"  # the running agent never noticed

    started = time.monotonic()
    hub.nsenter(index, ["systemctl", "restart", "sits-agent"], timeout=900)  # Type=notify: waits for ready
    print(f"\n[{hub.device(index).arch}] agent restart to ready (load): {time.monotonic() - started:.1f} s")
    assert hub.nsenter(index, ["ls", "-A", "/var/lib/sits/staging"]).strip() == ""  # recovery cleared it
    assert _served(hub, index) == "1.0.0"

    rc, output = _install(hub, index, f"-m deployer.agent.cli install --from {bundle}")
    assert rc == 0 and "installed 2.0.0" in output and "was 1.0.0" in output, output
    assert _served(hub, index) == "2.0.0"
