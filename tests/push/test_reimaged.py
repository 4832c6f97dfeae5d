"""A device re-imaged to another CPU architecture: its facts say so, it is bootstrapped anew with
the wheelhouse of its new architecture, and nothing of the old one counts as installed."""

from __future__ import annotations

import importlib.metadata
import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from deployer.push.facts import _PLATFORM, WHEELS_RECORD, DevicePlatform, DeviceSite, gather_facts
from deployer.push.plan import StepKind, reimaged
from deployer.push.wheelhouse import PipTarget, build_wheelhouse
from deployer.transport import LocalTransport
from tests.ports import reserved_port
from tests.push.simulator import SimFleet
from tests.push.wheels import fake_wheel


def _probe(record: dict, path: Path) -> list[str]:
    """The recorded wheels bootstrap's platform probe counts as installed in this interpreter."""
    path.write_text(json.dumps(record))
    argv = [sys.executable, "-c", _PLATFORM, str(path), sys.executable]
    return json.loads(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)["wheels"]


def test_recorded_wheels_of_another_architecture_never_count_as_installed(tmp_path):
    click = importlib.metadata.version("click")
    record = {"python": sys.executable, "wheels": {f"click-{click}-py3-none-any.whl": "c1"}}
    path = tmp_path / "wheels.json"
    assert _probe({**record, "machine": platform.machine()}, path) == ["c1"]
    assert _probe({**record, "machine": "some-other-cpu"}, path) == []  # re-imaged: all sent again
    assert _probe(record, path) == ["c1"]  # a record from before machines were recorded: this one's


def test_a_reimaged_device_gets_the_wheelhouse_of_its_new_architecture(tmp_path, links):
    fake_wheel(links, "fastpart", "1.0", "py3-none-linux_x86_64", "x86_64")
    fake_wheel(links, "fastpart", "1.0", "py3-none-manylinux_2_17_aarch64", "aarch64")
    fleet = SimFleet(tmp_path, size=2)
    fleet.devices["dev2"].arch = "aarch64"  # dev2 was x86-64 when its agent was installed
    facts = {f.name: f for f in fleet.facts()}
    assert facts["dev2"].arch == "aarch64" and facts["dev2"].wheels_arch == "x86_64"
    houses = {}
    for name in ("dev1", "dev2"):
        platform_ = facts[name].platform
        assert isinstance(platform_, DevicePlatform)
        houses[name] = build_wheelhouse(("fastpart",), PipTarget.of(platform_), cache=tmp_path, pins={})
    old, new = houses["dev1"], houses["dev2"]
    assert old.folder != new.folder  # one wheelhouse per architecture, never the old one reused
    sent = tuple(w.path.name for w in new.wheels)
    assert sent == ("fastpart-1.0-py3-none-manylinux_2_17_aarch64.whl",)
    plan = fleet.plan(wheels={"dev2": (sent, 100)}).plan
    dev1, dev2 = plan.devices
    assert StepKind.BOOTSTRAP not in {s.kind for s in dev1.steps} and dev1.arch == "x86_64"
    assert dev2.steps[0].kind is StepKind.BOOTSTRAP and dev2.arch == "aarch64"
    assert "re-imaged from x86_64 to aarch64" in dev2.steps[0].reason and dev2.wheels == sent


def test_facts_report_the_architecture_the_agent_was_installed_for_and_the_system_torch(tmp_path):
    torch = pytest.importorskip("torch")
    record = tmp_path / WHEELS_RECORD.lstrip("/")
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"python": sys.executable, "machine": "armv7l", "wheels": {}}))
    site = DeviceSite(
        name="board",
        host="localhost",
        root=str(tmp_path),
        local=True,
        port=reserved_port(),  # nothing listens: not ready, and no wait
        bootstrap_python=sys.executable,
        python=sys.executable,
        system_torch=True,  # the probe reports the torch this python brings
    )
    facts = gather_facts(site, LocalTransport(tmp_path))
    assert facts.reachable and facts.arch == platform.machine() and facts.wheels_arch == "armv7l"
    assert reimaged(facts)  # installed for another CPU than it has: bootstrapped anew
    assert facts.torch is not None and facts.torch.version == torch.__version__
    assert facts.torch.cuda == torch.cuda.is_available()
