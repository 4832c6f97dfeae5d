"""A full disk refuses the update clearly and leaves the installed version intact (a 2 MiB tmpfs)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from deployer.agent.ota.store import DeviceStore
from deployer.agent.ota.updater import Updater
from deployer.core.hashing import sha256_file
from deployer.errors import AgentError

PAGE = 4096


@pytest.fixture
def small_device(tmp_path, kit):
    """A device root on a fresh 2 MiB tmpfs (needs root; skipped elsewhere), 1.0.0 installed."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True
        ).returncode
    ):
        pytest.skip("mounting a tmpfs needs root")
    try:
        store = DeviceStore(mount / "device")
        store.ensure_layout()
        shutil.copyfile(kit.public_key, store.keys_dir / "release.pub")
        Updater(store).install(kit.release("1.0.0", 1), artifact=kit.artifacts["1.0.0"])
        yield store
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _fill(store: DeviceStore, leave: int) -> None:
    """Write a filler file so that about `leave` bytes stay free."""
    free = shutil.disk_usage(store.root).free
    with (store.root / "filler").open("wb") as f:
        f.write(b"\0" * (free - leave))


def _artifact_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir())


def _assert_old_version_intact(store: DeviceStore, kit) -> None:
    assert store.current_version() == "1.0.0"
    assert store.installed_versions() == ["1.0.0"]
    assert list(store.staging_dir.iterdir()) == []
    for path in kit.artifacts["1.0.0"].iterdir():
        assert sha256_file(store.version_dir("1.0.0") / path.name) == sha256_file(path)
    assert store.read_state().installed_version == "1.0.0"


def test_too_little_space_is_refused_before_writing(small_device, kit):
    _fill(small_device, leave=8 * PAGE)
    with pytest.raises(AgentError, match=r"not enough disk space for 1\.1\.0") as caught:
        Updater(small_device).install(kit.release("1.1.0", 2), artifact=kit.artifacts["1.1.0"])
    assert "sits-agent gc" in (caught.value.hint or "")
    _assert_old_version_intact(small_device, kit)


def test_disk_filling_up_mid_copy_is_a_clear_error(small_device, kit):
    # Exactly the bytes the files need are free: the size check passes, but block rounding
    # makes the copy run out of space part way.
    needed = _artifact_bytes(kit.artifacts["1.1.0"])
    _fill(small_device, leave=-(-needed // PAGE) * PAGE)
    with pytest.raises(AgentError, match=r"disk full while staging 1\.1\.0"):
        Updater(small_device).install(kit.release("1.1.0", 2), artifact=kit.artifacts["1.1.0"])
    _assert_old_version_intact(small_device, kit)
