"""An air-gapped lab device updated from a "USB stick" (marked `lab`).

`apply` puts 1.0.0 on device 4 over SSH; then the controller writes a bundle of 2.0.0, the bundle is
copied into the device's own filesystem (the stick), its cable is pulled (no route to anything),
and `sits-agent install --from` runs inside it as the service user. A tampered copy is refused and
the device keeps serving 1.0.0; the intact one moves it to 2.0.0 by hot swap, which a client in the
hub sees once the cable is back, and so does the controller's `status`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from deployer.demo.traffic import ask
from tests.fleet.conftest import Project, make_project
from tests.lab.api_key import LAB_API_KEY, lab_agent
from tests.lab.lab import Lab

pytestmark = pytest.mark.lab

INDEX = 4
PORT = 8080
USB = "media/usb"
AGENT = "runuser -u sits -- /opt/sits/venv/bin/sits-agent"


@pytest.fixture
def v1_device(hub: Lab, tmp_path: Path, tiny_model_dir: Path, tiny_model_dir_b: Path) -> Project:
    """Device 4 from the factory, then on 1.0.0 by `apply` over SSH, serving on the lab network."""
    hub.reset(INDEX)
    models = {"1.0.0": tiny_model_dir, "2.0.0": tiny_model_dir_b}
    project = make_project(tmp_path / "project", models, hub.inventory((INDEX,)))
    project.write("1.0.0", agent=lab_agent(project.dir, PORT))
    applied = project.run("apply", "--output", "json")
    assert applied.exit_code == 0, applied.output
    return project


def _served_version(hub: Lab) -> str:
    return ask((hub.device(INDEX).address, PORT), "Hi", max_tokens=4, api_key=LAB_API_KEY)[1]


def _install_offline(hub: Lab, bundle: str) -> tuple[int, str]:
    """`sits-agent install --from` inside the device, as its service user: (exit code, output)."""
    command = f"{AGENT} install --from /{USB}/{bundle} 2>&1; echo rc=$?"
    output = hub.nsenter(INDEX, ["sh", "-c", command], timeout=300)
    text, _, rc = output.rstrip().rpartition("rc=")
    return int(rc), text


def test_a_bundle_on_a_stick_updates_an_unplugged_device_and_a_tampered_one_does_not(
    hub: Lab, v1_device: Project, tmp_path: Path
) -> None:
    v1_device.write("2.0.0", agent=lab_agent(v1_device.dir, PORT))
    written = v1_device.run("bundle", "-o", str(tmp_path / "bundle"))
    assert written.exit_code == 0, written.output
    stick = hub.device(INDEX).root / USB
    shutil.copytree(tmp_path / "bundle", stick / "good")
    shutil.copytree(tmp_path / "bundle", stick / "tampered")
    (patch,) = (stick / "tampered").glob("patch/*/delta.patch")  # the file a 1.0.0 device installs
    data = bytearray(patch.read_bytes())
    data[len(data) // 2] ^= 0xFF
    patch.write_bytes(bytes(data))
    assert _served_version(hub) == "1.0.0"

    hub.unplug(INDEX)
    try:
        assert "state DOWN" in hub.nsenter(INDEX, ["ip", "-o", "link", "show", "dev", "eth0"])
        refused = _install_offline(hub, "tampered")
        installed = _install_offline(hub, "good")
    finally:
        hub.plug(INDEX)
    assert refused[0] != 0 and "delta.patch does not match the bundle's signed index" in refused[1], refused
    assert installed[0] == 0 and "installed 2.0.0" in installed[1] and "was 1.0.0" in installed[1], installed

    assert _served_version(hub) == "2.0.0"  # hot-swapped while unplugged; served once reachable
    status = v1_device.run("status", "--output", "json")
    assert status.exit_code == 0, status.output
    assert [(r["version"], r["health"]) for r in json.loads(status.stdout)] == [("2.0.0", "ready")]


def test_a_refused_bundle_leaves_the_device_serving_the_old_version(hub: Lab, v1_device: Project) -> None:
    """A bundle of the version the device runs, made again (a replay), is refused; nothing changes."""
    v1_device.write("1.0.0", agent=lab_agent(v1_device.dir, PORT))
    stick = hub.device(INDEX).root / USB
    written = v1_device.run("bundle", "-o", str(stick / "old.tar"))
    assert written.exit_code == 0, written.output
    hub.unplug(INDEX)
    try:
        refused = _install_offline(hub, "old.tar")
    finally:
        hub.plug(INDEX)
    assert refused[0] != 0, refused
    assert _served_version(hub) == "1.0.0"
