"""Keys per TUF role: root and targets offline, timestamp and snapshot online, and each role's
signatures checked against its own keys on the device."""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from deployer.errors import ConfigError, KeyFileError, SignatureError
from deployer.pull.role_keys import ROLES
from tests.pull import forge
from tests.pull.direct import DirectMirror
from tests.pull.project import Project, make_device


@pytest.fixture
def separate(project: Project) -> Project:
    """The project with a 2-of-2 root, its own targets key, and one online key for snapshot and timestamp."""
    project.publish_extra = {
        "roles": {
            "root": {"keys": [project.keygen("root-1"), project.keygen("root-2")], "threshold": 2},
            "targets": {"keys": [project.keygen("targets")]},
            "snapshot": {"keys": [project.keygen("online")]},
            "timestamp": {"keys": ["keys/online.pub"]},
        }
    }
    return project


def _offline(project: Project, *names: str) -> Path:
    """Move these private keys away from the project (as an offline store would keep them)."""
    vault = project.dir.parent / "vault"
    vault.mkdir(exist_ok=True)
    for name in names:
        shutil.move(project.dir / f"keys/{name}.key", vault / f"{name}.key")
    return vault


def _keyid(project: Project, name: str) -> str:
    return forge.signer(project.dir / f"keys/{name}.key").public_key.keyid


def test_threshold_must_be_met_by_the_role_keys(project: Project) -> None:
    project.publish_extra = {"roles": {"root": {"keys": ["keys/a.pub"], "threshold": 2}}}
    project.write("1.0.0")
    with pytest.raises(ConfigError) as info:
        project.config()
    problems = {f.path: f.message for f in info.value.findings}
    assert "threshold 2 cannot be met by 1 key(s)" in problems["publish.roles.root"]


def test_roles_have_their_own_keys_and_offline_ones_are_read_only_to_sign(
    tmp_path: Path, separate: Project, mirror: DirectMirror
) -> None:
    separate.publish(mirror.root, "1.0.0")
    root = json.loads(separate.root_metadata().read_bytes())["signed"]
    listed = {role: (set(r["keyids"]), r["threshold"]) for role, r in root["roles"].items()}
    assert listed == {
        "root": ({_keyid(separate, "root-1"), _keyid(separate, "root-2")}, 2),
        "targets": ({_keyid(separate, "targets")}, 1),
        "snapshot": ({_keyid(separate, "online")}, 1),
        "timestamp": ({_keyid(separate, "online")}, 1),
    }
    assert _keyid(separate, "release") not in root["keys"]  # the release key signs releases only
    device = make_device(tmp_path / "d1", separate, f"{mirror.url}/stable/")
    assert device.poll().result == "updated"

    vault = _offline(separate, "root-1", "root-2", "targets")
    again = separate.publish(mirror.root, "1.0.0")  # the routine re-sign: online keys only
    assert not again.changed and again.timestamp_version == 2 and again.warnings == ()
    with pytest.raises(KeyFileError) as info:
        separate.publish(mirror.root, "2.0.0")
    assert "targets" in info.value.message and "targets.key" in info.value.message

    shutil.copy(vault / "targets.key", separate.dir / "keys/targets.key")  # brought online to release
    assert separate.publish(mirror.root, "2.0.0").changed
    assert device.poll().result == "updated" and device.store.current_version() == "2.0.0"


@pytest.mark.parametrize("forgery", ["timestamp by the targets key", "targets by the online key"])
def test_metadata_signed_by_another_roles_key_is_refused(
    tmp_path: Path, separate: Project, mirror: DirectMirror, forgery: str
) -> None:
    separate.publish(mirror.root, "1.0.0")
    device = make_device(tmp_path / "d1", separate, f"{mirror.url}/stable/")
    assert device.poll().result == "updated"
    channel = mirror.root / "stable"
    online = forge.signer(separate.dir / "keys/online.key")
    if forgery == "timestamp by the targets key":
        forge.timestamp(channel, forge.signer(separate.dir / "keys/targets.key"))
    else:
        forge.targets(channel, online, online)
    with pytest.raises(SignatureError):
        device.poll(force=True)
    assert device.store.current_version() == "1.0.0"


