"""The lab's template root filesystem: one debootstrapped Debian, cached and shared read-only.

Every device is an overlay on this tree, so it must not change while a lab runs. It is rebuilt only
when missing or when the recipe below changes (the stamp file holds the recipe's hash), into a
temporary directory that is renamed into place only once complete: a half-built tree is never used.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from tests.lab.proc import LabError, sh

CACHE = Path(os.environ.get("SITS_LAB_CACHE", Path.home() / ".cache/sits-deployer/lab"))
SUITE = "bookworm"
PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "openssh-server",
    "python3",
    "python3-venv",
    # llama-cpp-python has no wheel on PyPI: the controller builds one (deployer/push/wheelhouse.py),
    # which links the system's OpenMP runtime, as a device's OS must then provide.
    "libgomp1",
    "iproute2",
    "procps",
    "ca-certificates",
)
# Units that only cost memory and wake-ups in a lab device.
MASKED_UNITS = (
    "console-getty.service",
    "getty@tty1.service",
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "e2scrub_all.timer",
    "e2scrub_reap.service",
    "fstrim.timer",
)
SSHD_CONFIG = "HostKey /etc/ssh/ssh_host_ed25519_key\nPasswordAuthentication no\nUseDNS no\n"
STAMP = "sits-lab-rootfs.json"
BUILD_TIMEOUT_S = 900
# No Python packages beyond Debian's: the agent's runtime reaches a device only the way it reaches
# a real one, through bootstrap's wheelhouse (devices have no network beyond the lab, so no index).
# Not "rootfs-agent", the tree of the older recipe with a preinstalled runtime: checkouts of either
# recipe keep their own tree instead of rebuilding each other's.
ROOTFS_DIR = "rootfs-base"


def recipe_hash() -> str:
    """Hash of everything that shapes the tree; a different hash means the cache is stale."""
    recipe = {
        "suite": SUITE,
        "packages": PACKAGES,
        "masked": MASKED_UNITS,
        "sshd": SSHD_CONFIG,
        "v": 3,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def rootfs_path(cache: Path = CACHE) -> Path:
    """Where the template tree lives."""
    return cache / ROOTFS_DIR


def is_current(cache: Path = CACHE) -> bool:
    """True when the cached tree exists and was built from the current recipe."""
    stamp = rootfs_path(cache) / STAMP
    try:
        return json.loads(stamp.read_text())["recipe"] == recipe_hash()
    except (OSError, ValueError, KeyError):
        return False


def ensure_rootfs(cache: Path = CACHE, *, log: bool = True) -> Path:
    """Return the template tree, building it first when missing or stale (about 2 minutes)."""
    final = rootfs_path(cache)
    if is_current(cache):
        return final
    if not shutil.which("debootstrap"):
        raise LabError("debootstrap is not installed: apt-get install debootstrap systemd-container")
    cache.mkdir(parents=True, exist_ok=True)
    staging = cache / f"{ROOTFS_DIR}.building-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    started = time.monotonic()
    try:
        _debootstrap(staging)
        _prepare(staging)
        _replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if log:
        print(f"[lab] built {final} in {time.monotonic() - started:.0f} s")
    return final


def _debootstrap(dest: Path) -> None:
    # No mirror argument: debootstrap's default is the same Debian registry apt uses.
    sh(
        ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(dest)],
        timeout=BUILD_TIMEOUT_S,
    )


def _prepare(root: Path) -> None:
    """Make the tree a template: no host keys or identity of its own, sshd keys-only, quiet units."""
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    (root / "etc/hostname").unlink(missing_ok=True)
    (root / "etc/machine-id").write_text("")
    (root / "etc/ssh/sshd_config.d/lab.conf").write_text(SSHD_CONFIG)
    masks = root / "etc/systemd/system"
    for unit in MASKED_UNITS:
        link = masks / unit
        link.unlink(missing_ok=True)
        link.symlink_to("/dev/null")
    (root / STAMP).write_text(json.dumps({"recipe": recipe_hash(), "suite": SUITE}) + "\n")


def _replace(staging: Path, final: Path) -> None:
    """Swap the new tree in; the old one (if any) is moved aside first, then deleted."""
    old = final.with_name(f"{ROOTFS_DIR}.old-{os.getpid()}")
    if final.exists():
        final.rename(old)
    staging.rename(final)
    shutil.rmtree(old, ignore_errors=True)
