"""The README and docs cannot rot: local links resolve, every command line names real subcommands and
options, the workflows pass actionlint, and the generated deploy.yaml reference is fresh."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from deployer.agent.cli import cli as agent_cli
from deployer.cli.main import cli as deployer_cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "examples").rglob("README.md")),
]
CLIS = {"sits-deployer": deployer_cli, "sits-agent": agent_cli}

_spec = importlib.util.spec_from_file_location("gen_reference", Path(__file__).with_name("gen_reference.py"))
assert _spec is not None and _spec.loader is not None
gen_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_reference)

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1", re.M | re.S)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def local_links(path: Path) -> list[str]:
    """Link targets in a Markdown file that are not URLs or in-page anchors (code blocks skipped)."""
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    targets = [m.group(1) for m in LINK.finditer(text)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


PREFIXES = {"sudo", "exec", "time", "$"}


def _as_command(words: list[str]) -> list[str] | None:
    """argv if the shell words run one of our CLIs (after VAR=value, sudo, ...), else None."""
    i = 0
    while i < len(words) and (words[i] in PREFIXES or re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[i])):
        i += 1
    if i < len(words) and Path(words[i]).name in CLIS:
        return [Path(words[i]).name, *words[i + 1 :]]
    return None


def command_lines(path: Path) -> list[list[str]]:
    """argv of every `sits-deployer ...` / `sits-agent ...` command in fenced code blocks."""
    commands = []
    for block in FENCE.finditer(path.read_text(encoding="utf-8")):
        for raw in block.group(2).replace("\\\n", " ").splitlines():
            line = raw.split(" #", 1)[0].strip()
            line = re.sub(r"^\s*-\s+", "", line)  # a YAML list item (GitLab's script:)
            for part in re.split(r"&&|\|\||;|\||>|2>|<", line):
                try:
                    words = shlex.split(part)
                except ValueError:
                    continue
                if (argv := _as_command(words)) is not None:
                    commands.append(argv)
    return commands


def check_command(argv: list[str]) -> str | None:
    """Why argv is not a real command line, or None: walks click's groups and checks every option."""
    command: click.Command = CLIS[argv[0]]
    ctx = click.Context(command, info_name=argv[0])
    args = argv[1:]
    while isinstance(command, click.Group):
        words = [a for a in args if not a.startswith("-")]
        if not words:
            return None  # `sits-deployer --help` and the like
        name = words[0]
        sub = command.get_command(ctx, name)
        if sub is None:
            return f"no subcommand {name!r}"
        args = args[args.index(name) + 1 :]
        command, ctx = sub, click.Context(sub, info_name=name, parent=ctx)
    known = {
        o
        for p in command.get_params(ctx)
        if isinstance(p, click.Option)
        for o in (*p.opts, *p.secondary_opts)
    }
    for arg in args:
        if arg.startswith("-") and arg != "-":
            option = arg.split("=", 1)[0]
            if option not in known:
                return f"{command.name} has no option {option}"
    return None


def test_there_are_docs_and_commands():
    names = {p.name for p in DOCS}
    assert {
        "README.md",
        "concepts.md",
        "deploy-yaml.md",
        "operating.md",
        "ci.md",
        "security-model.md",
    } <= names
    assert sum(len(command_lines(p)) for p in DOCS) > 30


def test_the_checker_catches_mistakes():
    assert check_command(["sits-deployer", "plan", "-f", "d.yaml", "--detailed-exitcode"]) is None
    assert check_command(["sits-agent", "rollback", "--to", "1.0.0"]) is None
    assert check_command(["sits-deployer", "release", "-f", "d.yaml"]) == "release has no option -f"
    assert check_command(["sits-deployer", "deploy"]) == "no subcommand 'deploy'"


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_local_links_exist(path):
    missing = []
    for target in local_links(path):
        file = target.split("#", 1)[0]
        if file and not (path.parent / file).exists():
            missing.append(target)
    assert missing == [], f"{_rel(path)}: links to missing files"


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_commands_are_real(path):
    problems = [f"{' '.join(argv)}: {why}" for argv in command_lines(path) if (why := check_command(argv))]
    assert problems == []


def test_every_subcommand_answers_help():
    for name, cli in CLIS.items():
        ctx = click.Context(cli, info_name=name)
        for sub in cli.list_commands(ctx):
            result = CliRunner().invoke(cli, [sub, "--help"])
            assert result.exit_code == 0, f"{name} {sub} --help: {result.output}"


def _workflow_commands() -> list[list[str]]:
    commands = []
    for path in sorted((ROOT / ".github" / "workflows").glob("*.yml")):
        text = path.read_text(encoding="utf-8").replace(">-\n", "\n")
        joined = re.sub(r"\n\s+(--)", r" \1", text)  # folded multi-line commands
        for line in joined.splitlines():
            for part in re.split(r"&&|\|\||;|\||>|2>|<", line.split(" #", 1)[0]):
                try:
                    words = shlex.split(part.replace("run:", " "))
                except ValueError:
                    continue
                if (argv := _as_command(words)) is not None:
                    commands.append(argv)
    return commands


def test_workflow_commands_are_real():
    commands = _workflow_commands()
    assert any(c[:2] == ["sits-deployer", "apply"] for c in commands)
    problems = [f"{' '.join(argv)}: {why}" for argv in commands if (why := check_command(argv))]
    assert problems == []


def test_actionlint():
    actionlint = shutil.which("actionlint") or str(ROOT / ".venv" / "bin" / "actionlint")
    if not Path(actionlint).exists():
        pytest.skip("actionlint is not installed (scripts/setup.sh installs it)")
    done = subprocess.run([actionlint], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_deploy_yaml_reference_is_fresh():
    schema = json.loads(gen_reference.SCHEMA.read_text(encoding="utf-8"))
    assert gen_reference.REFERENCE.read_text(encoding="utf-8") == gen_reference.render(schema), (
        "docs/deploy-yaml.md is stale: run .venv/bin/python tests/docs/gen_reference.py"
    )


def test_reference_covers_every_field():
    schema = json.loads(gen_reference.SCHEMA.read_text(encoding="utf-8"))
    text = gen_reference.REFERENCE.read_text(encoding="utf-8")
    for name in schema["$defs"]:
        assert f"## {name}\n" in text
    for node in [schema, *schema["$defs"].values()]:
        for field in node.get("properties", {}):
            assert f"| `{field}` |" in text
