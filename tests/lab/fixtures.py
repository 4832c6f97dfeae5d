"""pytest fixtures for tests against the device lab: a pytest plugin.

The lab has 5 booted nspawn devices of the host's architecture and a sixth, ARM64, that is aarch64
under qemu emulation (its tree is built once into the cache, 15-25 minutes; it boots in about a
minute). Only the tests that name ARM64 use it.

Network safety: the lab is brought up in the root namespace (guard route first), but every client
runs inside the hub namespace: the `hub` fixture moves the test's thread there, and `ssh_to` refuses
to open anything towards a lab address unless the calling thread is in the hub (`require_hub_for`).
Load it once per session (`pytest_plugins` in the root conftest, or one conftest importing it):
the `lab` fixture is session-scoped and only one lab runs on a machine at a time.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from deployer.errors import SitsError
from deployer.push.bootstrap import build_agent_wheel
from deployer.push.facts import DEFAULT_PYTHON, DeviceSite, parse_platform, platform_probe
from deployer.push.wheelhouse import PipTarget, agent_requirements, build_wheelhouse
from deployer.transport.base import RetryPolicy
from deployer.transport.ssh import SshOptions, SshTransport
from tests.lab import emulation
from tests.lab.lab import TOOLS, Lab
from tests.lab.netns import require_hub_for

LAB_DEVICES = 6  # the rollout tests need 5 of the host's architecture; the others use the first 3
ARM64 = 6  # the aarch64 device
LAB_ARCHES = (*(emulation.host_arch(),) * (LAB_DEVICES - 1), "aarch64")
# Measured: a 2.8 GB aarch64 wheelhouse (PyPI's CUDA torch and its nvidia-* wheels) took 10 min to
# reach the emulated device (about 5 MB/s: its sshd's crypto runs under qemu) and 17 to install.
# A CPU-only torch keeps it near x86-64's 240 MB, a few minutes in all.
EMULATED_WHEELHOUSE_MAX = 600_000_000
# Gathering that wheelhouse only to find it too big cost CI a 2.9 GB download (and a cache past
# its size limit) on every run: the torch engine on an emulated device is left out without
# gathering it unless this is set (with a CPU-only torch index for aarch64 in pip's config).
ARM_TORCH_ENV = "SITS_LAB_EMULATED_TORCH"
LAB_TTL_S = 2400  # the reaper tears the lab down by itself after this, or as soon as pytest dies
PROJECT = Path(__file__).resolve().parents[2]


def lab_unavailable() -> str | None:
    """Why the lab cannot run here, or None."""
    if sys.platform != "linux":
        return "the device lab needs Linux"
    if os.geteuid() != 0:
        return "the device lab needs root (network namespaces, mounts, nspawn)"
    missing = [tool for tool in (*TOOLS, "debootstrap") if not shutil.which(tool)]
    if missing:
        return f"the device lab needs {', '.join(missing)} (apt-get install systemd-container debootstrap)"
    return None


def _engines(arch: str) -> tuple[str, ...]:
    """The engines whose wheelhouse the lab gathers up front for devices of `arch`. For an emulated
    one, none: its llama.cpp wheel is a cross-build and its torch a 2.8 GB download, so each is
    gathered by `device_wheels` only for a test that asks (torch only with ARM_TORCH_ENV set)."""
    return () if emulation.is_foreign(arch) else ("torch", "llama.cpp")


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """A running lab of LAB_DEVICES devices, torn down at the end of the session (or by its reaper)."""
    reason = lab_unavailable()
    if reason:
        pytest.skip(reason)
    lab = Lab(tmp_path_factory.mktemp("lab"), LAB_DEVICES, arches=LAB_ARCHES)
    report = lab.up(ttl_s=LAB_TTL_S, owner_pid=os.getpid())
    print(f"\n[lab] rootfs {report.rootfs_s:.1f} s, spawn {report.spawn_s:.1f} s, boot {report.boot_s:.1f} s")
    try:
        wheel = build_agent_wheel(PROJECT, tmp_path_factory.mktemp("lab-wheel"))
        for arch in sorted(set(LAB_ARCHES)):
            target = _target(lab, lab.indices(arch)[0])
            for engine in _engines(arch):
                build_wheelhouse(agent_requirements(wheel, engine), target)
        yield lab
    finally:
        lab.down()


def _target(lab: Lab, index: int) -> PipTarget:
    """The wheel target of device `index`, probed inside it through nsenter (no SSH, no hub).

    The devices' wheelhouses are built here, in the root namespace, before any test: a controller
    builds them where it has its network. The tests drive the controller from inside the hub
    namespace, which, like a factory network, has no route or DNS out, so a wheelhouse that is not
    cached yet could not be made there.
    """
    device = lab.device(index)
    site = DeviceSite(device.name, device.address, "/", False, 8080, DEFAULT_PYTHON, DEFAULT_PYTHON)
    return PipTarget.of(parse_platform(site.name, lab.nsenter(index, platform_probe(site), timeout=300)))


@pytest.fixture(scope="session")
def device_wheels(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Callable[[int, str], str | None]:
    """device_wheels(index, engine) -> None when the controller has every wheel for that engine on
    device `index`'s platform (the wheelhouse is then cached), else why not (a test's skip reason).

    Built in the root namespace, where this session fixture runs, for the reason `_target` gives.
    """
    wheel = build_agent_wheel(PROJECT, tmp_path_factory.mktemp("lab-wheel-check"))
    found: dict[tuple[str, str], str | None] = {}
    for device in lab.devices:
        for engine in ("torch", "llama.cpp"):
            if (device.arch, engine) in found:
                continue
            if engine == "torch" and emulation.is_foreign(device.arch) and not os.environ.get(ARM_TORCH_ENV):
                found[device.arch, engine] = (
                    f"the torch wheelhouse for {device.arch} from PyPI is a CUDA build of about 2.9 GB: "
                    "sent through an emulated sshd and installed under qemu it takes about 30 minutes, "
                    f"beyond CI's budget (give pip torch's CPU build for {device.arch}, "
                    f"set {ARM_TORCH_ENV}=1)"
                )
                continue
            try:
                house = build_wheelhouse(agent_requirements(wheel, engine), _target(lab, device.index))
            except SitsError as exc:
                found[device.arch, engine] = f"no {engine} wheelhouse for {device.arch} devices: {exc}"
                continue
            size = sum(f.stat().st_size for f in house.folder.glob("*.whl"))
            too_big = emulation.is_foreign(device.arch) and size > EMULATED_WHEELHOUSE_MAX
            found[device.arch, engine] = (
                f"the {engine} wheelhouse for {device.arch} is {size / 1e9:.1f} GB: sent through an "
                "emulated sshd and installed under qemu it takes about 30 minutes, beyond CI's budget "
                "(PyPI's aarch64 torch is a CUDA build; give pip torch's CPU build for aarch64)"
                if too_big
                else None
            )
    return lambda index, engine: found[lab.device(index).arch, engine]


@pytest.fixture
def hub(lab: Lab) -> Iterator[Lab]:
    """The lab, with this test's thread (and threads it starts) inside the hub namespace."""
    with lab.enter_hub():
        yield lab


