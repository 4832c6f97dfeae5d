"""Devices polling a channel move to new releases by themselves: full artifact first, then a patch
(over nginx: real HTTP, and what each poll costs on the wire), and back by a new release."""

from __future__ import annotations

from pathlib import Path

from tests.pull.direct import DirectMirror
from tests.pull.nginx import Nginx
from tests.pull.project import Project, make_device


def test_device_installs_full_then_patch_then_stays(tmp_path: Path, project: Project, nginx: Nginx) -> None:
    first = project.publish(nginx.root, "1.0.0")
    device = make_device(tmp_path / "d1", project, f"{nginx.url}/stable/")

    outcome = device.poll()
    assert (outcome.result, outcome.payload, outcome.channel_version) == ("updated", "full", "1.0.0")
    assert device.store.current_version() == "1.0.0"
    assert device.store.read_state().artifact_sha256 == first.artifact_sha256

    second = project.publish(nginx.root, "2.0.0")
    assert second.patch_bases == ("1.0.0",) and second.counter > first.counter
    outcome = device.poll()
    assert (outcome.result, outcome.payload) == ("updated", "patch")
    assert device.store.current_version() == "2.0.0"
    assert device.store.previous_version() == "1.0.0"
    artifact_bytes = sum(
        f.size for f in device.store.read_state().versions["2.0.0"].release.artifact.files.values()
    )
    assert outcome.bytes_downloaded < artifact_bytes  # the patch, not the whole artifact

    nginx.clear_log()
    outcome = device.poll()
    assert outcome.result == "up-to-date"
    served = nginx.requests()
    # An unchanged channel: TUF's check for a next root (a 404) and the small timestamp, nothing else.
    assert [(path.rsplit("/", 1)[-1], status) for path, status, _ in served] == [
        ("2.root.json", 404),
        ("timestamp.json", 200),
    ]
    assert sum(size for _, _, size in served) < 2048


def test_republish_reuses_the_release_and_rollback_is_a_new_one(
    tmp_path: Path, project: Project, mirror: DirectMirror
) -> None:
    first = project.publish(mirror.root, "1.0.0")
    again = project.publish(mirror.root, "1.0.0")
    assert (again.changed, again.counter, again.targets_version) == (False, first.counter, 1)
    assert again.timestamp_version == first.timestamp_version + 1  # only the timestamp re-signed

    device = make_device(tmp_path / "d1", project, f"{mirror.url}/stable/")
    device.poll()
    second = project.publish(mirror.root, "2.0.0")
    device.poll()
    back = project.publish(mirror.root, "1.0.0")  # a fleet rollback: the old artifact, a new counter
    assert back.artifact_sha256 == first.artifact_sha256 and back.counter > second.counter
    outcome = device.poll()
    assert outcome.result == "updated" and device.store.current_version() == "1.0.0"
    assert device.store.read_state().release_counter >= back.counter  # its patch release's counter
