"""A lab of N booted systemd-nspawn devices reachable over SSH from the hub namespace.

`Lab.up` installs the guard route first, builds (or reuses) the template rootfs, creates the hub and
the devices, waits until every device's systemd is `running`, writes a known_hosts file from each
device's host key, and starts a reaper process that tears the lab down by itself when its time is
up or when the process that owns it has died. `Lab.down` always runs to the end and removes the
guard route last (and only when everything else is gone). One lab runs on a machine at a time.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.lab import devices, emulation, netns, rootfs
from tests.lab.devices import Device
from tests.lab.proc import LabError, pid_alive, sh

REPO = Path(__file__).resolve().parents[2]
ACTIVE = Path("/run/sits-lab.json")  # which workdir holds the running lab: names are machine-wide
LOCK = Path("/run/sits-lab.lock")
TOOLS = ("ip", "systemd-nspawn", "nsenter", "ssh-keygen", "systemd-id128", "mount")
BOOT_TIMEOUT_S = 60
EMULATED_BOOT_S = 240  # more per device under qemu: systemd and sshd key checks run emulated
# What `Lab.reset` runs on a device: stop and forget our units, then remove everything we wrote
# except the agent's runtime (bootstrap's venv and its wheel record), which loses only our package.
RESET_SCRIPT = (
    "systemctl stop 'sits-*' 2>/dev/null; systemctl reset-failed 'sits-*' 2>/dev/null; "
    "rm -rf /etc/systemd/system/sits-* /etc/systemd/system/timers.target.wants/sits-* "
    "/etc/systemd/system/multi-user.target.wants/sits-* /var/lib/sits /etc/sits /var/log/sits-agent.log; "
    "systemctl daemon-reload; /opt/sits/venv/bin/pip uninstall -q -y sits-agent 2>/dev/null; true"
)
WIPE_RUNTIME = "rm -rf /opt/sits"  # what `Lab.reset(..., runtime=True)` adds: as from the factory


@dataclass(frozen=True)
class UpReport:
    """What `up` measured, in seconds."""

    rootfs_s: float
    spawn_s: float
    boot_s: float
    devices: int


class Lab:
    """The lab in `workdir` with `count` devices (dev1..devN at 10.77.1.11...).

    `arches` names each device's architecture (`uname -m`), in order; by default all are the host's.
    A device of another architecture (aarch64 on an x86-64 host) boots its own Debian tree under
    qemu user-mode emulation: correct, but about 10-20 times slower.
    """

    def __init__(
        self,
        workdir: Path,
        count: int = 3,
        cache: Path = rootfs.CACHE,
        arches: Sequence[str] | None = None,
    ) -> None:
        if not 1 <= count <= 200:
            raise LabError(f"a lab has 1 to 200 devices, not {count}")
        arches = tuple(arches) if arches is not None else (emulation.host_arch(),) * count
        if len(arches) != count:
            raise LabError(f"arches names {len(arches)} architectures for {count} devices")
        for arch in set(arches):
            emulation.debian_arch(arch)  # refuses an architecture the lab has no recipe for
        self.workdir = workdir.resolve()
        self.count = count
        self.cache = cache
        self.arches = arches
        self.devices = [Device(i, self.workdir, arch) for i, arch in enumerate(arches, start=1)]

    @property
    def known_hosts(self) -> Path:
        """known_hosts with every device's host key, by address."""
        return self.workdir / "known_hosts"

    @property
    def client_key(self) -> Path:
        """The private key (ed25519, no passphrase) authorized as root on every device."""
        return self.workdir / "client_key"

    @property
    def state_file(self) -> Path:
        return self.workdir / "lab.json"

    def device(self, index: int) -> Device:
        """Device `index` (1-based)."""
        return self.devices[index - 1]

    def indices(self, arch: str) -> list[int]:
        """The indices of the devices of architecture `arch`."""
        return [d.index for d in self.devices if d.arch == arch]

    def up(self, *, ttl_s: float = 1800, owner_pid: int | None = None) -> UpReport:
        """Bring the lab up; on any failure tear down what was made and raise LabError."""
        _check_host()
        with _locked():
            _refuse_other_lab(self.workdir)
            netns.install_guard()  # first, before anything else exists
            self._write_state(deadline=time.time() + ttl_s, owner_pid=owner_pid)
            try:
                report = self._build_and_boot()
            except BaseException as exc:
                try:
                    self._down_locked()
                except LabError as cleanup:
                    exc.add_note(f"the teardown after this failure was incomplete too: {cleanup}")
                raise
        self._start_reaper()
        return report

    def down(self) -> None:
        """Tear everything down: devices, mounts, namespaces, cgroups, then the guard route."""
        with _locked():
            self._down_locked()

    def status(self) -> list[dict[str, object]]:
        """Per device: address, whether it runs, its systemd state, whether its link is up."""
        rows = []
        for device in self.devices:
            running = devices.leader(device) is not None
            state = ""
            if running:
                state = devices.nsenter(device, ["systemctl", "is-system-running"], check=False).strip()
            rows.append(
                {
                    "device": device.name,
                    "address": device.address,
                    "arch": device.arch,
                    "running": running,
                    "state": state,
                    "link_up": netns.netns_exists(device.netns) and _link_up(device),
                }
            )
        return rows

    def unplug(self, index: int) -> None:
        """Pull the device's network cable: its link goes down, the device keeps running."""
        netns.set_link(self.device(index).netns, "eth0", up=False)

    def plug(self, index: int) -> None:
        """Put the device's network cable back."""
        netns.set_link(self.device(index).netns, "eth0", up=True)

    def nsenter(self, index: int, args: list[str], *, timeout: float = 30) -> str:
        """Run a command inside device `index` without SSH; returns stdout, raises on failure."""
        return devices.nsenter(self.device(index), args, timeout=timeout)

    def inventory(self, indices: Iterable[int], *, rings: bool = False) -> list[dict[str, object]]:
        """deploy.yaml `fleet.devices` entries for these devices, reached over SSH with the lab's key
        and known_hosts; with `rings`, the first is labelled ring=canary and the others ring=main."""
        entries: list[dict[str, object]] = []
        for i in indices:
            entry: dict[str, object] = {
                "name": self.device(i).name,
                "host": self.device(i).address,
                "identity_file": str(self.client_key),
                "known_hosts": str(self.known_hosts),
            }
            if rings:
                entry["labels"] = {"ring": "main" if entries else "canary"}
            entries.append(entry)
        return entries

    def reset(self, index: int, *, runtime: bool = False) -> None:
        """Return device `index` to its factory state: no agent units, store, config or pull files.

        The lab is session-wide; test modules call this so that none depends on what an earlier
        module left on the devices (another model, keys, counters). The agent's runtime (torch and
        the rest, about 1 GB that bootstrap installed) stays unless `runtime`: without it a later
        bootstrap sends and installs only our own wheel, which keeps the lab tests minutes shorter."""
        script = f"{RESET_SCRIPT}; {WIPE_RUNTIME}" if runtime else RESET_SCRIPT
        devices.nsenter(self.device(index), ["sh", "-c", script], timeout=60)

    enter_hub = staticmethod(netns.enter_hub)
    in_hub = staticmethod(netns.in_hub)

    def _build_and_boot(self) -> UpReport:
        started = time.monotonic()
        templates = {arch: rootfs.ensure_rootfs(self.cache, arch=arch) for arch in sorted(set(self.arches))}
        rootfs_s = time.monotonic() - started
        _raise_inotify_limits()
        self._make_client_key()
        netns.create_hub()
        started = time.monotonic()
        key = self.client_key.with_suffix(".pub")
        lines = [devices.prepare(d, templates[d.arch], key) for d in self.devices]
        self.known_hosts.write_text("".join(lines))
        for device in self.devices:
            devices.start(device)
        spawn_s = time.monotonic() - started
        emulated = sum(emulation.is_foreign(arch) for arch in self.arches)
        deadline = time.monotonic() + BOOT_TIMEOUT_S + 2 * self.count + EMULATED_BOOT_S * emulated
        for device in self.devices:
            devices.wait_running(device, deadline)
        return UpReport(rootfs_s, spawn_s, time.monotonic() - started - spawn_s, self.count)

    def _down_locked(self) -> None:
        errors: list[str] = []
        present = self._devices_present()
        for device in present:  # all poweroffs first: they run in parallel inside the devices
            _collect(errors, devices.stop, device, wait=False)
        for device in present:
            _collect(errors, devices.stop, device)
            _collect(errors, devices.release, device)
        _collect(errors, devices.remove_cgroup_group)
        _collect(errors, netns.delete_netns, netns.HUB)
        if errors:  # something of the lab may remain: keep the guard so lab addresses stay unroutable
            raise LabError("lab teardown was incomplete; the guard route stays:\n" + "\n".join(errors))
        netns.remove_guard()  # last
        self.state_file.unlink(missing_ok=True)
        if _active_workdir() == self.workdir:
            ACTIVE.unlink(missing_ok=True)

    def _devices_present(self) -> list[Device]:
        """Every device directory of this workdir, also those of a bigger lab run before."""
        found = sorted(int(p.name[3:]) for p in self.workdir.glob("dev*") if p.name[3:].isdigit())
        return [Device(i, self.workdir) for i in sorted({*found, *(d.index for d in self.devices)})]

    def _make_client_key(self) -> None:
        if not self.client_key.exists():
            self.workdir.mkdir(parents=True, exist_ok=True)
            sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "sits-lab", "-f", str(self.client_key)])

    def _write_state(self, *, deadline: float, owner_pid: int | None) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        state = {
            "count": self.count,
            "arches": self.arches,
            "deadline": deadline,
            "owner_pid": owner_pid,
            "cache": str(self.cache),
        }
        self.state_file.write_text(json.dumps(state) + "\n")
        ACTIVE.write_text(json.dumps({"workdir": str(self.workdir)}) + "\n")

    def _start_reaper(self) -> None:
        with (self.workdir / "reaper.log").open("ab") as log:
            subprocess.Popen(
                [sys.executable, "-m", "tests.lab", "--workdir", str(self.workdir), "reap"],
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # outlives a killed test run, which is its whole point
            )


