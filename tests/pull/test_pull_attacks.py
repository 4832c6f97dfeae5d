"""Every attack on the channel is refused, and the device keeps the version it has.

freeze (expired timestamp), replay of older metadata, files mixed from two releases (metadata and
payload), a channel signed by an unknown key.
"""

from __future__ import annotations

import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from deployer.errors import ExpiredError, HashMismatchError, ReplayError, SignatureError, SitsError
from tests.pull.direct import DirectMirror
from tests.pull.project import Project, make_device, make_project


@pytest.fixture
def on_v1(tmp_path: Path, project: Project, mirror: DirectMirror):
    """A device that pulled 1.0.0 from the stable channel."""
    project.publish(mirror.root, "1.0.0")
    device = make_device(tmp_path / "d1", project, f"{mirror.url}/stable/")
    assert device.poll().result == "updated"
    return device


def _refused(device, error: type[SitsError]) -> str:
    with pytest.raises(error) as info:
        device.poll(force=True)
    assert device.store.current_version() == "1.0.0"
    state = device.read_state()
    assert state.result == "failed" and state.failures >= 1 and state.retry_after
    return info.value.message


def test_expired_timestamp_is_refused(on_v1, project: Project, mirror: DirectMirror) -> None:
    project.publish(mirror.root, "2.0.0", now=datetime.now(UTC) - timedelta(days=2))
    assert "expired" in _refused(on_v1, ExpiredError)


def test_older_metadata_replayed_is_refused(on_v1, project: Project, mirror: DirectMirror) -> None:
    timestamp = mirror.root / "stable/metadata/timestamp.json"
    old = timestamp.read_bytes()
    project.publish(mirror.root, "2.0.0")
    assert on_v1.poll().result == "updated"
    timestamp.write_bytes(old)  # a mirror serving the channel as it was
    with pytest.raises(ReplayError):
        on_v1.poll(force=True)
    assert on_v1.store.current_version() == "2.0.0"


def test_targets_of_another_release_are_refused(on_v1, project: Project, mirror: DirectMirror) -> None:
    second = project.publish(mirror.root, "2.0.0")
    meta = mirror.root / "stable/metadata"
    shutil.copyfile(meta / "1.targets.json", meta / f"{second.targets_version}.targets.json")
    _refused(on_v1, ReplayError)


def test_payload_from_another_release_is_refused(
    tmp_path: Path, project: Project, mirror: DirectMirror
) -> None:
    project.publish(mirror.root, "1.0.0")
    artifact = mirror.root / "stable/targets/full/artifact"
    weights_v1 = {p.stat().st_size: p.read_bytes() for p in artifact.iterdir()}
    project.publish(mirror.root, "2.0.0")
    swapped = 0
    for path in artifact.iterdir():
        if path.name.endswith("model.safetensors") and path.read_bytes() not in weights_v1.values():
            path.write_bytes(weights_v1[path.stat().st_size])  # v1's weights under v2's name
            swapped += 1
    assert swapped == 1
    device = make_device(tmp_path / "fresh", project, f"{mirror.url}/stable/")
    with pytest.raises(HashMismatchError):
        device.poll()
    assert device.store.current_version() is None


def test_channel_signed_by_unknown_key_is_refused(
    on_v1, tmp_path: Path, sources: dict[str, Path], built_store: Path, mirror: DirectMirror
) -> None:
    intruder = make_project(tmp_path / "intruder", sources, built_store)
    intruder.publish(mirror.root, "2.0.0")
    assert "not signed by the keys this device trusts" in _refused(on_v1, SignatureError)


def test_a_rejected_download_is_discarded_and_the_next_poll_recovers(
    tmp_path: Path, project: Project, mirror: DirectMirror
) -> None:
    # A mirror serves tampered weights once: the rejected file must not be kept and resumed
    # (it would fail every later poll until a new release changed its hash).
    project.publish(mirror.root, "1.0.0")
    weights = next(
        p for p in (mirror.root / "stable/targets/full/artifact").iterdir() if "safetensors" in p.name
    )
    good = weights.read_bytes()
    weights.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))
    device = make_device(tmp_path / "d", project, f"{mirror.url}/stable/")
    with pytest.raises(HashMismatchError):
        device.poll()
    assert [p.name for p in (tmp_path / "d").rglob("*") if p.is_file() and "safetensors" in p.name] == []
    weights.write_bytes(good)
    assert device.poll(force=True).result == "updated"
    assert device.store.current_version() == "1.0.0"
