"""Edge-cloud fallback on a LOCAL fleet through the real CLI: `up` is a plain device, `edge` falls
back to `up`'s agent (policy always, so that every answer goes there). The upstream key comes from an
environment variable and must reach edge's key file, 0600, and nothing else: not deploy.yaml's
rendered files, not plan output, not the CLI's output, not the agent's log."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import openai
import pytest
import yaml

from deployer.push.facts import FALLBACK_KEY_FILE
from tests.fleet.conftest import Project, local_devices, make_project

KEY = "sk-fleet-upstream-" + "f" * 32
ENV = "SITS_TEST_UPSTREAM_KEY"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, tiny_model_dir_b: Path):
    base = tmp_path_factory.mktemp("fallback-fleet")
    devices = local_devices(base, ("up", "edge"), sys.executable)
    up_port = devices[0]["agent_port"]
    devices[0]["fallback"] = {"policy": "off"}
    devices[1]["fallback"] = {"policy": "always"}
    project = make_project(base, {"1.0.0": tiny_model_dir, "2.0.0": tiny_model_dir_b}, devices)
    project.write(
        "1.0.0",
        fallback={
            "upstream": {
                "base_url": f"http://127.0.0.1:{up_port}/v1",
                "model": "tiny",
                "api_key": {"env": ENV},
            }
        },
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV, KEY)
        yield project
        project.stop_agents()
    shutil.rmtree(base / "devices", ignore_errors=True)


def _port(project: Project, name: str) -> int:
    doc = yaml.safe_load(project.config_path.read_text())
    return next(d["agent_port"] for d in doc["fleet"]["devices"] if d["name"] == name)


def test_plan_and_apply_never_show_the_key(fleet: Project):
    outputs = [
        fleet.run("validate").output,
        fleet.run("plan", "--output", "json").output,
        fleet.cli("-v", "plan", "-f", str(fleet.config_path)).output,
    ]
    assert f"put <from deploy.yaml> -> {FALLBACK_KEY_FILE}" in outputs[2]
    applied = fleet.run("apply", "--output", "json")
    assert applied.exit_code == 0, applied.output
    outputs.append(applied.output)
    assert all(KEY not in out for out in outputs)


def test_the_key_is_a_0600_file_the_agent_yaml_only_names(fleet: Project):
    edge = fleet.device_root("edge")
    key = edge / FALLBACK_KEY_FILE.lstrip("/")
    assert key.read_text() == KEY + "\n"
    assert key.stat().st_mode & 0o777 == 0o600 and key.parent.stat().st_mode & 0o777 == 0o700
    settings = (edge / "etc/sits/agent.yaml").read_text()
    assert KEY not in settings
    assert yaml.safe_load(settings)["fallback"]["api_key_file"] == str(key)
    assert not (fleet.device_root("up") / FALLBACK_KEY_FILE.lstrip("/")).exists()  # policy off there


def test_the_edge_answers_through_the_upstream_and_status_shows_it(fleet: Project):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{_port(fleet, 'edge')}/v1", api_key="x", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert raw.headers["x-sits-served-by"] == "upstream"
    assert raw.parse().model == "tiny@1.0.0"  # up's model, under up's name
    status = json.loads(fleet.run("status", "--output", "json").stdout)
    rows = {row["device"]: row for row in status}
    assert rows["edge"]["fallbacks_5m"] == 1 and rows["edge"]["edge_status"] == "ready"
    assert rows["up"]["fallbacks_5m"] is None  # no fallback configured there
    table = fleet.run("status").output
    assert "edge" in table and "fallbacks" in table  # the headers (the table may wrap them)
    log = (fleet.device_root("edge") / "var/log/sits-agent.log").read_text()
    assert KEY not in log


def test_removing_the_fallback_removes_the_key_from_the_device(fleet: Project):
    # Last in this module: it takes the fallback away from the fleet the tests above set up.
    doc = yaml.safe_load(fleet.config_path.read_text())
    del doc["fallback"]
    for device in doc["fleet"]["devices"]:
        del device["fallback"]
    fleet.config_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    key = fleet.device_root("edge") / FALLBACK_KEY_FILE.lstrip("/")
    plan = fleet.cli("-v", "plan", "-f", str(fleet.config_path)).output
    assert f"remove {FALLBACK_KEY_FILE}" in plan and f"run rm -f {key}" in plan
    applied = fleet.run("apply", "--output", "json")
    assert applied.exit_code == 0, applied.output
    assert not key.exists()
    assert "fallback" not in yaml.safe_load((fleet.device_root("edge") / "etc/sits/agent.yaml").read_text())
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{_port(fleet, 'edge')}/v1", api_key="x", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert raw.headers["x-sits-served-by"] == "edge"  # the restarted agent has no upstream any more
    assert f"remove {FALLBACK_KEY_FILE}" not in fleet.cli("-v", "plan", "-f", str(fleet.config_path)).output
