"""Planner cases as data: facts in, expected steps out."""

from __future__ import annotations

from dataclasses import replace

import pytest

from deployer.push.plan import (
    GENERATED,
    RELEASE_COUNTER,
    RELEASE_MANIFEST,
    Action,
    ActionKind,
    DesiredState,
    DeviceFacts,
    DeviceStatus,
    StepKind,
    make_plan,
    plan_device,
)

UNITS = {"sits-agent.service": "u1", "sits-rollback.service": "u2"}
DESIRED = DesiredState(
    version="1.1.0",
    artifact_sha256="new",
    artifact_bytes=1000,
    agent_version="0.1.0",
    unit_hashes=UNITS,
    patches={"old": 100},
    hooks=frozenset({"pre-deploy", "post-deploy"}),
    absent=frozenset({"/etc/sits/key"}),  # gone from the first device's files (up to date without it)
)
CURRENT = dict(
    reachable=True,
    agent_version="0.1.0",
    model_version="1.0.0",
    model_sha256="old",
    unit_hashes=UNITS,
    free_disk_bytes=10_000,
    ready=True,
)
K = StepKind
MOVE = [K.INSTALL, K.RELOAD, K.HEALTH_GATE]

CASES = {
    "up to date": (
        dict(CURRENT, model_version="1.1.0", model_sha256="new"),
        DeviceStatus.UNCHANGED,
        [],
    ),
    "patch from the installed base": (
        CURRENT,
        DeviceStatus.CHANGE,
        [K.PRE_DEPLOY_HOOK, K.SEND_PATCH, *MOVE, K.POST_DEPLOY_HOOK],
    ),
    "unknown base gets the full artifact": (
        dict(CURRENT, model_sha256="other"),
        DeviceStatus.CHANGE,
        [K.PRE_DEPLOY_HOOK, K.SEND_ARTIFACT, *MOVE, K.POST_DEPLOY_HOOK],
    ),
    "fresh device: bootstrap, units, full artifact": (
        dict(reachable=True, free_disk_bytes=10_000),
        DeviceStatus.CHANGE,
        [K.PRE_DEPLOY_HOOK, K.BOOTSTRAP, K.WRITE_UNITS, K.SEND_ARTIFACT, *MOVE, K.POST_DEPLOY_HOOK],
    ),
    "only a unit changed: no hooks, no model steps": (
        dict(
            CURRENT,
            model_version="1.1.0",
            model_sha256="new",
            unit_hashes={**UNITS, "sits-agent.service": "x"},
        ),
        DeviceStatus.CHANGE,
        [K.WRITE_UNITS],
    ),
    "installed but not ready: reload only": (
        dict(CURRENT, model_version="1.1.0", model_sha256="new", ready=False),
        DeviceStatus.CHANGE,
        [K.PRE_DEPLOY_HOOK, K.RELOAD, K.POST_DEPLOY_HOOK],
    ),
    "a key file deploy.yaml no longer asks for: write-units": (
        dict(CURRENT, model_version="1.1.0", model_sha256="new", unit_hashes={**UNITS, "/etc/sits/key": "k"}),
        DeviceStatus.CHANGE,
        [K.WRITE_UNITS],
    ),
    "offline": (dict(reachable=False, error="connection refused"), DeviceStatus.OFFLINE, []),
    "host key changed": (dict(reachable=False, refused=True, error="CHANGED"), DeviceStatus.BLOCKED, []),
    "not enough disk": (dict(CURRENT, free_disk_bytes=500), DeviceStatus.BLOCKED, []),
}


@pytest.mark.parametrize("name", list(CASES))
def test_plan_cases(name: str) -> None:
    facts_kwargs, status, kinds = CASES[name]
    plan = plan_device(DESIRED, DeviceFacts(name="dev1", **facts_kwargs))
    assert plan.status is status
    assert [s.kind for s in plan.steps] == kinds
    assert all(s.reason for s in plan.steps)


def test_a_stale_key_file_is_named_in_the_reason() -> None:
    facts = DeviceFacts(name="dev1", **dict(CURRENT, model_version="1.1.0", model_sha256="new"))
    stale = plan_device(DESIRED, replace(facts, unit_hashes={**UNITS, "/etc/sits/key": "k"}))
    assert stale.steps[0].reason == "remove /etc/sits/key"
    both = plan_device(DESIRED, replace(facts, unit_hashes={"/etc/sits/key": "k"}))
    assert (
        both.steps[0].reason
        == "units differ: sits-agent.service, sits-rollback.service; remove /etc/sits/key"
    )


