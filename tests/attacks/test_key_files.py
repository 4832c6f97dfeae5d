"""The device's trust policy files (`etc/sits/keys/*.pub` and `threshold`) replaced by something
that is no file: a named pipe with no writer would block `sits-agent install` forever while it
holds the store lock, a device file would be read without end. Each is refused by name, at once;
so is a named pipe handed over as the patch itself.

A named pipe is opened only by `sits-agent` running as a process, under a deadline: a hang is a
failure, not a stuck suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deployer.core.verify import MAX_KEY_BYTES, read_key_file
from deployer.errors import KeyFileError
from tests.attacks.conftest import snapshot

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 120  # the CLI imports and verifies a tiny artifact in a few seconds


def _install(device, kit) -> subprocess.CompletedProcess[str]:
    args = ["install", "--root", str(device.root), "--config", str(device.root / "none.yaml")]
    args += ["--manifest", str(kit.release("1.0.0", 1)), "--artifact", str(kit.artifacts["1.0.0"])]
    return subprocess.run(
        [sys.executable, "-m", "deployer.agent.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=DEADLINE_S,
    )


def test_a_named_pipe_as_a_trusted_key_is_skipped_by_name(device, kit):
    os.mkfifo(device.keys_dir / "stray.pub")
    done = _install(device, kit)
    assert done.returncode == 0, done.stderr
    assert device.current_version() == "1.0.0"  # the real key still verifies the release
    assert "stray.pub: cannot read the key: not a regular file (it is a named pipe)" in done.stderr


def test_a_named_pipe_as_the_threshold_refuses_the_install_by_name(device, kit):
    os.mkfifo(device.keys_dir / "threshold")
    before = snapshot(device.root)
    done = _install(device, kit)
    assert done.returncode == 1
    assert f"{device.keys_dir / 'threshold'}: cannot read the signature threshold: not a regular file" in (
        done.stderr
    )
    assert snapshot(device.root) == before


def test_key_files_must_be_small_regular_files(tmp_path, kit):
    with pytest.raises(KeyFileError, match="/dev/zero: cannot read the key: not a regular file"):
        read_key_file(Path("/dev/zero"))
    huge = tmp_path / "huge.pub"
    huge.write_bytes(b"-" * (MAX_KEY_BYTES + 1))
    with pytest.raises(KeyFileError, match=f"{huge}: cannot read the key: larger than {MAX_KEY_BYTES}"):
        read_key_file(huge)
    link = tmp_path / "link.pub"
    link.symlink_to(kit.public_key)  # a key installed as a link to a regular file is still a key
    assert read_key_file(link) == kit.public_key.read_bytes()


def test_a_named_pipe_as_the_patch_is_refused_at_once(tmp_path):
    fifo = tmp_path / "update.sitspatch"
    os.mkfifo(fifo)
    probe = (
        "import sys; from pathlib import Path; from deployer.core.patch_apply import open_patch\n"
        "try:\n    open_patch(Path(sys.argv[1])).__enter__()\nexcept Exception as exc: print(exc)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(fifo)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=DEADLINE_S,
    )
    assert done.stdout.strip() == f"{fifo}: the patch is not a regular file", done.stderr
