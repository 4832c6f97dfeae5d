"""The plan on slow and metered links: a metered device never gets the full artifact in place of a
patch unless deploy.yaml allows it, and the plan says what the rollout costs (bytes, time at each
device's rate, the fleet total, the expected duration)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from deployer.config.models import Strategy
from deployer.push.cost import rollout_cost
from deployer.push.fleet import apply_failures
from deployer.push.plan import DesiredState, DeviceFacts, DeviceStatus, StepKind, make_plan, plan_device
from deployer.push.rollout import make_waves
from tests.push.simulator import SimFleet

DESIRED = DesiredState(
    version="1.1.0",
    artifact_sha256="new",
    artifact_bytes=1_000_000,
    agent_version="0.1.0",
    unit_hashes={},
    patches={"old": 50_000},
    rate=250_000.0,  # 2Mbit
    metered=True,
)
RUNS = DeviceFacts(
    "kiosk", True, agent_version="0.1.0", model_version="1.0.0", model_sha256="old", free_disk_bytes=10**9
)


def test_a_metered_device_gets_its_patch_with_its_time_at_its_rate() -> None:
    plan = plan_device(DESIRED, RUNS)
    assert plan.status is DeviceStatus.CHANGE
    assert plan.steps[0].kind is StepKind.SEND_PATCH
    assert plan.bytes_to_send == 50_000 and plan.seconds == pytest.approx(0.2)


def test_a_metered_device_without_a_patch_is_blocked_naming_why() -> None:
    plan = plan_device(DESIRED, replace(RUNS, model_sha256="gone"))
    assert plan.status is DeviceStatus.BLOCKED and plan.steps == ()
    assert "metered link: no patch from 1.0.0: its artifact is not in the controller's store" in plan.reason
    assert "1,000,000 bytes" in plan.reason and "allow_full_on_metered" in plan.reason


def test_allow_full_on_metered_sends_the_artifact_and_says_so() -> None:
    plan = plan_device(replace(DESIRED, allow_full_on_metered=True), replace(RUNS, model_sha256="gone"))
    assert plan.status is DeviceStatus.CHANGE
    assert plan.steps[0].kind is StepKind.SEND_ARTIFACT
    assert "allowed by bandwidth.allow_full_on_metered" in plan.reason
    assert plan.seconds == pytest.approx(4.0)


def test_a_first_install_on_a_metered_link_is_not_a_replaced_patch() -> None:
    plan = plan_device(DESIRED, replace(RUNS, model_version=None, model_sha256=None))
    assert plan.status is DeviceStatus.CHANGE and plan.steps[0].kind is StepKind.SEND_ARTIFACT


def test_an_unmetered_device_gets_the_full_artifact_as_before() -> None:
    plan = plan_device(replace(DESIRED, metered=False), replace(RUNS, model_sha256="gone"))
    assert plan.steps[0].kind is StepKind.SEND_ARTIFACT and "metered" not in plan.reason


def test_the_json_form_carries_bytes_and_seconds_per_device() -> None:
    plan = make_plan(DESIRED, [RUNS, replace(RUNS, name="free")])
    devices = plan.to_dict()["devices"]
    assert [(d["bytes"], d["seconds"], d["rate"]) for d in devices] == [(50_000, 0.2, 250_000.0)] * 2


def test_the_rollout_duration_walks_the_waves_with_the_fleet_total() -> None:
    facts = [replace(RUNS, name=f"dev{i}") for i in range(1, 5)]
    per_device = {
        "dev1": replace(DESIRED, rate=10_000.0),  # 5 s
        "dev2": replace(DESIRED, rate=50_000.0),  # 1 s
        "dev3": replace(DESIRED, rate=None),  # no cap: counted as instant, and listed
        "dev4": DESIRED,  # 0.2 s
    }
    plan = make_plan(per_device, facts)
    canary = Strategy(type="canary", steps=[1, "100%"], analysis_window="60s", pause="30s")
    waves = make_waves(canary, [f.name for f in facts])
    cost = rollout_cost(plan, waves, parallel=4)
    # wave 1: dev1 alone (5 s), analysis and pause (90 s); wave 2: dev2-dev4 in parallel (1 s)
    assert cost.seconds == pytest.approx(5 + 90 + 1)
    assert cost.total_bytes == 200_000 and cost.uncapped == ("dev3",) and cost.full_downloads == ()
    # One at a time, the second wave's sends add up; a fleet total of 10 kB/s binds over them all.
    assert rollout_cost(plan, waves, parallel=1).seconds == pytest.approx(5 + 90 + 1.2)
    assert rollout_cost(plan, waves, parallel=4, push_total=10_000).seconds == pytest.approx(5 + 90 + 15)


BANDWIDTH = {
    "bandwidth": {"rate": "2Mbit", "push_total": "4Mbit", "metered": True},
}


def test_the_fleet_plan_takes_each_device_link_from_deploy_yaml(tmp_path: Path) -> None:
    sim = SimFleet(tmp_path, 3, **BANDWIDTH)
    fp = sim.plan()
    assert {d.rate for d in fp.plan.devices} == {250_000.0}
    assert {d.status for d in fp.plan.devices} == {DeviceStatus.CHANGE}  # patches from 1.0.0
    # A target with no patch from what the devices run: every metered device is blocked, and apply
    # would report each one failed, naming why.
    unpatched = sim.plan(sim._artifact("3.0.0"))
    assert {d.status for d in unpatched.plan.devices} == {DeviceStatus.BLOCKED}
    failure = apply_failures(unpatched.plan)
    assert failure is not None and "dev1 (metered link: no patch from 1.0.0" in failure.message


def test_the_session_caps_each_upload_and_shares_the_push_total(tmp_path: Path) -> None:
    sim = SimFleet(tmp_path, 2, **BANDWIDTH)
    first, second = (sim.session.transport(site) for site in sim.session.sites.values())
    assert first.throttle is not None and second.throttle is not None
    assert [b.rate for b in first.throttle.buckets] == [250_000.0, 500_000.0]
    assert first.throttle.buckets[1] is second.throttle.buckets[1]  # one fleet-wide bucket
    assert first.throttle.buckets[0] is not second.throttle.buckets[0]


def test_plan_prints_each_device_time_and_the_rollout_cost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from deployer.cli.fleet_cmds import _print_plan

    monkeypatch.setenv("COLUMNS", "250")
    sim = SimFleet(tmp_path, 2, **BANDWIDTH)
    fp = sim.plan()
    _print_plan(sim.session, fp.plan, "text")
    table = capsys.readouterr().out
    assert table.count("0s at 2 Mbit/s") == 2  # 4 KiB patch each at 2 Mbit/s: under a second
    assert "total 8.0 KiB, rollout about 0s" in table
    _print_plan(sim.session, fp.plan, "json")
    cost = json.loads(capsys.readouterr().out)["cost"]
    assert cost == {"total_bytes": 8192, "seconds": 8192 / 500_000, "uncapped": [], "full_downloads": []}