@pytest.fixture
def lab_options(hub: Lab) -> SshOptions:
    """SSH options for the lab: its key and known_hosts, short timeouts, fast retries."""
    return SshOptions(
        key_file=hub.client_key,
        known_hosts=hub.known_hosts,
        connect_timeout_s=3,
        io_timeout_s=10,
        retry=RetryPolicy(attempts=2, base_delay_s=0.2, max_delay_s=1),
    )


@pytest.fixture
def ssh_to(hub: Lab, lab_options: SshOptions) -> Iterator[Callable[..., SshTransport]]:
    """Factory: ssh_to(host, port=22, **option_overrides) -> SshTransport, closed after the test."""
    opened: list[SshTransport] = []

    def make(host: str, port: int = 22, **overrides: object) -> SshTransport:
        require_hub_for(host)  # raises unless this thread is in the hub
        options = SshOptions(**{**lab_options.__dict__, **overrides})
        transport = SshTransport(host, port=port, options=options)
        opened.append(transport)
        return transport

    yield make
    for transport in opened:
        transport.close()


@pytest.fixture
def host_key_line(lab: Lab) -> Callable[[int], tuple[str, str]]:
    """(key type, base64) of device i's host key, read from its root filesystem on the host."""

    def read(index: int) -> tuple[str, str]:
        pub = lab.device(index).root / "etc/ssh/ssh_host_ed25519_key.pub"
        key_type, key_b64 = Path(pub).read_text().split()[:2]
        return key_type, key_b64

    return read
