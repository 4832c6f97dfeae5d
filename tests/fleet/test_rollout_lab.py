"""SmolLM2-135M-Instruct rolled out across five lab devices under every strategy (marked `lab`, `slow`).

Real SSH (paramiko against each device's sshd), real systemd (Type=notify units), the real CLI, the
real model: v1 is SmolLM2 int8, v2 the same model with its last two layers changed, so v2 travels as
a patch. The agents listen on the lab network, and while a rollout runs a client in the hub keeps
asking every device through the official `openai` client. The tests build on each other, in file
order:

    all-at-once   v1 (full artifact) to every device, with dev2's SSH connection cut once
                  mid-upload (the upload resumes; nothing is sent twice); a second plan has nothing to do
    rolling       v2 as a patch in batches of 2, one device at a time; no failed request
    rollback      the whole fleet back to v1, as a new signed release
    canary        v2 again; dev3's post-deploy hook fails in the second step -> halt, and every
                  device this rollout touched goes back to v1; dev4 and dev5 are never started
    blue-green    v2 staged on every reachable device, then switched; unplugged dev5 is skipped and
                  a re-run, once it is back, updates only dev5
    host keys     a device whose host key changed is refused, with its fingerprint; the rest go on
    canary        v2 in steps of 1, 50%, 100% with an analysis window after each: all pass
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deployer.build.demo_model import make_smollm2_variant
from deployer.demo.traffic import Traffic
from tests.fleet.conftest import make_project
from tests.lab.api_key import LAB_API_KEY, lab_agent
from tests.lab.lab import Lab
from tests.transport.proxy import CuttingProxy

pytestmark = [pytest.mark.lab, pytest.mark.slow]

NAMES = tuple(f"dev{i}" for i in range(1, 6))
PORT = 8080
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def smollm2_v2(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 with its last two layers changed: a real v2 whose patch is a fraction of the model."""
    return make_smollm2_variant(tmp_path_factory.mktemp("smollm2-v2") / "model", seed=1)


@pytest.fixture(scope="module")
def fleet(lab: Lab, tmp_path_factory, smollm2_dir: Path, smollm2_v2: Path):
    """A project for 5 factory-fresh lab devices serving on the lab network."""
    for i in range(1, 6):
        lab.reset(i)
    devices = lab.inventory(range(1, 6), rings=True)
    project = make_project(
        tmp_path_factory.mktemp("lab-smollm2"), {"1.0.0": smollm2_dir, "2.0.0": smollm2_v2}, devices
    )
    project.write(
        "1.0.0",
        agent=lab_agent(project.config_path.parent, PORT),
        health={"readiness_timeout": "300s", "latency_budget_ms": 60000, "smoke_prompts": ["Hi"]},
    )
    return project


def _apply(project, *args: str) -> tuple[int, dict]:
    result = project.run("apply", "--output", "json", "--parallel", "5", *args)
    return result.exit_code, json.loads(result.stdout)


def _by_device(report: dict) -> dict[str, dict]:
    return {row["device"]: row for row in report["results"]}


def _status(project) -> dict[str, tuple[str | None, str]]:
    result = project.run("status", "--output", "json")
    assert result.exit_code == 0, result.output
    return {row["device"]: (row["version"], row["health"]) for row in json.loads(result.stdout)}


def _size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def _targets(lab: Lab, indices=range(1, 6)) -> list[tuple[str, int]]:
    return [(lab.device(i).address, PORT) for i in indices]


def test_all_at_once_v1_on_five_devices_survives_a_dropped_connection(
    hub: Lab, fleet, host_key_line, tmp_path
):
    assert fleet.run("build", "-q").exit_code == 0  # plan never builds (issue 18)
    plan = json.loads(fleet.run("plan", "--output", "json").stdout)
    assert [d["device"] for d in plan["devices"]] == list(NAMES)
    for device in plan["devices"]:
        kinds = [s["kind"] for s in device["steps"]]
        assert kinds[:3] == ["bootstrap", "write-units", "send-artifact"], kinds
    artifact = plan["devices"][0]["steps"][2]["bytes"]
    # dev2 is reached through a proxy that cuts its connection once, 60 MB into the uploads.
    proxy = CuttingProxy((hub.device(2).address, 22), cut_after=60_000_000)
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:{proxy.port} {' '.join(host_key_line(2))}\n")
    fleet.edit_device("dev2", host="127.0.0.1", port=proxy.port, known_hosts=str(known_hosts))
    try:
        code, report = _apply(fleet)
    finally:
        proxy.close()
        fleet.edit_device("dev2", host=hub.device(2).address, port=22, known_hosts=str(hub.known_hosts))
    assert code == 0, report["results"]
    rows = _by_device(report)
    assert {r["status"] for r in rows.values()} == {"updated"}, rows
    assert proxy.cut and proxy.connections >= 2  # the link died mid-upload, and the transport came back
    # Resumed, not restarted: at most the bytes in flight at the cut were sent twice.
    assert rows["dev1"]["bytes_sent"] >= artifact
    assert rows["dev2"]["bytes_sent"] < rows["dev1"]["bytes_sent"] + 8_000_000, rows
    assert _status(fleet) == dict.fromkeys(NAMES, ("1.0.0", "ready"))
    again = fleet.run("plan", "--output", "json", "--detailed-exitcode")
    assert again.exit_code == 0, again.output  # converged: nothing left to do


