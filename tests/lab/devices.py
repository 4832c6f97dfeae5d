"""One lab device: a booted systemd-nspawn container on an overlay of the template, in its own netns.

Lifecycle: `prepare` (overlay mount, first-boot identity, authorized key, network) -> `start`
(own cgroup, nspawn under a small shell supervisor that restarts it after an in-device reboot)
-> `wait_running` -> `stop` (clean poweroff, hard kill as a fallback) -> `release` (cgroups,
mount, namespace). Each step tolerates a half-done previous run, so teardown can always run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.lab import emulation, netns
from tests.lab.proc import LabError, children, comm, pid_alive, sh

CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_GROUP = "sllab"
PROPAGATE_DIR = Path("/run/systemd/nspawn/propagate")
STOP_TIMEOUT_S = 20
# Two things break under qemu user-mode emulation, so every service of an emulated device gets a
# drop-in. systemd cannot set up a unit's credentials ("Failed to set up credentials: Invalid
# argument", 243/CREDENTIALS): the units naming LoadCredential= (systemd-sysusers, -tmpfiles-setup,
# -sysctl) fail and the device boots degraded; the lab passes none, and an empty value resets them.
# And torch's cpuinfo reads the host's x86-64 CPU topology under /sys/devices/system/cpu and
# segfaults (qemu: uncaught target signal 11) on `import torch`; with an empty tmpfs there it only
# warns, as in a chroot without /sys. sshd is a service too, so commands over SSH see the same.
EMULATED_DROP_IN = (
    "etc/systemd/system/service.d/sits-lab-emulated.conf",
    "[Service]\nLoadCredential=\nTemporaryFileSystem=/sys/devices/system/cpu:ro\n",
)
# A command prefix for Lab.nsenter that runs a command as a transient service, with that drop-in.
AS_SERVICE = ("systemd-run", "--wait", "--pipe", "-q")
# Restarts nspawn while it exits 133 (`systemctl reboot` inside) and forwards SIGTERM to it, which
# nspawn turns into a clean poweroff of the container.
SUPERVISOR = r"""
for h in $SITS_LAB_CGROUPS; do echo $$ > "$h/cgroup.procs"; done
stop=0; child=
trap 'stop=1; [ -n "$child" ] && kill -TERM "$child" 2>/dev/null' TERM INT
while :; do
  systemd-nspawn "$@" & child=$!
  while :; do wait "$child"; rc=$?; kill -0 "$child" 2>/dev/null || break; done
  [ "$stop" = 0 ] && [ "$rc" = 133 ] || exit "$rc"
done
"""


@dataclass(frozen=True)
class Device:
    """Names and places of one lab device."""

    index: int
    workdir: Path
    arch: str = "x86_64"  # what `uname -m` prints inside; another than the host's runs under qemu

    @property
    def name(self) -> str:
        return f"dev{self.index}"

    @property
    def address(self) -> str:
        return netns.device_address(self.index)

    @property
    def netns(self) -> str:
        return f"sld{self.index}"

    @property
    def veth(self) -> str:
        return f"slh{self.index}"

    @property
    def dir(self) -> Path:
        return self.workdir / self.name

    @property
    def root(self) -> Path:
        """The device's root filesystem as seen from the host (the overlay mount point)."""
        return self.dir / "root"

    @property
    def pid_file(self) -> Path:
        return self.dir / "supervisor.pid"