def test_bytes_to_send_counts_the_payload() -> None:
    patch = plan_device(DESIRED, DeviceFacts(name="a", **CURRENT))
    full = plan_device(DESIRED, DeviceFacts(name="b", **dict(CURRENT, model_sha256="zzz")))
    assert patch.bytes_to_send == 100
    assert full.bytes_to_send == 1000


def test_plan_digest_changes_when_a_device_changes() -> None:
    facts = [DeviceFacts(name="a", **CURRENT), DeviceFacts(name="b", **CURRENT)]
    moved = [facts[0], DeviceFacts(name="b", **dict(CURRENT, model_sha256="new"))]
    assert make_plan(DESIRED, facts).facts_digest == make_plan(DESIRED, list(reversed(facts))).facts_digest
    assert make_plan(DESIRED, facts).facts_digest != make_plan(DESIRED, moved).facts_digest


def test_plan_has_changes_and_serializes() -> None:
    done = DeviceFacts(name="a", **dict(CURRENT, model_version="1.1.0", model_sha256="new"))
    assert not make_plan(DESIRED, [done]).has_changes
    plan = make_plan(DESIRED, [done, DeviceFacts(name="b", **CURRENT)])
    data = plan.to_dict()
    assert data["has_changes"] is True
    assert [d["status"] for d in data["devices"]] == ["unchanged", "change"]


class _Recipe:
    """A recipe that names each step's kind, to see that the planner asks for every step's actions."""

    def actions(self, kind: StepKind, facts: DeviceFacts, desired: DesiredState) -> tuple[Action, ...]:
        return (Action(ActionKind.RUN, f"echo {kind.value} on {facts.name}", timeout_s=5),)


def test_every_step_carries_the_actions_its_recipe_writes() -> None:
    plan = make_plan(DESIRED, [DeviceFacts(name="a", **CURRENT)], _Recipe())
    (device,) = plan.devices
    assert [s.actions[0].target for s in device.steps] == [f"echo {s.kind.value} on a" for s in device.steps]
    assert plan.to_dict()["devices"][0]["steps"][1]["actions"][0]["kind"] == "run"  # saved with the plan


def test_make_plan_takes_a_desired_state_per_device_of_one_target() -> None:
    facts = [DeviceFacts(name="a", **CURRENT), DeviceFacts(name="b", **CURRENT)]
    other_units = DesiredState(**{**DESIRED.__dict__, "unit_hashes": {"sits-agent.service": "changed"}})
    plan = make_plan({"a": DESIRED, "b": other_units}, facts)
    assert K.WRITE_UNITS not in [s.kind for s in plan.devices[0].steps]
    assert K.WRITE_UNITS in [s.kind for s in plan.devices[1].steps]
    with pytest.raises(ValueError, match="one target"):
        make_plan({"a": DESIRED, "b": DesiredState(**{**DESIRED.__dict__, "version": "9"})}, facts)


def test_rollback_hooks_wrap_the_model_steps_of_a_rollback_plan() -> None:
    rollback = DesiredState(**{**DESIRED.__dict__, "hooks": frozenset({"pre-rollback", "post-rollback"})})
    steps = plan_device(rollback, DeviceFacts(name="a", **CURRENT)).steps
    assert [(s.kind, s.reason) for s in steps if "hook" in s.kind.value] == [
        (K.PRE_DEPLOY_HOOK, "pre-rollback hook"),
        (K.POST_DEPLOY_HOOK, "post-rollback hook"),
    ]


@pytest.mark.parametrize(
    ("action", "line"),
    [
        (
            Action(ActionKind.PUT, "/etc/sits/agent.yaml", GENERATED, "ab" * 32, 12),
            "put <from deploy.yaml> -> /etc/sits/agent.yaml (12 bytes sha256 abababababab)",
        ),
        (
            Action(ActionKind.RUN, "systemctl daemon-reload", timeout_s=60),
            "run systemctl daemon-reload  (timeout 60s)",
        ),
        (Action(ActionKind.HOOK, "post-deploy", "/p/hooks/check.sh"), "hook post-deploy: /p/hooks/check.sh"),
    ],
)
def test_actions_describe_themselves_in_one_line(action: Action, line: str) -> None:
    assert action.describe() == line


def test_the_release_counter_is_filled_in_at_apply() -> None:
    put = Action(ActionKind.PUT, f"/var/lib/sits/incoming/{RELEASE_COUNTER}/release.json", RELEASE_MANIFEST)
    assert put.for_release(7).target == "/var/lib/sits/incoming/7/release.json"
    assert put.for_release(7).source == RELEASE_MANIFEST
