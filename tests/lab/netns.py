"""The lab network: a guard route in the root namespace, a hub namespace with a bridge, per-device links.

Safety is structural. Lab addresses (10.77.0.0/16) exist only inside namespaces made here. The guard
`unreachable 10.77.0.0/16` route in the root namespace is installed before anything else and removed
last, so a connection to a lab address from the root namespace fails at once instead of leaving
through the default route. Nothing here creates a device link unless the guard is in place, and
clients reach devices only from inside the hub namespace (`enter_hub`, `in_hub`).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.lab.proc import LabError, sh

LAB_NET = "10.77.0.0/16"
HUB = "slhub"
HUB_ADDRESS = "10.77.0.1/16"
NETNS_DIR = Path("/run/netns")
_CLONE_NEWNET = 0x40000000


def device_address(index: int) -> str:
    """The lab address of device `index` (1-based)."""
    if not 1 <= index <= 200:
        raise LabError(f"device index {index} is outside 1..200")
    return f"10.77.1.{index + 10}"


def is_lab_address(host: str) -> bool:
    """True for any address inside the lab network."""
    return host.startswith("10.77.")


def guard_installed() -> bool:
    """True when the root namespace holds the unreachable route for the lab network."""
    out = sh(["ip", "route", "show", "table", "main", "type", "unreachable", LAB_NET])
    return LAB_NET in out


def install_guard() -> None:
    """Install the guard route (idempotent). Always the first step of `up`."""
    sh(["ip", "route", "replace", "unreachable", LAB_NET])
    if not guard_installed():
        raise LabError(f"the guard route 'unreachable {LAB_NET}' did not take; refusing to build the lab")


def remove_guard() -> None:
    """Remove the guard route. Always the last step of `down`."""
    if guard_installed():
        sh(["ip", "route", "del", "unreachable", LAB_NET])


def require_guard() -> None:
    """Refuse to go on unless the guard route is in place."""
    if not guard_installed():
        raise LabError(
            f"the guard route 'unreachable {LAB_NET}' is missing in the root namespace: "
            "refusing to create a lab device (run `python -m tests.lab up`, which installs it first)"
        )


def netns_exists(name: str) -> bool:
    """True when a named network namespace exists."""
    return (NETNS_DIR / name).exists()


def create_hub() -> None:
    """The hub namespace with bridge br0 at 10.77.0.1. It has no default route, by design."""
    require_guard()
    if netns_exists(HUB):
        return
    sh(["ip", "netns", "add", HUB])
    sh(["ip", "-n", HUB, "link", "set", "lo", "up"])
    sh(["ip", "-n", HUB, "link", "add", "br0", "type", "bridge"])
    sh(["ip", "-n", HUB, "addr", "add", HUB_ADDRESS, "dev", "br0"])
    sh(["ip", "-n", HUB, "link", "set", "br0", "up"])


def delete_netns(name: str) -> None:
    """Delete a named namespace if it exists (its veth ends go with it)."""
    if netns_exists(name):
        sh(["ip", "netns", "del", name])


def create_device_net(ns: str, veth: str, address: str) -> None:
    """A device namespace with eth0 at `address`, linked to the hub bridge through a veth pair."""
    require_guard()
    if not netns_exists(HUB):
        raise LabError(f"hub namespace {HUB} is missing; bring the lab up first")
    delete_netns(ns)
    sh(["ip", "netns", "add", ns])
    sh(["ip", "-n", HUB, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
    sh(["ip", "-n", HUB, "link", "set", veth, "master", "br0", "up"])
    sh(["ip", "-n", ns, "link", "set", "lo", "up"])
    sh(["ip", "-n", ns, "addr", "add", f"{address}/16", "dev", "eth0"])
    set_link(ns, "eth0", up=True)


def set_link(ns: str, link: str, *, up: bool) -> None:
    """Bring a link in a namespace up or down (a device's 'network cable')."""
    sh(["ip", "-n", ns, "link", "set", link, "up" if up else "down"])


def _netns_id(path: str) -> tuple[int, int]:
    st = Path(path).stat()
    return st.st_dev, st.st_ino


def in_hub() -> bool:
    """True when the calling thread runs inside the hub namespace (network namespaces are per thread)."""
    return netns_exists(HUB) and _netns_id("/proc/thread-self/ns/net") == _netns_id(str(NETNS_DIR / HUB))


def require_hub_for(host: str) -> None:
    """Refuse (LabError) to let the calling thread reach a lab address unless it runs in the hub."""
    if is_lab_address(host) and not in_hub():
        raise LabError(f"refusing to connect to lab address {host} from outside the hub namespace {HUB}")


@contextmanager
def enter_hub() -> Iterator[None]:
    """Run the calling thread (and threads it starts) inside the hub namespace, then return.

    setns(2) on CLONE_NEWNET moves only the calling thread; threads started inside the block inherit
    the hub namespace, so paramiko's transport threads and a ThreadPoolExecutor's workers live there
    too. Sockets keep the namespace they were created in.
    """
    if not netns_exists(HUB):
        raise LabError(f"hub namespace {HUB} is missing; bring the lab up first")
    libc = ctypes.CDLL(None, use_errno=True)
    with Path("/proc/thread-self/ns/net").open("rb") as home, (NETNS_DIR / HUB).open("rb") as hub:
        _setns(libc, hub.fileno())
        try:
            yield
        finally:
            _setns(libc, home.fileno())


def _setns(libc: ctypes.CDLL, fd: int) -> None:
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise LabError(f"setns(CLONE_NEWNET) failed: {os.strerror(err)} (the lab needs root)")
