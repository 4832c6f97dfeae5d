"""The wheels a plan names for each device due a bootstrap: those of its own architecture, a
cross-compilation apply will make named as such (a plan never compiles for 20 minutes), and a
platform no wheel can be had for failing the plan with the device's name, before anything is sent."""

from __future__ import annotations

import pytest

from deployer.errors import SitsError
from deployer.push import fleet as fleet_module
from deployer.push.wheelhouse import CrossBuildPending, PipTarget
from tests.push.simulator import SimFleet


@pytest.fixture
def sim(tmp_path, monkeypatch) -> SimFleet:
    """Two simulated devices, dev2 re-imaged to aarch64, and the agent's wheel a stand-in file."""
    fleet = SimFleet(tmp_path, size=2)
    fleet.devices["dev2"].arch = "aarch64"
    (tmp_path / "project" / "agent").mkdir(parents=True)
    (tmp_path / "project" / "agent" / "pyproject.toml").write_text("")
    agent = tmp_path / "sits_agent-0.1.0-py3-none-any.whl"
    agent.write_bytes(b"x" * 10)
    monkeypatch.setattr(fleet_module, "build_agent_wheel", lambda project, out: agent)
    return fleet


def test_a_cross_build_apply_will_make_is_named_and_the_plan_still_made(sim, tmp_path, monkeypatch):
    def pending(site, device, wheel, *, cross_build):
        assert not cross_build  # a plan never compiles
        raise CrossBuildPending("llama-cpp-python", PipTarget.of(device))

    monkeypatch.setattr(fleet_module, "agent_wheelhouse", pending)
    wheels = fleet_module._missing_wheels(sim.session, sim.facts(), tmp_path / "project", cross_build=False)
    assert list(wheels) == ["dev2"]  # dev1 runs its agent already: no bootstrap, nothing gathered
    names, size = wheels["dev2"]
    assert names[0] == "llama-cpp-python (cross-compiled for aarch64 by apply, once)" and size == 0
    dev1, dev2 = sim.plan(wheels=wheels).plan.devices
    assert dev1.wheels == ()
    assert dev2.wheels == names and "llama-cpp-python (cross-compiled" in dev2.steps[0].reason


def test_a_platform_no_wheel_can_be_had_for_fails_the_plan_naming_the_device(sim, tmp_path, monkeypatch):
    def lacking(site, device, wheel, *, cross_build):
        raise SitsError("no wheel of numpy for the device's platform (linux_aarch64)", hint="find-links")

    monkeypatch.setattr(fleet_module, "agent_wheelhouse", lacking)
    with pytest.raises(SitsError, match=r"^dev2: no wheel of numpy for the device's platform") as caught:
        fleet_module._missing_wheels(sim.session, sim.facts(), tmp_path / "project", cross_build=True)
    assert caught.value.hint == "find-links"