def reap(workdir: Path, poll_s: float = 1.0) -> None:
    """Wait until the lab's time is up or its owner died, then tear it down. Exits when the lab is gone."""
    while True:
        state = _read_state(workdir)
        if state is None:
            return  # torn down by someone else
        why = _stale_reason(state)
        if why:
            print(f"[lab] reaping {workdir}: {why}", flush=True)
            _from_state(workdir, state).down()
            return
        time.sleep(poll_s)


def _read_state(workdir: Path) -> dict[str, Any] | None:
    try:
        state: dict[str, Any] = json.loads((workdir / "lab.json").read_text())
    except (OSError, ValueError):
        return None
    return state


def _stale_reason(state: dict[str, Any]) -> str:
    """Why a lab with this state should go ("" while its owner lives and its time is not up)."""
    if time.time() > state["deadline"]:
        return "time is up"
    owner = state.get("owner_pid")
    if owner and not pid_alive(owner):
        return f"owner pid {owner} is gone"
    return ""


def load(workdir: Path) -> Lab:
    """The lab recorded in `workdir` (as brought up there)."""
    try:
        state = json.loads((workdir / "lab.json").read_text())
    except (OSError, ValueError) as exc:
        raise LabError(f"no lab is up in {workdir}") from exc
    return _from_state(workdir, state)


