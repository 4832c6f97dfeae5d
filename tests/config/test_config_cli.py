"""`sits-deployer validate`, `init` and `schema`: exit codes, output channels, nothing written on error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from deployer.cli.main import cli
from deployer.config.schema import render_schema

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples/quickstart/deploy.yaml"


def run(*args: str) -> object:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_validate_valid_file_exits_0():
    result = run("validate", "-f", str(QUICKSTART))
    assert result.exit_code == 0, result.stderr
    assert result.stdout == ""
    assert "valid (quickstart, 3 devices)" in result.stderr


def test_validate_broken_file_exits_1_with_positions_on_stderr(write_config):
    path = write_config(append="strategi: canary\nagent: {engine: torhc}\n")
    result = run("validate", "-f", str(path))
    assert result.exit_code == 1
    assert result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if ": warning: " not in line]
    assert lines[0] == f"{path}:20:1: strategi: unknown field 'strategi' (did you mean 'strategy'?)"
    assert lines[1].startswith(f"{path}:21:17: agent.engine: unknown value 'torhc'")
    assert lines[2] == f"2 problems in {path}"


def test_validate_json_goes_to_stdout(write_config):
    path = write_config(append="strategi: canary\n")
    result = run("validate", "-f", str(path), "--output", "json")
    assert result.exit_code == 1
    findings = [f for f in json.loads(result.stdout) if f["severity"] == "error"]
    assert findings == [
        {
            "file": str(path),
            "line": 20,
            "column": 1,
            "path": "strategi",
            "message": "unknown field 'strategi'",
            "hint": "did you mean 'strategy'?",
            "severity": "error",
        }
    ]


def test_validate_json_of_valid_file_is_empty_list():
    result = run("validate", "-f", str(QUICKSTART), "--output", "json")
    assert (result.exit_code, json.loads(result.stdout)) == (0, [])


def test_usage_error_exits_2():
    assert run("validate", "--no-such-flag").exit_code == 2
    assert run("validate", "--output", "yaml").exit_code == 2


@pytest.mark.parametrize("command", ["validate", "init", "schema"])
def test_help_has_examples(command):
    result = run(command, "--help")
    assert result.exit_code == 0
    assert "Examples:" in result.stdout and f"sits-deployer {command}" in result.stdout


def test_init_scaffolds_a_project_that_validates(tmp_path):
    project = tmp_path / "My Fleet"
    result = run("init", str(project))
    assert result.exit_code == 0, result.stderr
    hook = project / "hooks/pre-deploy.sh"
    assert hook.stat().st_mode & 0o111
    assert (project / "keys/README.md").is_file() and (project / ".gitignore").is_file()
    assert (project / "schemas/deploy.schema.json").read_text() == render_schema("deploy")
    # Signing is configured but init writes no key: validate names the one command to run.
    check = run("validate", "-f", str(project / "deploy.yaml"))
    assert check.exit_code == 1
    assert "create the pair with `sits-deployer keygen -o keys/release`" in check.stderr
    assert "keygen -o keys/release" in result.stderr  # init's own "next:" line says it too
    keygen = run("keygen", "-o", str(project / "keys/release"), "--unencrypted")
    assert keygen.exit_code == 0, keygen.stderr
    check = run("validate", "-f", str(project / "deploy.yaml"))
    assert check.exit_code == 0, check.stderr
    assert "(my-fleet, 2 devices)" in check.stderr


def test_init_refuses_to_overwrite_and_writes_nothing(tmp_path):
    (tmp_path / "deploy.yaml").write_text("mine\n")
    result = run("init", str(tmp_path))
    assert result.exit_code == 1
    assert "would overwrite deploy.yaml" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deploy.yaml"]
    assert (tmp_path / "deploy.yaml").read_text() == "mine\n"
    assert run("init", "--force", str(tmp_path)).exit_code == 0
    assert (tmp_path / "deploy.yaml").read_text() != "mine\n"


def test_schema_to_stdout_and_file(tmp_path):
    result = run("schema")
    assert result.exit_code == 0 and json.loads(result.stdout)["title"] == "SITS-Deployer deploy.yaml"
    out = tmp_path / "inventory.schema.json"
    assert run("schema", "--kind", "inventory", "-o", str(out)).exit_code == 0
    assert out.read_text() == render_schema("inventory")


def test_schema_check_detects_stale_files(tmp_path):
    out = tmp_path / "deploy.schema.json"
    out.write_text("{}\n")
    stale = run("schema", "--check", "-o", str(out))
    assert stale.exit_code == 1 and "stale" in stale.stderr
    assert out.read_text() == "{}\n"
    assert run("schema", "--check", "-o", str(ROOT / "schemas/deploy.schema.json")).exit_code == 0
    assert run("schema", "--check").exit_code == 2
