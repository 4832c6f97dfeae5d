"""CLI conventions every command keeps: --help with examples, --version, exit 2 on usage errors."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from deployer import __version__
from deployer.agent.cli import cli as agent_cli
from deployer.cli.main import COMMANDS, cli

AGENT_COMMANDS = sorted(agent_cli.commands)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_controller_command_has_help_with_examples(name: str) -> None:
    result = CliRunner().invoke(cli, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert "Examples:" in result.output
    assert f"sits-deployer {name}" in result.output


@pytest.mark.parametrize("name", AGENT_COMMANDS)
def test_every_agent_command_has_help_with_examples(name: str) -> None:
    result = CliRunner().invoke(agent_cli, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert "Examples:" in result.output
    assert f"sits-agent {name}" in result.output


def test_version_and_usage_errors() -> None:
    runner = CliRunner()
    assert __version__ in runner.invoke(cli, ["--version"]).output
    assert runner.invoke(cli, ["no-such-command"]).exit_code == 2
    assert runner.invoke(cli, ["validate", "--no-such-flag"]).exit_code == 2
    agent = runner.invoke(agent_cli, ["--version"])  # as `sits-deployer --version` (issue 18)
    assert (agent.exit_code, agent.output) == (0, f"sits-agent, version {__version__}\n")


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_controller_command_takes_verbosity_after_itself(name: str) -> None:
    """-v/-q work after the subcommand as well as before it (issue 18)."""
    result = CliRunner().invoke(cli, [name, "--help"])
    assert "-q, --quiet" in result.output and "-v, --verbose" in result.output


def test_quiet_after_the_subcommand_silences_messages(tmp_path) -> None:
    runner = CliRunner()
    loud = runner.invoke(cli, ["init", str(tmp_path / "a")])
    quiet = runner.invoke(cli, ["init", str(tmp_path / "b"), "-q"])
    assert loud.exit_code == quiet.exit_code == 0
    assert "wrote" in loud.stderr and quiet.stderr == ""


def test_an_unexpected_error_is_one_line_without_v_and_a_traceback_with_it(tmp_path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text('{"kind": "sits-plan", "config": 5}')  # a plan file whose fields are nonsense
    short = CliRunner().invoke(cli, ["apply", str(plan)])
    assert short.exit_code == 1 and "Traceback" not in short.stderr
    assert "run again with -v for the traceback" in short.stderr
    full = CliRunner().invoke(cli, ["-v", "apply", str(plan)])
    assert full.exit_code == 1 and full.exception is not None and not isinstance(full.exception, SystemExit)