def test_renewal_without_offline_keys_warns_and_keeps_the_timestamp_fresh(
    separate: Project, mirror: DirectMirror
) -> None:
    now = datetime.now(UTC)
    separate.publish(mirror.root, "1.0.0", now=now)
    _offline(separate, "root-1", "root-2", "targets")
    later = separate.publish(mirror.root, "1.0.0", now=now + timedelta(days=340))
    assert later.timestamp_version == 2 and later.root_version == 1 and later.root_change is None
    assert [w.split(" ", 1)[0] for w in later.warnings] == ["root", "targets"]
    assert "not renewed" in later.warnings[0]


def _root_version(device) -> int:
    return json.loads((device.metadata_dir / "root.json").read_bytes())["signed"]["version"]


def test_new_role_keys_rotate_the_root_and_devices_follow_it(
    tmp_path: Path, project: Project, mirror: DirectMirror
) -> None:
    project.publish(mirror.root, "1.0.0")  # default: the release key for every role
    device = make_device(tmp_path / "d1", project, f"{mirror.url}/stable/")
    assert device.poll().result == "updated"

    new = project.keygen("new")
    project.publish_extra = {"roles": {role: {"keys": [new]} for role in ROLES}}
    rotated = project.publish(mirror.root, "2.0.0")
    assert (rotated.root_change, rotated.root_version) == ("rotated", 2)
    signed = json.loads((rotated.local_dir / "metadata/2.root.json").read_bytes())
    assert {s["keyid"] for s in signed["signatures"]} == {_keyid(project, "release"), _keyid(project, "new")}
    assert all(r["keyids"] == [_keyid(project, "new")] for r in signed["signed"]["roles"].values())

    assert device.poll().result == "updated" and device.store.current_version() == "2.0.0"
    assert _root_version(device) == 2
    fresh = make_device(tmp_path / "fresh", project, f"{mirror.url}/stable/")  # still anchored at 1.root.json
    assert fresh.poll().result == "updated" and _root_version(fresh) == 2

    # The old key still signs releases, but the channel's metadata no longer: refused.
    forge.timestamp(mirror.root / "stable", forge.signer(project.dir / "keys/release.key"))
    with pytest.raises(SignatureError):
        device.poll(force=True)
    assert device.store.current_version() == "2.0.0"


def test_next_root_signed_by_the_new_keys_only_is_refused(
    tmp_path: Path, project: Project, mirror: DirectMirror
) -> None:
    project.publish(mirror.root, "1.0.0")
    device = make_device(tmp_path / "d1", project, f"{mirror.url}/stable/")
    assert device.poll().result == "updated"
    project.keygen("intruder")
    intruder = forge.signer(project.dir / "keys/intruder.key")
    assert forge.next_root(mirror.root / "stable", intruder, intruder) == 2
    with pytest.raises(SignatureError):
        device.poll(force=True)
    assert _root_version(device) == 1


def test_rotation_needs_the_old_root_keys(project: Project, mirror: DirectMirror) -> None:
    project.publish_extra = {"roles": {"root": {"keys": [project.keygen("root-a")]}}}
    project.publish(mirror.root, "1.0.0")
    vault = _offline(project, "root-a")
    project.publish_extra = {"roles": {"root": {"keys": [project.keygen("root-b")]}}}
    with pytest.raises(KeyFileError) as info:
        project.publish(mirror.root, "1.0.0")
    assert "old root" in info.value.message and "--old-root-key" in (info.value.hint or "")
    done = project.publish(mirror.root, "1.0.0", old_root_keys=(vault / "root-a.key",))
    assert (done.root_change, done.root_version) == ("rotated", 2)
