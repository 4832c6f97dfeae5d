"""The lab's template root filesystem: one debootstrapped Debian, cached and shared read-only.

Every device is an overlay on this tree, so it must not change while a lab runs. It is rebuilt only
when missing or when the recipe below changes (the stamp file holds the recipe's hash), into a
temporary directory that is renamed into place only once complete: a half-built tree is never used.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import sys
import tempfile
import time
import tomllib
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
PROJECT = Path(__file__).resolve().parents[2]
# The agent's runtime, preinstalled so that bootstrap's pip finds every dependency satisfied and
# needs no index on the device (devices have no network beyond the lab): our own wheel, sent by
# bootstrap, is then the only thing pip installs there.
RUNTIME_VENV = "/opt/sits/venv"
# Not "rootfs" (the tree without the runtime): a checkout with the older recipe would rebuild that
# one under a lab of this recipe, and the other way round.
ROOTFS_DIR = "rootfs-agent"


def runtime_requirements() -> tuple[str, ...]:
    """Our runtime dependencies (pyproject.toml), each pinned to the version the host has installed."""
    deps = tomllib.loads((PROJECT / "pyproject.toml").read_text())["project"]["dependencies"]
    pinned = []
    for dep in deps:
        name = re.match(r"[A-Za-z0-9_.-]+", dep).group(0)
        try:
            pinned.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pinned.append(dep)
    return tuple(sorted(pinned))


def recipe_hash() -> str:
    """Hash of everything that shapes the tree; a different hash means the cache is stale."""
    recipe = {
        "suite": SUITE,
        "packages": PACKAGES,
        "masked": MASKED_UNITS,
        "sshd": SSHD_CONFIG,
        "runtime": runtime_requirements(),
        "venv": RUNTIME_VENV,
        "v": 2,
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
        _install_runtime(staging)
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


def _host_pins() -> list[str]:
    pins = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name and name.lower().replace("_", "-") != "sits-deployer":
            pins[name.lower()] = f"{name}=={dist.version}"
    return sorted(pins.values())


def _install_runtime(root: Path) -> None:
    """A venv at RUNTIME_VENV with our runtime dependencies, from wheels the host builds or has cached.

    The host's pip (its config: /opt/wheels for torch, then its cache and index) fetches or builds
    every wheel into a temporary directory; inside the tree, pip installs only from there
    (--no-index), so nothing on the device side touches a network.
    """
    requirements = runtime_requirements()
    with tempfile.TemporaryDirectory(prefix="wheels-", dir=root / "tmp") as tmp:
        wheels = Path(tmp)
        (wheels / "requirements.txt").write_text("\n".join(requirements) + "\n")
        # Their dependencies too at the host's versions (found in its cache, and known to work).
        (wheels / "constraints.txt").write_text("\n".join(_host_pins()) + "\n")
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
        sh(
            [
                *pip,
                "wheel",
                "--quiet",
                "-w",
                str(wheels),
                "-r",
                str(wheels / "requirements.txt"),
                "-c",
                str(wheels / "constraints.txt"),
            ],
            timeout=BUILD_TIMEOUT_S,
        )
        inside = "/" + str(wheels.relative_to(root))
        sh(["chroot", str(root), "python3", "-m", "venv", RUNTIME_VENV], timeout=300)
        sh(
            [
                "chroot",
                str(root),
                f"{RUNTIME_VENV}/bin/pip",
                "install",
                "--quiet",
                "--no-index",
                "--disable-pip-version-check",
                "--no-cache-dir",
                "--find-links",
                inside,
                "-r",
                f"{inside}/requirements.txt",
            ],
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
