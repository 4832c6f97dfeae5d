"""End to end on a 3-device LOCAL fleet with real agents, through the real CLI.

The tests build on each other in file order (one fleet, agents started once): v1 from scratch, a
no-op re-apply, v2 as a patch under canary with one failing device, a fleet-wide rollback, a canary
halt, offline devices, the lock and the audit log. Each asserts the fleet's state, read back from
the devices themselves.
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from deployer.config import load_config
from deployer.push.facts import DeviceSite, gather_facts
from deployer.push.state import FleetLock, read_audit, read_lock
from deployer.transport import LocalTransport
from tests.fleet.conftest import DEVICES, Project
from tests.signals import default_sigint

CANARY = {"type": "canary", "steps": [1, "100%"], "analysis_window": "1s", "offline": "skip"}


def _facts(project: Project) -> dict:
    config = load_config(project.config_path)
    return {
        d.name: gather_facts(DeviceSite.of(config, d), LocalTransport(project.device_root(d.name)))
        for d in config.fleet.devices
    }


def _versions(project: Project) -> dict[str, str | None]:
    return {name: f.model_version for name, f in _facts(project).items()}


def _report(result) -> dict:
    return json.loads(result.stdout)


def _wait_for_line(lines: queue.Queue[str], prefix: str, deadline: float) -> None:
    """Read lines until one starts with `prefix`; fail at `deadline` (monotonic seconds)."""
    seen = []
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        seen.append(line)
        if line.startswith(prefix):
            return
    pytest.fail(f"no line starting {prefix!r} in time; stderr so far:\n{''.join(seen)[-2000:]}")


def _fail_on(project: Project, device: str | None) -> None:
    marker = project.dir / "hooks/fail-device"
    marker.write_text(device or "")


def test_plan_shows_steps_and_changes_nothing(project: Project):
    assert project.run("build", "-q").exit_code == 0  # plan never builds (issue 18)
    result = project.run("plan", "--output", "json", "--detailed-exitcode")
    assert result.exit_code == 2  # changes pending
    plan = _report(result)
    steps = {d["device"]: [s["kind"] for s in d["steps"]] for d in plan["devices"]}
    assert set(steps) == set(DEVICES)
    assert steps["edge-a"] == [
        "write-units",
        "send-artifact",
        "install",
        "reload",
        "health-gate",
        "post-deploy-hook",
    ]
    assert all(d["steps"][1]["bytes"] > 0 for d in plan["devices"])
    verbose = project.cli("-v", "plan", "-f", str(project.config_path)).output  # what apply will run
    assert "put <signed release manifest> -> /var/lib/sits/incoming/<release-counter>/release.json" in verbose
    assert "deployer.agent.cli install --manifest" in verbose and "call health-gate" in verbose
    assert "put <from deploy.yaml> -> /etc/sits/agent.yaml" in verbose
    assert _versions(project) == dict.fromkeys(DEVICES)  # nothing installed by plan


def test_apply_v1_then_second_apply_reports_no_changes(project: Project):
    result = project.run("apply", "--output", "json")
    assert result.exit_code == 0, result.output
    assert {r["status"] for r in _report(result)["results"]} == {"updated"}
    facts = _facts(project)
    assert all(f.model_version == "1.0.0" and f.ready for f in facts.values())
    again = project.run("apply", "--output", "json")
    assert again.exit_code == 0
    assert not _report(again)["has_changes"]
    assert project.run("plan", "--detailed-exitcode").exit_code == 0


def test_saved_plan_is_refused_after_the_fleet_changed(project: Project, tmp_path):
    project.write("2.0.0", strategy=CANARY)
    assert project.run("build", "-q").exit_code == 0  # plan never builds (issue 18)
    plan_file = tmp_path / "plan.json"
    assert project.run("plan", "-o", str(plan_file), "--detailed-exitcode").exit_code == 2
    extra_key = project.device_root("edge-c") / "etc/sits/keys/other.pub"
    extra_key.write_text("not a key, but the facts see a new file\n")
    try:
        refused = project.cli("apply", str(plan_file))
        assert refused.exit_code == 1
        assert "fleet changed" in refused.output
        assert _versions(project) == dict.fromkeys(DEVICES, "1.0.0")
    finally:
        extra_key.unlink()


def test_failing_pre_deploy_hook_aborts_before_any_change(project: Project):
    project.write("2.0.0", strategy=CANARY, hooks={"pre-deploy": "hooks/check.sh"})
    _fail_on(project, "edge-b")
    try:
        result = project.run("apply", "--output", "json")
    finally:
        _fail_on(project, None)
        project.write("2.0.0", strategy=CANARY, hooks={"post-deploy": "hooks/check.sh"})
    assert result.exit_code == 1
    report = _report(result)
    assert "pre-deploy" in report["halted"] and "edge-b" in report["halted"]
    assert {r["status"] for r in report["results"]} == {"not-started"}
    assert _versions(project) == dict.fromkeys(DEVICES, "1.0.0")


def test_v2_patch_under_canary_a_failing_device_rolls_back(project: Project):
    project.write("2.0.0", strategy={**CANARY, "failure_threshold": 2})
    _fail_on(project, "edge-c")
    result = project.run("apply", "--output", "json")
    assert result.exit_code == 1  # one device failed: not ok, but below the threshold
    report = _report(result)
    by_device = {r["device"]: r for r in report["results"]}
    assert report["halted"] is None
    assert by_device["edge-a"]["status"] == by_device["edge-b"]["status"] == "updated"
    assert by_device["edge-c"]["status"] == "rolled-back"
    assert "check failed" in by_device["edge-c"]["error"] or "exited" in by_device["edge-c"]["error"]
    artifact = project.run("plan", "--output", "json")  # edge-c still needs v2
    # v2 stayed on edge-c's disk when it was rolled back: only a signed manifest is sent (issue 18).
    assert _report(artifact)["devices"][2]["steps"][0]["kind"] == "send-manifest"
    patch_bytes = max(p.stat().st_size for p in (project.dir / ".sits/patches").glob("*.patch"))
    assert 0 < by_device["edge-a"]["bytes_sent"] < 3 * patch_bytes
    assert _versions(project) == {"edge-a": "2.0.0", "edge-b": "2.0.0", "edge-c": "1.0.0"}


def test_rollback_fleet_wide_is_a_new_signed_release(project: Project):
    _fail_on(project, None)
    counters = {n: f.release_counter for n, f in _facts(project).items()}
    result = project.run("rollback", "--to", "1.0.0", "--output", "json")
    assert result.exit_code == 0, result.output
    facts = _facts(project)
    assert {f.model_version for f in facts.values()} == {"1.0.0"}
    # anti-rollback stays on: the devices that moved accepted a higher counter
    assert facts["edge-a"].release_counter > counters["edge-a"]
    assert facts["edge-c"].release_counter == counters["edge-c"]  # already there: untouched


def test_canary_failure_halts_and_rolls_back(project: Project):
    project.write("2.0.0", strategy={**CANARY, "failure_threshold": 1})
    _fail_on(project, "edge-a")  # the canary
    try:
        result = project.run("apply", "--output", "json")
    finally:
        _fail_on(project, None)
    assert result.exit_code == 1
    report = _report(result)
    assert report["halted"]
    statuses = {r["device"]: r["status"] for r in report["results"]}
    assert statuses == {"edge-a": "rolled-back", "edge-b": "not-started", "edge-c": "not-started"}
    assert _versions(project) == dict.fromkeys(DEVICES, "1.0.0")


def test_offline_device_fail_refuses_and_skip_goes_on(project: Project):
    root = project.device_root("edge-c")
    away = root.with_name("edge-c.unplugged")
    root.rename(away)
    try:
        project.write("2.0.0", strategy={**CANARY, "offline": "fail"})
        refused = project.run("apply")
        assert refused.exit_code == 1 and "offline" in refused.output
        assert _versions(project)["edge-a"] == "1.0.0"
        project.write("2.0.0", strategy={**CANARY, "offline": "skip"})
        result = project.run("apply", "--output", "json")
        statuses = {r["device"]: r["status"] for r in _report(result)["results"]}
        assert statuses == {"edge-a": "updated", "edge-b": "updated", "edge-c": "skipped"}
    finally:
        away.rename(root)
    assert _versions(project) == {"edge-a": "2.0.0", "edge-b": "2.0.0", "edge-c": "1.0.0"}


def test_lock_refuses_a_second_apply_and_force_unlock_needs_its_id(project: Project):
    holder = FleetLock(project.dir / ".sits", "apply").held()
    info = holder.__enter__()  # as if another apply were running (or had been killed)
    refused = project.run("apply")
    assert refused.exit_code == 1 and info.lock_id in refused.output
    wrong = project.run("apply", "--force-unlock", "0000")
    assert wrong.exit_code == 1 and "does not match" in wrong.output
    unlocked = project.run("apply", "--force-unlock", info.lock_id, "--output", "json")
    assert unlocked.exit_code == 0, unlocked.output
    assert _versions(project) == dict.fromkeys(DEVICES, "2.0.0")


def test_audit_log_records_every_apply_and_rollback(project: Project):
    records = read_audit(project.dir / ".sits")
    actions = [r["action"] for r in records]
    assert actions.count("rollback") == 1
    assert actions.count("apply") >= 5
    halted = [r for r in records if r.get("halted")]
    assert halted and all(len(r["results"]) == len(DEVICES) for r in records)
    status = json.loads(project.run("status", "--output", "json").stdout)
    assert {row["device"]: row["health"] for row in status} == dict.fromkeys(DEVICES, "ready")


def test_logs_prints_the_agent_log(project: Project):
    result = project.cli("logs", "edge-a", "-f", str(project.config_path))
    assert result.exit_code == 0
    assert "sits-agent event" in result.stdout


def test_blue_green_stages_every_device_then_switches(project: Project):
    project.write("1.0.0", strategy={"type": "blue-green"})
    result = project.run("apply", "--output", "json")
    assert result.exit_code == 0, result.output
    assert {r["status"] for r in _report(result)["results"]} == {"updated"}
    assert _versions(project) == dict.fromkeys(DEVICES, "1.0.0")


def test_ctrl_c_leaves_each_device_on_a_known_version_and_a_rerun_continues(project: Project):
    project.write("2.0.0", strategy={"type": "rolling", "batch_size": 1, "pause": "10m"})
    # -v prints each device's phases on stderr; Ctrl-C once edge-a is done, in the 10 minute pause.
    command = [sys.executable, "-c", "from deployer.cli.main import main; main()", "-v", "apply", "-f"]
    proc = subprocess.Popen(
        [*command, str(project.config_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True)
    reader.start()
    try:
        _wait_for_line(lines, "edge-a: done", deadline=time.monotonic() + 300)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130
    finally:
        proc.kill()
        reader.join(timeout=10)
    last = read_audit(project.dir / ".sits")[-1]
    assert last["interrupted"] is True
    assert {r["device"]: r["status"] for r in last["results"]} == {
        "edge-a": "updated",
        "edge-b": "not-started",
        "edge-c": "not-started",
    }
    assert read_lock(project.dir / ".sits") is None
    assert _versions(project) == {"edge-a": "2.0.0", "edge-b": "1.0.0", "edge-c": "1.0.0"}
    project.write("2.0.0", strategy={"type": "rolling", "batch_size": 2})
    rerun = project.run("apply", "--output", "json")
    statuses = {r["device"]: r["status"] for r in _report(rerun)["results"]}
    assert statuses == {"edge-a": "unchanged", "edge-b": "updated", "edge-c": "updated"}


pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")
