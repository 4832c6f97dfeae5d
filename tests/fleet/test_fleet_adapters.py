"""Adapters rolled out by plan/apply (issue #41) on a local device whose agent serves the tiny
model: `plan` shows the adapter on its own line, `apply` sends its signed adapter release and
artifact (a patch for the next version), the device verifies, installs, hot-loads and smoke-tests
it, and the base is never reinstalled or reloaded."""

from __future__ import annotations

import json
import shutil
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from deployer.agent.ota.adapters import AdapterStore
from deployer.agent.ota.store import DeviceStore
from tests.agent.lora_helpers import make_peft_adapter
from tests.fleet.conftest import Project, local_devices, make_project

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Project:
    base = tmp_path_factory.mktemp("fleet-adapters")
    project = make_project(base, {"1.0.0": tiny_model_dir}, local_devices(base, ("edge-a",), sys.executable))
    yield project
    project.stop_agents()
    shutil.rmtree(base / "devices", ignore_errors=True)


def _adapter(project: Project, version: str, peft: Path) -> None:
    doc = yaml.safe_load(project.config_path.read_text())
    doc["model"]["adapters"] = [{"name": "summarise", "version": version, "source": str(peft)}]
    project.config_path.write_text(yaml.safe_dump(doc, sort_keys=False))


def _apply(project: Project) -> dict:
    result = project.run("apply", "--output", "json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_an_adapter_rolls_out_moves_by_a_patch_and_rolls_back_and_the_base_stays(
    project: Project, tiny_model_dir: Path, tmp_path: Path
):
    _apply(project)  # the base first, no adapters
    device = DeviceStore(project.device_root("edge-a"))
    history = len(device.read_state().history)
    _adapter(project, "1.0.0", make_peft_adapter(tiny_model_dir, tmp_path / "p1", seed=1))
    assert project.run("build").exit_code == 0

    plan = project.run("plan")
    assert plan.exit_code == 0, plan.output
    assert "edge-a adapter summarise" in plan.stdout and "send-adapter, install-adapter" in plan.stdout
    report = _apply(project)
    assert [r["status"] for r in report["results"]] == ["updated"]
    store = AdapterStore(device.base)
    assert store.record("summarise").version == "1.0.0"

    _adapter(project, "1.1.0", make_peft_adapter(tiny_model_dir, tmp_path / "p2", seed=2))
    assert project.run("build").exit_code == 0
    plan = project.run("plan", "--output", "json")
    [dp] = json.loads(plan.stdout)["devices"]
    assert [s["kind"] for s in dp["steps"]] == ["send-adapter-patch", "install-adapter"]
    _apply(project)
    assert store.record("summarise").version == "1.1.0"
    assert store.state("summarise").previous_version == "1.0.0"
    assert len(device.read_state().history) == history  # the base was never installed again
    assert not json.loads(project.run("plan", "--output", "json").stdout)["has_changes"]
    assert _served(project) == ("1.1.0", True)  # hot-loaded by the running agent

    # A fleet rollback of the adapter alone: a new adapter release (higher counter) of 1.0.0.
    counter = store.state("summarise").counter
    result = project.run("rollback", "--adapter", "summarise", "--output", "json")
    assert result.exit_code == 0, result.output
    assert store.record("summarise").version == "1.0.0"
    assert store.state("summarise").counter > counter
    assert _served(project) == ("1.0.0", True)
    assert len(device.read_state().history) == history


def _served(project: Project) -> tuple[str, bool]:
    """The version of `summarise` the device's agent lists, and whether it is loaded."""
    port = yaml.safe_load(project.config_path.read_text())["fleet"]["devices"][0]["agent_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as answer:
        models = {m["id"]: m for m in json.load(answer)["data"]}
    return models["summarise"]["version"], models["summarise"]["loaded"]
