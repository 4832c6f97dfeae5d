"""`kill -9` during an install, at every named step and at random instants, never breaks a device.

After each kill: state.json parses, `current` names the old or the new version and every file of
it matches its release, and running the same install again finishes the job.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deployer.agent.ota.store import DeviceStore
from deployer.agent.ota.updater import INSTALL_STEPS, Updater
from deployer.core.hashing import sha256_file
from deployer.errors import ReplayError

REPO = Path(__file__).resolve().parents[3]

# Installs a patch (or, with no manifest, rolls back); SIGKILLs itself right after the step
# named in argv[4] ("" = never).
CHILD = """
import os, signal, sys
from pathlib import Path
from deployer.agent.ota.store import DeviceStore
from deployer.agent.ota.updater import Updater

root, manifest, patch, crash_at = sys.argv[1:5]

def on_step(step):
    if step == crash_at:
        os.kill(os.getpid(), signal.SIGKILL)

updater = Updater(DeviceStore(Path(root)), on_step=on_step)
print("ready", flush=True)
if manifest:
    updater.install(Path(manifest), patch=Path(patch))
else:
    updater.rollback()
print("done", flush=True)
"""


@pytest.fixture
def template(tmp_path, device, kit):
    """A device with 1.0.0 installed, the 1.1.0 patch release, and a way to clone the device."""
    Updater(device).install(kit.release("1.0.0", 1), artifact=kit.artifacts["1.0.0"])
    manifest = kit.release("1.1.0", 2, base="1.0.0")
    counter = iter(range(1_000_000))

    def clone() -> DeviceStore:
        dest = tmp_path / f"clone-{next(counter)}"
        shutil.copytree(device.root, dest, symlinks=True)
        return DeviceStore(dest)

    return clone, manifest


def _start(store: DeviceStore, manifest: Path | str, patch: Path | str, crash_at: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-c", CHILD, str(store.root), str(manifest), str(patch), crash_at]
    child = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    return child


def _check_invariants(store: DeviceStore, kit) -> str:
    """`current` is a complete, verified version; state.json parses. Returns the current version."""
    store.read_state()
    current = store.current_version()
    assert current in {"1.0.0", "1.1.0"}
    expected = kit.artifacts[current]
    for path in expected.iterdir():
        assert sha256_file(store.version_dir(current) / path.name) == sha256_file(path)
    return current


def _finish_and_check(store: DeviceStore, kit, manifest: Path) -> None:
    """Running the same install again completes it, and start-up cleaning left no debris.

    Once an install is complete (nothing in progress), the same release again is a replay.
    """
    state = store.read_state()
    if state.release_counter == 2 and state.in_progress is None and state.pending is None:
        with pytest.raises(ReplayError):
            Updater(store).install(manifest, patch=kit.patches[("1.0.0", "1.1.0")])
    else:
        Updater(store).install(manifest, patch=kit.patches[("1.0.0", "1.1.0")])
    assert store.current_version() == "1.1.0"
    assert list(store.staging_dir.iterdir()) == []
    state = store.read_state()
    assert (state.installed_version, state.release_counter) == ("1.1.0", 2)
    assert [p.name for p in store.base.iterdir() if ".tmp-" in p.name] == []


@pytest.mark.parametrize("step", INSTALL_STEPS)
def test_kill_at_each_step(template, kit, step):
    clone, manifest = template
    store = clone()
    child = _start(store, manifest, kit.patches[("1.0.0", "1.1.0")], step)
    assert child.wait(timeout=120) == -signal.SIGKILL

    current = _check_invariants(store, kit)

    switched = INSTALL_STEPS.index(step) >= INSTALL_STEPS.index("current-set")
    assert current == ("1.1.0" if switched else "1.0.0")
    _finish_and_check(store, kit, manifest)


def test_kill_at_random_instants(template, kit):
    clone, manifest = template
    patch = kit.patches[("1.0.0", "1.1.0")]
    full = clone()
    started = time.monotonic()
    child = _start(full, manifest, patch, "")
    assert child.wait(timeout=120) == 0
    span = time.monotonic() - started  # sets the range of delays only; nothing asserts on it
    rng = random.Random(20261130)
    for _ in range(10):
        store = clone()
        child = _start(store, manifest, patch, "")
        time.sleep(rng.uniform(0, span))
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=120)
        _check_invariants(store, kit)
        _finish_and_check(store, kit, manifest)


@pytest.mark.parametrize("step", ["recorded", "previous-set", "current-set", "state-written"])
def test_kill_during_rollback(template, kit, step):
    clone, manifest = template
    store = clone()
    Updater(store).install(manifest, patch=kit.patches[("1.0.0", "1.1.0")])
    child = _start(store, "", "", step)
    assert child.wait(timeout=120) == -signal.SIGKILL
    _check_invariants(store, kit)

    Updater(store).collect_garbage(keep=5)  # any next operation first finishes the journaled switch

    assert (store.current_version(), store.previous_version()) == ("1.0.0", "1.1.0")
    state = store.read_state()
    assert (state.installed_version, state.pending) == ("1.0.0", None)
    assert state.history[-1].action == "rollback"
