"""The executor on a simulated fleet (tests/push/simulator.py): strategies, thresholds, rollback,
offline policies, Ctrl-C and resume, the audit log, exit codes. No sleeps, no ports, no processes.

A fake fleet, because 5-50 devices with scripted faults cannot exist in a unit test; the lab tests
run the same rollouts end to end on real devices.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from deployer.errors import SitsError
from deployer.push.executor import ResultStatus, RolloutReport
from deployer.push.fleet import FleetPlan, apply_plan, apply_refusal, make_fleet_plan
from deployer.push.plan import RELEASE_COUNTER, ActionKind, StepKind
from deployer.push.state import read_audit, read_lock
from tests.push.simulator import SimFleet

S = ResultStatus


def _run(sim: SimFleet, fp: FleetPlan | None = None, **executor: object) -> RolloutReport:
    fp = fp or sim.plan()
    return sim.executor(**executor).run(fp.plan, {f.name: f for f in fp.facts}, sim.releases(sim.session, fp))


def _statuses(report: RolloutReport) -> dict[str, ResultStatus]:
    return {r.device: r.status for r in report.results}


def _versions(sim: SimFleet) -> dict[str, str | None]:
    return {n: d.version for n, d in sim.devices.items()}


def _apply(sim: SimFleet, fp: FleetPlan | None = None) -> RolloutReport:
    return apply_plan(sim.session, fp or sim.plan(), releases=sim.releases, executor=sim.executor)


def test_all_at_once_updates_every_device_in_one_wave(tmp_path: Path) -> None:
    sim = SimFleet(tmp_path, 5)
    report = _run(sim)
    assert _statuses(report) == dict.fromkeys(sim.devices, S.UPDATED)
    assert report.ok and report.exit_code == 0
    assert _versions(sim) == dict.fromkeys(sim.devices, "2.0.0")
    assert sim.clock.waits == []  # one wave: no pause, no analysis
    manifest = len((tmp_path / "release-11.json").read_bytes())
    assert {r.bytes_sent for r in report.results} == {4096 + manifest}  # the patch and the manifest


def test_what_plan_prints_is_what_runs(tmp_path: Path) -> None:
    sim = SimFleet(tmp_path, 2)
    fp = sim.plan()
    releases = sim.releases(sim.session, fp)
    sim.executor().run(fp.plan, {f.name: f for f in fp.facts}, releases)
    for dp in fp.plan.devices:
        planned = [a.for_release(releases[dp.device].counter) for s in dp.steps for a in s.actions]
        puts = [a.target for a in planned if a.kind is ActionKind.PUT]
        runs = [a.target for a in planned if a.kind is ActionKind.RUN]
        assert [x for d, e, x in sim.events if e == "put" and d == dp.device] == puts
        assert [x for d, e, x in sim.events if e == "run" and d == dp.device] == runs
        assert len(puts) == 2 and len(runs) == 1  # manifest and patch; sits-agent install
        assert all(RELEASE_COUNTER not in a.describe() for a in planned)
    printed = [a.describe() for s in fp.plan.devices[0].steps for a in s.actions]
    assert printed[0].startswith("put <signed release manifest> -> /var/lib/sits/incoming/<release-counter>/")
    assert (
        "cli install --manifest '/sim/dev1/var/lib/sits/incoming/<release-counter>/release.json'"
        in printed[2]
    )


def test_rolling_batches_one_after_another_within_max_unavailable(tmp_path: Path) -> None:
    strategy = {"type": "rolling", "batch_size": 2, "max_unavailable": 1, "pause": "30s"}
    sim = SimFleet(tmp_path, 5, strategy=strategy)
    report = _run(sim, parallel=8)
    assert report.ok
    # max_unavailable 1: one device at a time, in inventory order, even with --parallel 8
    assert sim.of("installed") == ["dev1", "dev2", "dev3", "dev4", "dev5"]
    assert sim.clock.waits == [30.0, 30.0]  # a pause between the three batches, none after the last
    order = [(d, e) for d, e, _ in sim.events if e in {"installed", "sleep"}]
    assert [d for d, _ in order] == ["dev1", "dev2", "-", "dev3", "dev4", "-", "dev5"]


def test_canary_steps_with_analysis_windows_then_the_rest(tmp_path: Path) -> None:
    strategy = {"type": "canary", "steps": [1, "60%"], "analysis_window": "2m", "pause": "10s"}
    sim = SimFleet(tmp_path, 5, strategy=strategy)
    report = _run(sim)
    assert report.ok
    assert sim.clock.waits == [120.0, 10.0, 120.0, 10.0]  # window and pause after each step but the last
    waves, current = [], []
    for device, event, _ in sim.events:
        if event == "installed":
            current.append(device)
        elif event == "sleep" and current:
            waves.append(sorted(current))
            current = []
    waves.append(sorted(current))
    assert waves == [["dev1"], ["dev2", "dev3"], ["dev4", "dev5"]]  # 1, then up to 60%, then the rest
    assert sorted(sim.of("analysed")) == ["dev1", "dev2", "dev3"]  # the last step is not analysed


def test_canary_analysis_failing_on_20_percent_errors_halts_and_rolls_back(tmp_path: Path) -> None:
    strategy = {"type": "canary", "steps": [1, "60%"], "analysis_window": "1m"}
    sim = SimFleet(tmp_path, 5, strategy=strategy)
    sim.devices["dev1"].script.error_rate = 0.20  # the canary's /metrics report 20% errors
    report = _run(sim)
    assert report.halted and "canary analysis" in report.halted
    assert _statuses(report) == {
        "dev1": S.ROLLED_BACK,
        **dict.fromkeys(["dev2", "dev3", "dev4", "dev5"], S.NOT_STARTED),
    }
    assert "error rate 20.0%" in (report.results[0].error or "")
    assert _versions(sim) == dict.fromkeys(sim.devices, "1.0.0")
    assert report.exit_code == 1


def test_blue_green_stages_every_device_before_switching_any(tmp_path: Path) -> None:
    sim = SimFleet(tmp_path, 4, strategy={"type": "blue-green"})
    report = _run(sim)
    assert report.ok
    last_put = max(i for i, (_, e, _) in enumerate(sim.events) if e == "put")
    first_install = min(i for i, (_, e, _) in enumerate(sim.events) if e == "installed")
    assert last_put < first_install  # every payload is on every device before one switches


def test_blue_green_a_device_that_cannot_stage_switches_nobody(tmp_path: Path) -> None:
    sim = SimFleet(tmp_path, 4, strategy={"type": "blue-green"})
    sim.devices["dev3"].script.drop_after, sim.devices["dev3"].script.drops = 100, 99  # past every retry
    report = _run(sim)
    assert report.halted and "no device was switched" in report.halted
    assert sim.of("installed") == []
    statuses = _statuses(report)
    assert statuses["dev3"] is S.FAILED
    assert {statuses[n] for n in ("dev1", "dev2", "dev4")} == {S.SKIPPED}  # staged, never switched
    assert _versions(sim) == dict.fromkeys(sim.devices, "1.0.0")


@pytest.mark.parametrize(("threshold", "halts"), [(2, True), (3, False)])
def test_halts_exactly_at_the_failure_threshold(tmp_path: Path, threshold: int, halts: bool) -> None:
    strategy = {"type": "rolling", "batch_size": 1, "failure_threshold": threshold, "auto_rollback": False}
    sim = SimFleet(tmp_path, 6, strategy=strategy)
    sim.devices["dev2"].script.install_fails = True
    sim.devices["dev4"].script.install_fails = True
    report = _run(sim)
    statuses = _statuses(report)
    # a failed install leaves the device on its old version: rolled back, by the agent's atomicity
    assert statuses["dev2"] is statuses["dev4"] is S.ROLLED_BACK
    if halts:  # the second failure reaches 2: dev5 and dev6 never start
        assert report.halted == "2 device(s) failed, threshold is 2"
        assert [statuses[n] for n in ("dev1", "dev3", "dev5", "dev6")] == [
            S.UPDATED,
            S.UPDATED,
            S.NOT_STARTED,
            S.NOT_STARTED,
        ]
    else:
        assert report.halted is None
        assert [statuses[n] for n in ("dev1", "dev3", "dev5", "dev6")] == [S.UPDATED] * 4
    assert report.exit_code == 1


def test_auto_rollback_returns_only_the_devices_this_rollout_updated(tmp_path: Path) -> None:
    strategy = {"type": "rolling", "batch_size": 1, "failure_threshold": 1}
    sim = SimFleet(tmp_path, 5, strategy=strategy)
    done = sim.devices["dev1"]  # already on the target before this rollout: unchanged
    done.version, done.sha256, done.serving = "2.0.0", sim.target.artifact_sha256, "2.0.0"
    sim.devices["dev4"].script.install_fails = True
    report = _run(sim)
    assert _statuses(report) == {
        "dev1": S.UNCHANGED,
        "dev2": S.ROLLED_BACK,
        "dev3": S.ROLLED_BACK,
        "dev4": S.ROLLED_BACK,  # its install failed: it never left 1.0.0
        "dev5": S.NOT_STARTED,
    }
    assert sorted(sim.of("rolled-back")) == ["dev2", "dev3"]
    assert _versions(sim) == {"dev1": "2.0.0", **dict.fromkeys(["dev2", "dev3", "dev4", "dev5"], "1.0.0")}


def test_a_slow_smoke_test_rolls_that_device_back_below_the_threshold(tmp_path: Path) -> None:
    sim = SimFleet(tmp_path, 3, strategy={"type": "all-at-once", "failure_threshold": 2})
    sim.devices["dev2"].script.smoke_ms = 5000  # the budget is 1000 ms
    report = _run(sim)
    statuses = _statuses(report)
    assert statuses == {"dev1": S.UPDATED, "dev2": S.ROLLED_BACK, "dev3": S.UPDATED}
    assert "5000 ms" in (report.results[1].error or "") and report.results[1].phase == "health-gate"
    assert report.halted is None and report.exit_code == 1


def test_a_dropped_connection_resumes_and_sends_the_rest(tmp_path: Path) -> None:
    sim = SimFleet(tmp_path, 2)
    sim.devices["dev1"].script.drop_after = 1000
    report = _run(sim)
    assert report.ok
    assert sim.of("dropped") == ["dev1"]
    sent = {r.device: r.bytes_sent for r in report.results}
    assert sent["dev1"] == sent["dev2"]  # resumed from the verified 1000 bytes, nothing sent twice
    assert (
        bytes(sim.devices["dev1"].files["/var/lib/sits/incoming/11/update.patch"]) == sim.patch.read_bytes()
    )


def test_offline_skip_goes_on_and_reports_the_device_skipped(tmp_path: Path) -> None:
    sim = SimFleet(tmp_path, 5, strategy={"type": "all-at-once", "offline": "skip"})
    sim.devices["dev5"].script.offline = True
    report = _apply(sim)
    statuses = _statuses(report)
    assert statuses["dev5"] is S.SKIPPED and "timed out" in (report.results[4].error or "")
    assert {statuses[n] for n in ("dev1", "dev2", "dev3", "dev4")} == {S.UPDATED}
    assert report.ok  # skipped by policy is not a failure


def test_offline_fail_refuses_before_anything_changes(tmp_path: Path) -> None:
    sim = SimFleet(tmp_path, 5, strategy={"type": "all-at-once", "offline": "fail"})
    sim.devices["dev5"].script.offline = True
    with pytest.raises(SitsError, match=r"1 device\(s\) offline: dev5"):
        _apply(sim)
    assert sim.of("put") == [] and sim.of("installed") == []
    assert read_audit(sim.session.sits_dir) == [] and read_lock(sim.session.sits_dir) is None


def test_ctrl_c_is_recorded_and_a_second_apply_resumes(tmp_path: Path) -> None:
    sim = SimFleet(tmp_path, 3, strategy={"type": "rolling", "batch_size": 1, "pause": "10m"})
    sim.clock.interrupt_at = 1  # Ctrl-C during the pause after the first batch
    with pytest.raises(KeyboardInterrupt):
        _apply(sim)
    last = read_audit(sim.session.sits_dir)[-1]
    assert last["interrupted"] is True and last["ok"] is False
    assert {r["device"]: r["status"] for r in last["results"]} == {
        "dev1": "updated",
        "dev2": "not-started",
        "dev3": "not-started",
    }
    assert read_lock(sim.session.sits_dir) is None
    sim.clock.interrupt_at = None
    again = _apply(sim)  # planned afresh: dev1 already matches
    assert _statuses(again) == {"dev1": S.UNCHANGED, "dev2": S.UPDATED, "dev3": S.UPDATED}
    assert _versions(sim) == dict.fromkeys(sim.devices, "2.0.0")
    assert not sim.plan().plan.has_changes  # a third apply has nothing to do


def test_audit_log_records_each_apply_with_every_device(tmp_path: Path) -> None:
    sim = SimFleet(tmp_path, 3, strategy={"type": "all-at-once", "failure_threshold": 1})
    sim.devices["dev2"].script.install_fails = True
    fp = sim.plan()
    report = _apply(sim, fp)
    (record,) = read_audit(sim.session.sits_dir)
    assert record["action"] == "apply" and record["plan_digest"] == fp.plan.facts_digest
    assert record["lock_id"] and record["at"]
    assert record["halted"] == report.halted == "1 device(s) failed, threshold is 1"
    assert [r["status"] for r in record["results"]] == [str(r.status) for r in report.results]
    assert record["ok"] is False and record["strategy"] == "all-at-once"


def test_failing_pre_deploy_hook_halts_before_any_device_changes(tmp_path: Path) -> None:
    sim = SimFleet(tmp_path, 3, hooks={"pre-deploy": "hooks/check.sh", "post-deploy": "hooks/check.sh"})
    sim.devices["dev2"].script.hook_fails = frozenset({"pre-deploy"})
    report = _run(sim)
    assert report.halted and "dev2" in report.halted
    assert set(_statuses(report).values()) == {S.NOT_STARTED}
    assert sim.of("put") == [] and [e for e in sim.events if e[1] == "hook"] == [
        ("dev1", "hook", "pre-deploy"),
        ("dev2", "hook", "pre-deploy"),
    ]


def test_exit_codes(tmp_path: Path) -> None:
    sim = SimFleet(tmp_path, 1)
    ok = _run(sim)
    assert ok.exit_code == 0
    interrupted = RolloutReport("apply", "rolling", "2.0.0", ok.results, interrupted=True)
    halted = RolloutReport("apply", "rolling", "2.0.0", ok.results, halted="threshold")
    assert (interrupted.exit_code, halted.exit_code) == (130, 1)


def test_a_rollback_to_a_version_still_on_the_device_sends_only_its_signed_manifest(tmp_path: Path) -> None:
    sim = SimFleet(tmp_path, 2)
    assert _run(sim).ok  # every device on 2.0.0; 1.0.0 stays on their disks
    back = make_fleet_plan(sim.config, sim.session.sites, sim.facts(), sim.v1, {}, rollback=True)
    for dp in back.plan.devices:
        assert [s.kind for s in dp.steps] == [
            StepKind.SEND_MANIFEST,
            StepKind.INSTALL,
            StepKind.RELOAD,
            StepKind.HEALTH_GATE,
        ]
        assert dp.reason == "1.0.0 is still on the device: switch to it"
        (install,) = next(s for s in dp.steps if s.kind is StepKind.INSTALL).actions
        assert f"--artifact {sim.session.sites[dp.device].root}/var/lib/sits/versions/1.0.0" in install.target
    sim.events.clear()
    releases = sim.releases(sim.session, back)
    report = sim.executor().run(back.plan, {f.name: f for f in back.facts}, releases, action="rollback")
    assert _statuses(report) == dict.fromkeys(sim.devices, S.UPDATED)
    assert _versions(sim) == dict.fromkeys(sim.devices, "1.0.0")
    for result in report.results:  # the manifest, and not one byte of the model
        assert result.bytes_sent == releases[result.device].manifest.stat().st_size
    assert [x.rsplit("/", 1)[1] for _, e, x in sim.events if e == "put"] == ["release.json"] * 2


def test_a_plan_made_before_the_build_shows_the_build_and_cannot_run(tmp_path: Path) -> None:
    sim = SimFleet(tmp_path, 2)
    fp = make_fleet_plan(sim.config, sim.session.sites, sim.facts(), None, {})
    assert fp.plan.has_changes and not fp.plan.converged and fp.plan.target_sha256 == ""
    for dp in fp.plan.devices:
        assert [(s.kind, s.actions) for s in dp.steps] == [(StepKind.BUILD, ())]
        assert dp.reason == "2.0.0 not built: run `sits-deployer build`"
    with pytest.raises(SitsError, match=r"2\.0\.0 is not built, so this plan cannot be applied"):
        _apply(sim, fp)
    assert sim.events == [] and read_lock(sim.session.sits_dir) is None


def test_releases_to_send_and_no_signing_key_refuse_before_anything_changes(tmp_path: Path) -> None:
    sim = SimFleet(tmp_path, 2, signing=None)
    fp = sim.plan()
    refusal = apply_refusal(sim.config, fp.plan)
    assert refusal is not None and "no signing.private_key" in refusal.message
    assert apply_refusal(sim.config, fp.plan, signing=False) is None  # a drift check needs no key
    with pytest.raises(SitsError, match=r"no signing\.private_key"):
        _apply(sim, fp)
    assert sim.of("put") == [] and read_audit(sim.session.sits_dir) == []


def test_offline_under_fail_is_the_refusal_the_dry_run_reports(tmp_path: Path) -> None:
    sim = SimFleet(tmp_path, 3, strategy={"type": "all-at-once", "offline": "fail"})
    sim.devices["dev3"].script.offline = True
    fp = sim.plan()
    refusal = apply_refusal(sim.config, fp.plan)
    assert refusal is not None and refusal.message == "1 device(s) offline: dev3; strategy.offline is 'fail'"
    assert not fp.plan.converged
    (tmp_path / "skip").mkdir()
    skip = SimFleet(tmp_path / "skip", 3, strategy={"type": "all-at-once", "offline": "skip"})
    skip.devices["dev3"].script.offline = True
    assert apply_refusal(skip.config, skip.plan().plan) is None  # skipped: drift, not a refusal


def test_a_hooks_output_reaches_the_progress_callback(tmp_path: Path) -> None:
    sim = SimFleet(tmp_path, 2, hooks={"pre-deploy": "hooks/check.sh", "post-deploy": "hooks/check.sh"})
    assert _run(sim).ok
    outputs = [(d, e, x) for d, e, x in sim.events if e.endswith(" output")]
    assert outputs[:2] == [  # every pre-deploy hook before any device changes, in order
        ("dev1", "phase:pre-deploy output", "pre-deploy: checked dev1\n"),
        ("dev2", "phase:pre-deploy output", "pre-deploy: checked dev2\n"),
    ]
    assert sorted(outputs[2:]) == [  # post-deploy, from the devices' worker threads
        ("dev1", "phase:post-deploy output", "post-deploy: checked dev1\n"),
        ("dev2", "phase:post-deploy output", "post-deploy: checked dev2\n"),
    ]


def test_a_canary_that_falls_back_twice_as_often_as_the_old_version_fails_its_analysis(
    tmp_path: Path,
) -> None:
    strategy = {"type": "canary", "steps": [1, "60%"], "analysis_window": "1m"}
    sim = SimFleet(tmp_path, 5, strategy=strategy)
    sim.fallback_rates = {"1.0.0": 0.10, "2.0.0": 0.25}  # the new version leaves more to the upstream
    report = _run(sim)
    assert report.halted and "canary analysis" in report.halted
    assert "fallback rate 25.0% over 100 answers is more than 2x the 10.0%" in (report.results[0].error or "")
    assert _versions(sim) == dict.fromkeys(sim.devices, "1.0.0")


def test_a_canary_falling_back_about_as_often_passes(tmp_path: Path) -> None:
    strategy = {"type": "canary", "steps": [1, "60%"], "analysis_window": "1m"}
    sim = SimFleet(tmp_path, 5, strategy=strategy)
    sim.fallback_rates = {"1.0.0": 0.10, "2.0.0": 0.15}
    assert _run(sim).ok
