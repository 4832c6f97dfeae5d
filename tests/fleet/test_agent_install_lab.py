"""Bootstrap onto lab devices that cannot reach any package index (marked `lab`).

The lab's devices live in network namespaces whose only link is the lab bridge: no default route,
no DNS. Each test first proves that (no route to a public address, pip on the device fails to reach
PyPI), then bootstraps from factory state over real SSH: the agent's runtime comes from the
controller's wheelhouse alone, and the device's venv holds no controller-only package and only the
engine that agent.engine names.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from deployer.errors import AgentError
from deployer.push.bootstrap import KERNEL_DIR, build_agent_wheel, install_agent
from deployer.push.facts import VENV_PYTHON, DeviceSite, gather_platform
from tests.fleet.agent_packages import forbidden, packages_of
from tests.lab.lab import Lab

pytestmark = pytest.mark.lab

PROJECT = Path(__file__).resolve().parents[2]


class CountingPuts:
    """The real SSH transport, recording which files `put` actually sent (a spy, not a fake)."""

    def __init__(self, transport) -> None:
        self.transport = transport
        self.sent: list[str] = []

    def put(self, local, remote, **kwargs):
        result = self.transport.put(local, remote, **kwargs)
        if not result.unchanged:
            self.sent.append(Path(remote).name)
        return result

    def __getattr__(self, name):
        return getattr(self.transport, name)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_agent_wheel(PROJECT, tmp_path_factory.mktemp("wheel"))


def _site(lab: Lab, index: int, engine: str = "torch", system_torch: bool = False) -> DeviceSite:
    device = lab.device(index)
    site = DeviceSite(device.name, device.address, "/", False, 8080, "python3", VENV_PYTHON)
    return replace(site, engine=engine, system_torch=system_torch)


def _assert_no_index(transport) -> None:
    """The device has no route off the lab, and pip there cannot reach an index."""
    route = transport.run("ip route get 151.101.0.223")  # a PyPI front end's address
    assert route.rc != 0 and "unreachable" in route.stderr.lower(), route
    assert "default" not in transport.run("ip route").stdout
    pip = transport.run(
        "python3 -m venv /tmp/probe && /tmp/probe/bin/pip download --no-cache-dir --retries 0 "
        "--timeout 3 -d /tmp/probe/dl six",
        timeout=120,
    )
    assert pip.rc != 0, pip.stdout
    transport.run("rm -rf /tmp/probe")


def _run(transport):
    return lambda argv: transport.run(argv, timeout=60).check(" ".join(argv[:2])).stdout


@pytest.mark.parametrize(("index", "engine"), [(4, "torch"), (5, "llama.cpp")])
def test_a_device_without_an_index_gets_only_the_agent(hub: Lab, ssh_to, wheel, index, engine):
    hub.reset(index, runtime=True)
    site = _site(hub, index, engine)
    transport = CountingPuts(ssh_to(site.host))
    _assert_no_index(transport)
    started = time.monotonic()
    install_agent(site, transport, wheel)
    took = time.monotonic() - started
    print(f"\n[bootstrap] {site.name} ({engine}): {took:.0f} s, {len(transport.sent)} files sent")
    packages = packages_of(_run(transport), site.python)
    assert forbidden(packages, engine) == set(), sorted(packages)
    assert {"sits-agent", "tokenizers", "jinja2", "tuf"} <= packages.keys()
    assert ("torch" if engine == "torch" else "llama-cpp-python") in packages
    engine_module = "torch" if engine == "torch" else "llama_cpp"
    transport.run(
        [site.python, "-c", f"import {engine_module}, deployer.agent.http.server"], timeout=120
    ).check(f"import {engine_module}")
    assert "serve" in _run(transport)([site.python, "-m", "deployer.agent.cli", "--help"])
    if engine == "torch":
        # The lab's devices have no C++ compiler, like most devices: our CPU kernels arrive built
        # by the controller, into the cache the agent's unit points them at, and load there.
        assert transport.run("command -v c++ g++ gcc").rc != 0
        loaded = transport.run(
            [
                "env",
                f"SITS_KERNEL_CACHE_DIR={KERNEL_DIR}",
                site.python,
                "-m",
                "deployer.agent.engines.torch.native",
            ],
            timeout=300,
        )
        assert f"built in {KERNEL_DIR}" in loaded.check("native kernels").stdout, loaded.stdout
    size = transport.run(["du", "-sh", "/opt/sits/venv"]).stdout.split()[0]
    print(f"[bootstrap] {site.name}: du -sh /opt/sits/venv = {size}")
    # Again: every wheel is recorded by its hash, so only our own wheel travels.
    assert gather_platform(site, transport).wheels
    transport.sent.clear()
    install_agent(site, transport, wheel)
    assert transport.sent == [wheel.name]


def test_system_torch_that_is_missing_fails_before_anything_is_sent(hub: Lab, ssh_to, wheel):
    hub.reset(3, runtime=True)
    site = _site(hub, 3, system_torch=True)
    transport = CountingPuts(ssh_to(site.host))
    with pytest.raises(AgentError, match=r"torch: system, but \S+ cannot import torch"):
        install_agent(site, transport, wheel)
    assert transport.sent == []
    cfg = transport.run(["cat", "/opt/sits/venv/pyvenv.cfg"]).check("pyvenv.cfg").stdout
    assert "include-system-site-packages = true" in cfg
    hub.reset(3, runtime=True)
