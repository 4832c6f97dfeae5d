"""Every example validates; the committed schemas are in sync with the models and accept the examples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from deployer.config import load_config, validate_file
from deployer.config.estimate import SMOLLM2_SHAPE, ModelShape
from deployer.config.schema import render_schema

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").rglob("deploy.yaml"))
INVENTORIES = sorted((ROOT / "examples").rglob("inventory.yaml"))
SCHEMA_LINE = "# yaml-language-server: $schema="


def test_there_are_examples():
    names = {p.parent.name for p in EXAMPLES}
    assert {"quickstart", "seed-003", "fleet-ssh"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.parent.name)
def test_example_validates(path):
    assert [str(f) for f in validate_file(path, environ={})] == []


@pytest.mark.parametrize("path", EXAMPLES + INVENTORIES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_example_names_an_existing_schema(path):
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith(SCHEMA_LINE)
    assert (path.parent / first.removeprefix(SCHEMA_LINE)).resolve().is_file()


@pytest.mark.parametrize("kind", ["deploy", "inventory"])
def test_committed_schema_is_in_sync(kind):
    committed = (ROOT / "schemas" / f"{kind}.schema.json").read_text(encoding="utf-8")
    assert committed == render_schema(kind), f"stale: run sits-deployer schema --kind {kind} -o ..."


@pytest.mark.parametrize("path", EXAMPLES + INVENTORIES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_editor_schema_accepts_example(path):
    jsonschema = pytest.importorskip("jsonschema")
    first = path.read_text(encoding="utf-8").splitlines()[0]
    schema = json.loads((path.parent / first.removeprefix(SCHEMA_LINE)).read_text(encoding="utf-8"))
    jsonschema.validate(yaml.safe_load(path.read_text(encoding="utf-8")), schema)


def test_editor_schema_rejects_unknown_fields():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(render_schema("deploy"))
    data = yaml.safe_load((ROOT / "examples/seed-003/deploy.yaml").read_text(encoding="utf-8"))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**data, "strategi": "canary"}, schema)


def test_seed_example_reads_as_written():
    config = load_config(ROOT / "examples/seed-003/deploy.yaml", environ={})
    assert (config.application, config.namespace, config.strategy.type) == (
        "sits-prod-v3",
        "industrial-core",
        "blue-green",
    )
    assert (config.resources.cpu, config.resources.memory) == (4000, 8 * 2**30)
    assert config.hooks.pre_deploy is not None
    assert config.resolve(config.hooks.pre_deploy.path).is_file()


def test_fleet_example_merges_its_inventory():
    config = load_config(ROOT / "examples/fleet-ssh/deploy.yaml", environ={})
    prod = [d for d in config.fleet.devices if d.labels.get("env") == "prod"]
    assert len(config.fleet.devices) == 6 and len(prod) == 4
    assert config.strategy.resolved_steps(len(prod)) == [1, 2, 4]
    assert config.strategy.failure_limit(len(prod)) == 1


def test_builtin_shape_matches_the_real_model_config(smollm2_dir):
    assert ModelShape.from_config_json(smollm2_dir / "config.json") == SMOLLM2_SHAPE


def test_examples_do_not_need_environment_variables():
    # They must validate on a bare CI machine.
    for path in EXAMPLES:
        assert "${" not in path.read_text(encoding="utf-8"), path
