"""The lab's template root filesystem: one debootstrapped Debian, cached and shared read-only.

Every device is an overlay on this tree, so it must not change while a lab runs. It is rebuilt only
when missing or when the recipe below changes (the stamp file holds the recipe's hash), into a
temporary directory that is renamed into place only once complete: a half-built tree is never used.
There is one tree per device architecture: the host's in `rootfs-base`, another one (arm64 under
qemu emulation, see emulation.py) in `rootfs-base-<debian arch>`, debootstrapped in one go since
binfmt_misc runs its second stage's arm64 binaries (about 10 times longer than the host's tree).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from tests.lab import emulation
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
FOREIGN_BUILD_TIMEOUT_S = 3600  # the second stage runs every postinst under qemu
# No Python packages beyond Debian's: the agent's runtime reaches a device only the way it reaches
# a real one, through bootstrap's wheelhouse (devices have no network beyond the lab, so no index).
# Not "rootfs-agent", the tree of the older recipe with a preinstalled runtime: checkouts of either
# recipe keep their own tree instead of rebuilding each other's.
ROOTFS_DIR = "rootfs-base"


def recipe_hash(arch: str | None = None) -> str:
    """Hash of everything that shapes the tree of `arch` (default: the host's); a different hash
    means the cache is stale."""
    recipe: dict[str, object] = {
        "suite": SUITE,
        "packages": PACKAGES,
        "masked": MASKED_UNITS,
        "sshd": SSHD_CONFIG,
        "v": 3,
    }
    if arch is not None and emulation.is_foreign(arch):  # the host's tree keeps its hash (and cache)
        recipe["arch"] = emulation.debian_arch(arch)
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def rootfs_path(cache: Path = CACHE, arch: str | None = None) -> Path:
    """Where the template tree of `arch` (default: the host's) lives."""
    if arch is None or not emulation.is_foreign(arch):
        return cache / ROOTFS_DIR
    return cache / f"{ROOTFS_DIR}-{emulation.debian_arch(arch)}"


def is_current(cache: Path = CACHE, arch: str | None = None) -> bool:
    """True when the cached tree exists and was built from the current recipe."""
    stamp = rootfs_path(cache, arch) / STAMP
    try:
        return json.loads(stamp.read_text())["recipe"] == recipe_hash(arch)
    except (OSError, ValueError, KeyError):
        return False


def ensure_rootfs(cache: Path = CACHE, *, arch: str | None = None, log: bool = True) -> Path:
    """Return the template tree of `arch` (default: the host's), building it first when missing or
    stale: about 2 minutes for the host's, 15-25 under emulation (which this sets up first)."""
    foreign = arch if arch is not None and emulation.is_foreign(arch) else None
    if foreign:
        emulation.ensure(foreign)  # also for a cached tree: its devices run under qemu
    final = rootfs_path(cache, arch)
    if is_current(cache, arch):
        return final
    if not shutil.which("debootstrap"):
        raise LabError("debootstrap is not installed: apt-get install debootstrap systemd-container")
    cache.mkdir(parents=True, exist_ok=True)
    staging = final.with_name(f"{final.name}.building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    if log and foreign:
        print(
            f"[lab] building the {foreign} template rootfs under qemu emulation into {final} "
            "(once, then cached: 15-25 minutes on 2 cores)",
            file=sys.stderr,
            flush=True,
        )
    started = time.monotonic()
    try:
        _debootstrap(staging, emulation.debian_arch(foreign) if foreign else None)
        _prepare(staging, foreign)
        _replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if log:
        print(f"[lab] built {final} in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return final


def _debootstrap(dest: Path, foreign_arch: str | None) -> None:
    # No mirror argument: debootstrap's default is the same Debian registry apt uses.
    argv = ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}"]
    if foreign_arch:
        argv.append(f"--arch={foreign_arch}")
    sh([*argv, SUITE, str(dest)], timeout=FOREIGN_BUILD_TIMEOUT_S if foreign_arch else BUILD_TIMEOUT_S)


def _prepare(root: Path, arch: str | None) -> None:
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
    (root / STAMP).write_text(json.dumps({"recipe": recipe_hash(arch), "suite": SUITE}) + "\n")


def _replace(staging: Path, final: Path) -> None:
    """Swap the new tree in; the old one (if any) is moved aside first, then deleted."""
    old = final.with_name(f"{final.name}.old-{os.getpid()}")
    if final.exists():
        final.rename(old)
    staging.rename(final)
    shutil.rmtree(old, ignore_errors=True)
