"""The recipe of device actions (deployer.push.operations) on the simulated fleet's config."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from deployer.core.hashing import sha256_bytes
from deployer.push.operations import DeviceRecipe
from deployer.push.plan import GENERATED, ActionKind, DesiredState, DeviceFacts, StepKind
from tests.push.simulator import SimFleet

FILES = {"/etc/sits/agent.yaml": b"port: 1\n", "/etc/systemd/system/sits-agent.service": b"[Unit]\n"}


def _setup(tmp_path: Path) -> tuple[DeviceRecipe, DeviceFacts, DesiredState]:
    sim = SimFleet(tmp_path, 1)
    recipe = DeviceRecipe(
        sim.config,
        sim.session.sites,
        {"dev1": FILES},
        {},
        ((sim.target.artifact_dir / "model.safetensors", 10),),
    )
    desired = DesiredState("2.0.0", sim.target.artifact_sha256, 10, "0.1.0", {})
    return recipe, sim.facts()[0], desired


def test_units_on_a_systemd_device_reload_systemd_and_restart_the_agent(tmp_path: Path) -> None:
    recipe, facts, desired = _setup(tmp_path)
    actions = recipe.actions(StepKind.WRITE_UNITS, replace(facts, systemd=True, unit_hashes={}), desired)
    assert [(a.kind, a.target) for a in actions] == [
        (ActionKind.PUT, "/etc/sits/agent.yaml"),
        (ActionKind.PUT, "/etc/systemd/system/sits-agent.service"),
        (ActionKind.CALL, "prepare-service-user"),
        (ActionKind.RUN, "systemctl daemon-reload"),
        (ActionKind.CALL, "restart-if-running"),
    ]
    assert {a.source for a in actions if a.kind is ActionKind.PUT} == {GENERATED}


def test_a_key_file_deploy_yaml_no_longer_asks_for_is_removed(tmp_path: Path) -> None:
    recipe, facts, desired = _setup(tmp_path)
    key = "/etc/sits/secrets/fallback-key"
    hashes = {path: sha256_bytes(data) for path, data in FILES.items()}
    gone = replace(desired, absent=frozenset({key}))
    actions = recipe.actions(StepKind.WRITE_UNITS, replace(facts, unit_hashes={**hashes, key: "k"}), gone)
    site = recipe.sites["dev1"]
    assert [(a.kind, a.target) for a in actions] == [
        (ActionKind.RUN, f"rm -f {site.path(key)}"),
        (ActionKind.CALL, "restart-if-running"),  # the agent must stop using what it read
    ]
    # Not on the device (anymore): nothing to do.
    assert recipe.actions(StepKind.WRITE_UNITS, replace(facts, unit_hashes=hashes), gone) == ()


def test_a_device_without_a_patch_base_gets_the_full_artifact(tmp_path: Path) -> None:
    recipe, facts, desired = _setup(tmp_path)
    fresh = replace(facts, model_sha256=None, model_version=None)
    send = recipe.actions(StepKind.SEND_ARTIFACT, fresh, desired)
    assert [a.target for a in send][1:] == [
        "/var/lib/sits/incoming/<release-counter>/artifact/model.safetensors"
    ]
    (install,) = recipe.actions(StepKind.INSTALL, fresh, desired)
    assert "--artifact" in install.target and "--patch" not in install.target