def test_rolling_v2_patch_with_no_failed_request(hub: Lab, fleet):
    fleet.write("2.0.0", strategy={"type": "rolling", "batch_size": 2, "max_unavailable": 1})
    assert fleet.run("build", "-q").exit_code == 0  # plan never builds (issue 18)
    plan = json.loads(fleet.run("plan", "--output", "json").stdout)
    assert {d["steps"][0]["kind"] for d in plan["devices"]} == {"send-patch"}, plan
    with Traffic(_targets(hub), question=QUESTION, max_requests=400, api_key=LAB_API_KEY) as traffic:
        code, report = _apply(fleet)
    assert code == 0, report["results"]
    rows = _by_device(report)
    assert {r["status"] for r in rows.values()} == {"updated"}, rows
    full = _size(next((fleet.dir / ".sits/store/artifacts").iterdir()))
    assert all(0 < r["bytes_sent"] < full / 20 for r in rows.values()), (rows, full)  # patches
    assert traffic.report.failed == 0, traffic.report.errors
    answered_by = {name.rpartition("@")[2] for name in traffic.report.versions}  # "<model>@<version>"
    assert answered_by == {"1.0.0", "2.0.0"}, traffic.report
    assert _status(fleet) == dict.fromkeys(NAMES, ("2.0.0", "ready"))


def test_fleet_rollback_to_v1(hub: Lab, fleet):
    result = fleet.run("rollback", "--to", "1.0.0", "--output", "json", "--parallel", "5")
    assert result.exit_code == 0, result.output
    assert _status(fleet) == dict.fromkeys(NAMES, ("1.0.0", "ready"))


def test_canary_failure_halts_and_rolls_the_fleet_back(hub: Lab, fleet):
    (fleet.dir / "hooks/fail-device").write_text("dev3")
    strategy = {"type": "canary", "steps": [1, 3, "100%"], "analysis_window": "2s", "failure_threshold": 1}
    fleet.write("2.0.0", strategy=strategy)
    try:
        code, report = _apply(fleet)
    finally:
        (fleet.dir / "hooks/fail-device").unlink()
    assert code == 1, report
    assert report["halted"], report
    rows = _by_device(report)
    assert "check failed" in rows["dev3"]["error"] or "exited" in rows["dev3"]["error"], rows["dev3"]
    assert {rows[n]["status"] for n in ("dev1", "dev2", "dev3")} == {"rolled-back"}, rows
    assert {rows[n]["status"] for n in ("dev4", "dev5")} == {"not-started"}, rows
    assert _status(fleet) == dict.fromkeys(NAMES, ("1.0.0", "ready"))


def test_blue_green_skips_an_offline_device_and_a_rerun_finishes(hub: Lab, fleet):
    fleet.write("2.0.0", strategy={"type": "blue-green", "offline": "skip"})
    hub.unplug(5)
    try:
        code, report = _apply(fleet)
    finally:
        hub.plug(5)
    rows = _by_device(report)
    assert {rows[n]["status"] for n in NAMES[:4]} == {"updated"}, rows
    assert rows["dev5"]["status"] == "skipped" and rows["dev5"]["error"], rows["dev5"]
    assert code == 0, report  # skipped per policy, and reported with the reason
    code, report = _apply(fleet)
    assert code == 0, report["results"]
    rows = _by_device(report)
    assert rows["dev5"]["status"] == "updated" and {rows[n]["status"] for n in NAMES[:4]} == {"unchanged"}
    assert _status(fleet) == dict.fromkeys(NAMES, ("2.0.0", "ready"))


def test_a_changed_host_key_is_refused_with_its_fingerprint(hub: Lab, fleet, host_key_line, tmp_path):
    # dev1's entry names dev4's key: to the controller, dev1's key has changed.
    known_hosts = tmp_path / "known_hosts"
    key_type, key_b64 = host_key_line(4)
    known_hosts.write_text(f"{hub.device(1).address} {key_type} {key_b64}\n")
    fleet.edit_device("dev1", known_hosts=str(known_hosts))
    try:
        result = fleet.run("rollback", "--to", "1.0.0", "--output", "json", "--parallel", "5")
    finally:
        fleet.edit_device("dev1", known_hosts=str(hub.known_hosts))
    assert result.exit_code == 1, result.output
    rows = _by_device(json.loads(result.stdout))
    assert "CHANGED" in rows["dev1"]["error"] and "SHA256:" in rows["dev1"]["error"], rows["dev1"]
    assert rows["dev1"]["status"] == "blocked", rows["dev1"]  # not skipped as if offline
    status = _status(fleet)
    assert status["dev1"] == ("2.0.0", "ready")  # untouched
    assert {status[n] for n in NAMES[1:]} == {("1.0.0", "ready")}


def test_canary_v2_completes_when_every_step_passes_its_analysis(hub: Lab, fleet):
    # From the previous test: dev1 on v2 (it was refused), dev2-5 on v1.
    strategy = {"type": "canary", "steps": [1, "50%", "100%"], "analysis_window": "2s"}
    fleet.write("2.0.0", strategy=strategy)
    with Traffic(_targets(hub), question=QUESTION, max_requests=400, api_key=LAB_API_KEY) as traffic:
        code, report = _apply(fleet)
    assert code == 0, report["results"]
    rows = _by_device(report)
    assert rows["dev1"]["status"] == "unchanged" and {rows[n]["status"] for n in NAMES[1:]} == {"updated"}
    assert traffic.report.failed == 0, traffic.report.errors
    assert _status(fleet) == dict.fromkeys(NAMES, ("2.0.0", "ready"))