def _from_state(workdir: Path, state: dict[str, Any]) -> Lab:
    # A state file written before labs had arches holds only host-architecture devices.
    return Lab(workdir, state["count"], Path(state["cache"]), state.get("arches"))


def _check_host() -> None:
    if sys.platform != "linux" or os.geteuid() != 0:
        raise LabError("the device lab needs Linux and root")
    missing = [
        tool for tool in TOOLS if not shutil.which(tool, path=f"{os.environ.get('PATH', '')}:/usr/sbin")
    ]
    if missing:
        raise LabError(f"missing host tools: {', '.join(missing)} (see tests/lab/README.md)")


def _refuse_other_lab(workdir: Path) -> None:
    active = _active_workdir()
    if active is None:
        return
    state = _read_state(active)
    why = _stale_reason(state) if state else ""
    if state and why:
        # Its reaper died with it (a killed CI job, a stopped machine): finish the teardown it began.
        print(f"[lab] taking down the stale lab in {active}: {why}", flush=True)
        _from_state(active, state)._down_locked()
        return
    if active != workdir and state:
        raise LabError(f"another lab is up in {active}; run `python -m tests.lab down --workdir {active}`")
    if active == workdir and (workdir / "lab.json").exists():
        raise LabError(f"a lab is already up in {workdir}; run `python -m tests.lab down` first")


def _active_workdir() -> Path | None:
    try:
        return Path(json.loads(ACTIVE.read_text())["workdir"])
    except (OSError, ValueError, KeyError):
        return None


@contextmanager
def _locked() -> Iterator[None]:
    with LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _raise_inotify_limits() -> None:
    # Every container's systemd runs as host root; the default 128 instances stop at ~21 devices.
    for key, value in (("max_user_instances", 8192), ("max_user_watches", 1048576)):
        knob = Path("/proc/sys/fs/inotify") / key
        if int(knob.read_text()) < value:
            knob.write_text(str(value))


def _link_up(device: Device) -> bool:
    out = sh(["ip", "-n", device.netns, "-o", "link", "show", "eth0"], check=False)
    flags = out.partition("<")[2].partition(">")[0].split(",")
    return "UP" in flags


def _collect(errors: list[str], func: Callable[..., object], *args: object, **kwargs: object) -> None:
    """Run one teardown step; record its failure and go on, so teardown always reaches the end."""
    try:
        func(*args, **kwargs)
    except Exception as exc:
        errors.append(f"{getattr(func, '__name__', func)}{args}: {exc}")
