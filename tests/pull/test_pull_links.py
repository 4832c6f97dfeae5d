"""Pull mode on slow and metered links: pull.yaml carries the device's link from deploy.yaml, a
metered device never downloads the full release in place of a missing patch unless allowed (and
keeps serving what it has), and downloads are held to the device's rate."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import deployer.agent.ota.poll as poll_module
from deployer.config.models import Config
from deployer.core.ratelimit import TokenBucket
from deployer.errors import AgentError
from deployer.push.facts import PULL_CONFIG
from deployer.push.pull_files import link_settings, pull_files
from tests.pull.nginx import Nginx
from tests.pull.project import Project, make_device


def _devices(project: Project) -> list[dict]:
    def local(name: str, port: int) -> dict:
        return {"name": name, "transport": "local", "root": str(project.dir / name), "agent_port": port}

    return [
        {**local("cell-1", 8101), "profile": "cellular"},
        {**local("cell-2", 8102), "profile": "cellular"},
        {**local("wired", 8103), "bandwidth": {"metered": False}},
    ]


def test_pull_yaml_carries_each_device_link_and_its_share_of_the_total(project: Project) -> None:
    project.devices = _devices(project)
    project.extra = {
        "bandwidth": {"pull_total": "3Mbit", "metered": True},
        "profiles": {"cellular": {"memory": "4Gi", "bandwidth": {"rate": "512kbit"}}},
    }
    project.publish_extra = {"base_url": "https://cdn.example/sits"}
    project.write("1.0.0")
    config: Config = project.config()
    cell, _, wired = config.fleet.devices
    # cell-1: its own 512 kbit/s is below its third of 3 Mbit/s; wired: its third (1 Mbit/s).
    metered = {"metered": True, "allow_full_on_metered": False}
    assert link_settings(config, cell) == {"max_rate": 64_000.0, **metered}
    assert link_settings(config, wired) == {"max_rate": 125_000.0}
    project.publish(project.dir / "published", "1.0.0")
    written = yaml.safe_load(pull_files(project.config(), cell, None)[PULL_CONFIG])
    assert written == {
        "url": "https://cdn.example/sits/stable/",
        "max_rate": 64_000.0,
        "metered": True,
        "allow_full_on_metered": False,
    }


def test_no_bandwidth_leaves_pull_yaml_as_it_was(project: Project) -> None:
    project.write("1.0.0")
    config = project.config()
    assert link_settings(config, config.fleet.devices[0]) == {}


@pytest.mark.parametrize("allowed", [False, True])
def test_a_metered_device_without_a_patch_keeps_its_version_unless_allowed(
    tmp_path: Path, project: Project, nginx: Nginx, allowed: bool
) -> None:
    project.publish_extra = {"patch_bases": 0}  # the channel publishes no patches at all
    project.publish(nginx.root, "1.0.0")
    settings = {"metered": True, "allow_full_on_metered": allowed}
    device = make_device(tmp_path / "d1", project, f"{nginx.url}/stable/", **settings)
    assert device.poll().payload == "full"  # the first install is no replaced patch
    project.publish(nginx.root, "2.0.0")
    nginx.clear_log()
    if allowed:
        outcome = device.poll()
        assert (outcome.result, outcome.payload) == ("updated", "full")
        assert device.store.current_version() == "2.0.0"
        return
    with pytest.raises(AgentError, match=r"metered link: the channel publishes no patch from 1\.0\.0"):
        device.poll()
    assert device.store.current_version() == "1.0.0"
    assert device.read_state().result == "failed" and "metered" in device.read_state().error
    # Refused before any payload: only metadata was fetched.
    assert not [path for path, _, _ in nginx.requests() if "/targets/" in path]


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_downloads_are_held_to_max_rate(
    tmp_path: Path, project: Project, nginx: Nginx, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = VirtualClock()
    buckets: list[TokenBucket] = []

    def bucket(rate: float) -> TokenBucket:
        buckets.append(TokenBucket(rate, burst=16 * 1024, clock=clock, sleep=clock.sleep))
        return buckets[-1]

    monkeypatch.setattr(poll_module, "TokenBucket", bucket)
    project.publish(nginx.root, "1.0.0")
    device = make_device(tmp_path / "d1", project, f"{nginx.url}/stable/", max_rate=100_000)
    outcome = device.poll()
    assert outcome.result == "updated" and [b.rate for b in buckets] == [100_000]
    # Every byte received went through the bucket: the virtual time is the bytes at the rate.
    assert clock.now == pytest.approx((outcome.bytes_downloaded - 16 * 1024) / 100_000, rel=0.01)
