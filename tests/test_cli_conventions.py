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