def cgroup_hierarchies() -> list[Path]:
    """The hierarchies a container needs its own directory in: v1 name=systemd + unified, or pure v2."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return [CGROUP_ROOT]
    return [CGROUP_ROOT / "systemd", CGROUP_ROOT / "unified"]


def prepare(device: Device, rootfs: Path, client_pub: Path) -> str:
    """Mount the overlay, give the device its identity and our key, wire its network.

    Returns the device's known_hosts line. Identity (machine-id, hostname, host key) is made on
    first boot only, so a restarted device keeps its host key.
    """
    for sub in ("upper", "work", "root"):
        (device.dir / sub).mkdir(parents=True, exist_ok=True)
    if not is_mounted(device.root):
        options = f"lowerdir={rootfs},upperdir={device.dir / 'upper'},workdir={device.dir / 'work'}"
        sh(["mount", "-t", "overlay", "overlay", "-o", options, str(device.root)])
    host_key = device.root / "etc/ssh/ssh_host_ed25519_key"
    if not host_key.exists():
        (device.root / "etc/machine-id").write_text(sh(["systemd-id128", "new"]))
        (device.root / "etc/hostname").write_text(device.name + "\n")
        sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", device.name, "-f", str(host_key)])
    if emulation.is_foreign(device.arch):
        drop_in = device.root / EMULATED_DROP_IN[0]
        drop_in.parent.mkdir(parents=True, exist_ok=True)
        drop_in.write_text(EMULATED_DROP_IN[1])
    ssh_dir = device.root / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    authorized = ssh_dir / "authorized_keys"
    authorized.write_text(client_pub.read_text())
    authorized.chmod(0o600)
    netns.create_device_net(device.netns, device.veth, device.address)
    key_type, key_b64 = host_key.with_suffix(".pub").read_text().split()[:2]
    return f"{device.address} {key_type} {key_b64}\n"


def start(device: Device) -> int:
    """Boot the device in the background; returns the supervisor's pid (also in its pid file)."""
    netns.require_guard()
    if running_pid(device):
        raise LabError(f"{device.name} is already running (pid {running_pid(device)})")
    cgroups = [h / CGROUP_GROUP / device.name for h in cgroup_hierarchies()]
    for group in cgroups:
        group.mkdir(parents=True, exist_ok=True)
    args = [
        *("-q", "-D", str(device.root), "-M", device.name, "-b", "--register=no", "--keep-unit"),
        f"--network-namespace-path={netns.NETNS_DIR / device.netns}",
        "--console=read-only",
    ]
    env = {**os.environ, "SITS_LAB_CGROUPS": " ".join(map(str, cgroups))}
    with (device.dir / "console.log").open("ab") as log:
        proc = subprocess.Popen(
            ["sh", "-c", SUPERVISOR, "sh", *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # Ctrl-C on the test run reaches the fixture's teardown, not nspawn
        )
    device.pid_file.write_text(f"{proc.pid}\n")
    return proc.pid


def running_pid(device: Device) -> int | None:
    """The supervisor's pid while it runs, else None (zombies count as gone and are reaped)."""
    try:
        pid = int(device.pid_file.read_text())
    except (OSError, ValueError):
        return None
    _reap(pid)
    return pid if pid_alive(pid) and not _is_zombie(pid) else None


def leader(device: Device) -> int | None:
    """The container's PID 1 (systemd) as the host sees it, or None while it is not there."""
    supervisor = running_pid(device)
    for nspawn in children(supervisor) if supervisor else []:
        if comm(nspawn) == "systemd-nspawn":
            for child in children(nspawn):
                if comm(child) == "systemd":
                    return child
    return None


def nsenter(device: Device, args: list[str], *, timeout: float = 30, check: bool = True) -> str:
    """Run a command inside the device through its namespaces (no SSH)."""
    pid = leader(device)
    if pid is None:
        raise LabError(f"{device.name} is not running")
    return sh(["nsenter", "-t", str(pid), "-a", *args], timeout=timeout, check=check)


def wait_running(device: Device, deadline: float) -> None:
    """Wait until the device's systemd reports `running`; raise with its console log otherwise."""
    while time.monotonic() < deadline:
        if running_pid(device) is None:
            raise LabError(f"{device.name} exited while booting:\n{_console_tail(device)}")
        if leader(device) is not None:
            left = max(1.0, deadline - time.monotonic())
            state = nsenter(device, ["systemctl", "is-system-running", "--wait"], timeout=left, check=False)
            state = state.strip()
            if state == "running":
                return
            if state == "degraded":
                failed = nsenter(device, ["systemctl", "--failed", "--no-legend"], check=False)
                raise LabError(f"{device.name} booted degraded; failed units:\n{failed}")
        time.sleep(0.1)  # no bus or no PID 1 yet
    raise LabError(f"{device.name} did not reach 'running' in time:\n{_console_tail(device)}")


def stop(device: Device, *, wait: bool = True) -> None:
    """Power the device off cleanly (SIGTERM to the supervisor); kill it if that does not finish.

    With `wait=False` it only asks for the poweroff, so many devices can shut down at once.
    """
    pid = running_pid(device)
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    if not wait or _wait_gone(pid, STOP_TIMEOUT_S):
        return
    # Killing the container's PID 1 ends its whole PID namespace; then nspawn and the supervisor exit.
    for target in [leader(device), *children(pid), pid]:
        if target:
            _kill(target)
    if not _wait_gone(pid, 5):
        raise LabError(f"{device.name}: supervisor pid {pid} survived SIGKILL")


def release(device: Device) -> None:
    """Free everything the device holds on the host: cgroups, overlay mount, namespace, nspawn leftovers."""
    for hierarchy in cgroup_hierarchies():
        _remove_cgroup_tree(hierarchy / CGROUP_GROUP / device.name)
    if is_mounted(device.root):
        sh(["umount", str(device.root)], check=False)
        if is_mounted(device.root):  # still busy: detach now, the kernel frees it when unused
            sh(["umount", "-l", str(device.root)])
    netns.delete_netns(device.netns)
    propagate = PROPAGATE_DIR / device.name
    if propagate.is_dir():
        sh(["rm", "-rf", "--one-file-system", str(propagate)])
    device.pid_file.unlink(missing_ok=True)


def is_mounted(path: Path) -> bool:
    """True when `path` is a mount point (read from mountinfo: stat tricks fail for overlays)."""
    target = str(path.resolve())
    with Path("/proc/self/mountinfo").open() as mounts:
        return any(line.split()[4] == target for line in mounts)


def remove_cgroup_group() -> None:
    """Remove the lab's own cgroup directory once every device's subtree is gone."""
    for hierarchy in cgroup_hierarchies():
        _remove_cgroup_tree(hierarchy / CGROUP_GROUP)


def _remove_cgroup_tree(top: Path) -> None:
    if not top.is_dir():
        return
    groups = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
    for group in [*groups, top]:
        deadline = time.monotonic() + 5
        while True:
            for pid in (group / "cgroup.procs").read_text().split():
                _kill(int(pid))  # only processes of the lab's own containers can live here
            try:
                group.rmdir()
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise LabError(f"cannot remove cgroup {group}: {exc}") from exc
                time.sleep(0.05)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _reap(pid)
        if not pid_alive(pid) or _is_zombie(pid):
            return True
        time.sleep(0.05)
    return False


def _reap(pid: int) -> None:
    """Collect the exit status when the supervisor is our own child (it is when the lab ran in-process)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _console_tail(device: Device, lines: int = 30) -> str:
    try:
        return "\n".join((device.dir / "console.log").read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no console log)"
