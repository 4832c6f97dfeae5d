"""Running another CPU architecture's binaries on this host: qemu-user-static through binfmt_misc.

An arm64 lab device is an arm64 Debian tree booted by systemd-nspawn like any other; the kernel runs
its binaries through qemu because binfmt_misc maps the aarch64 ELF header to the emulator. The `F`
flag makes the kernel open the emulator when it is registered, so it also works inside chroots and
containers whose tree holds no emulator. `ensure` gets the host there: mounts binfmt_misc where it
is not, installs qemu-user-static and binfmt-support with apt when missing, enables the format.
Emulation proves correctness, not speed: Python runs about 10-20 times slower than natively.
"""

from __future__ import annotations

import platform
import shutil
import sys
from pathlib import Path

from tests.lab.proc import LabError, sh

BINFMT = Path("/proc/sys/fs/binfmt_misc")
# Lab machine names (what `uname -m` prints in a device) and Debian's names for them.
DEBIAN_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}
PACKAGES = ("qemu-user-static", "binfmt-support")
APT_TIMEOUT_S = 600


def host_arch() -> str:
    """This host's machine name (`uname -m`)."""
    return platform.machine()


def is_foreign(arch: str) -> bool:
    """Whether devices of `arch` run under emulation here."""
    return arch != host_arch()


def debian_arch(arch: str) -> str:
    """Debian's name for a lab architecture; raises LabError for one the lab has no recipe for."""
    try:
        return DEBIAN_ARCH[arch]
    except KeyError:
        known = ", ".join(sorted(DEBIAN_ARCH))
        raise LabError(f"the lab has no devices of architecture {arch!r} (it knows {known})") from None


def registered(arch: str) -> bool:
    """Whether the kernel runs `arch` binaries through qemu, also inside containers (flag F)."""
    entry = BINFMT / f"qemu-{arch}"
    try:
        lines = entry.read_text().splitlines()
    except OSError:
        return False
    flags = next((line.split()[1] for line in lines if line.startswith("flags:") and " " in line), "")
    return "enabled" in lines and "F" in flags


def ensure(arch: str) -> None:
    """Make `arch` binaries run on this host; a no-op when they already do or `arch` is the host's."""
    if not is_foreign(arch) or registered(arch):
        return
    if not (BINFMT / "register").exists():
        _say("mounting binfmt_misc")
        sh(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)])
    if not shutil.which("update-binfmts") or not Path(f"/usr/bin/qemu-{arch}-static").exists():
        _say(f"installing {' '.join(PACKAGES)} with apt-get (user-mode emulation of {arch})")
        env = ["env", "DEBIAN_FRONTEND=noninteractive"]
        sh(["apt-get", "update", "-qq"], timeout=APT_TIMEOUT_S)
        sh([*env, "apt-get", "install", "-y", "-qq", *PACKAGES], timeout=APT_TIMEOUT_S)
    if not registered(arch):
        sh(["update-binfmts", "--enable", f"qemu-{arch}"], check=False)  # "already enabled" is rc 2
    if not registered(arch):
        raise LabError(
            # Debian's qemu-user-static registers with F; an older or hand-made entry may not.
            f"{arch} binaries do not run here: {BINFMT}/qemu-{arch} is missing, disabled or lacks "
            f"flag F (see `update-binfmts --display qemu-{arch}`; reinstall qemu-user-static)"
        )


def _say(message: str) -> None:
    print(f"[lab] {message}", file=sys.stderr, flush=True)
