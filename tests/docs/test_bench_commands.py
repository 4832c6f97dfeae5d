"""Every bench command the README and docs write parses, as written, with the bench's own parser.

The benches take minutes to hours, so they run by hand; what rots silently is the command line a
doc gives for one (a renamed option, a bench moved). So each command is run in-process as python
would run it (`runpy`, `__name__ == "__main__"`, `sys.argv` as written) with argparse's
`parse_args`/`parse_known_args` and click's `Command.invoke` patched to stop right after a
successful parse: a parse error (unknown option, bad choice, missing value) fails with the doc's
file and line, a good parse stops before any work. A bench that imports neither argparse nor click
takes no arguments: its module must import, and a command that gives it arguments fails. A bench
that imports a package this machine lacks (triton, on a machine without a GPU) is skipped, saying
which; a missing module of the project's own fails.

Commands are the lines of code blocks (fenced or indented) and the code spans of the prose that
run a bench: `python bench/X.py ...` or `python -m bench.X ...`, after prefixes such as
`PYTHONPATH=.`, `.venv/bin/python` or `flock LOCK`. A code span naming a bench file alone
(`bench/X.py`) refers to it: it must exist and import, and is not parsed. Placeholders: a word
`...` stands for arguments the doc leaves out, so the command is checked up to it (and without
the option before it, when that option is left without its value); a word in angle brackets
(`<SmolLM2's tokenizer>`) is a value the reader supplies, checked as the word `PLACEHOLDER`; a
bench named in capitals (README's `bench/NAME.py`) stands for each bench, whose own commands are
checked where the docs give them, so it is not a command.
The interpreter and environment prefixes are not checked: the test's interpreter imports the
project's `bench` package as the venv does.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import runpy
import shlex
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import click
import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "examples").rglob("README.md")),
]

# A command's start: environment assignments and wrappers, then the interpreter (or the script).
_PREFIX = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*|sudo|exec|time|nice|\$)$")
_PYTHON = re.compile(r"^(?:\S*/)?python3?(?:\.\d+)?$")
_SCRIPT = re.compile(r"^(?:\./)?bench/([a-z_][a-z0-9_]*)\.py$")  # not bench/NAME.py: see above
_MODULE = re.compile(r"^bench\.([a-z_][a-z0-9_]*)$")
_SEPARATORS = re.compile(r"&&|\|\||;|\||2>|>|<")
_SUPPLIED = re.compile(r"<(?!\s)[^<>]*>")  # <SmolLM2's tokenizer>, not `< file`


@dataclass(frozen=True)
class BenchCommand:
    """One bench command line of a doc: where it is written, the bench and its arguments."""

    where: str  # "docs/torch-engine.md:312"
    text: str
    name: str  # the module under bench/
    as_module: bool  # `python -m bench.NAME` (else `python bench/NAME.py`)
    args: tuple[str, ...] | None  # None: a reference to the file, not a command


class _Parsed(Exception):
    """Raised where the bench's parser has accepted the arguments: the bench does no work."""


def _strip_wrappers(words: list[str]) -> list[str]:
    """The words from the interpreter or script on: assignments, sudo and `flock LOCK` dropped."""
    i = 0
    while i < len(words):
        if _PREFIX.match(words[i]):
            i += 1
        elif words[i] == "flock":  # flock [options] LOCK command...
            i += 1
            while i < len(words) and words[i].startswith("-"):
                i += 1
            i += 1
        else:
            break
    return words[i:]


def _placeholders(args: list[str]) -> list[str]:
    """Arguments with the doc's placeholders applied (see the module's docstring)."""
    if "..." in args:
        args = args[: args.index("...")]
        if args and args[-1].startswith("--") and "=" not in args[-1]:
            args = args[:-1]  # `--llama-tools ...`: the option's value is left out too
    return args


def parse_command(text: str, where: str, *, span: bool) -> BenchCommand | None:
    """The bench command a shell line (or a code span, `span`) runs, or None when it runs none."""
    for part in _SEPARATORS.split(_SUPPLIED.sub("PLACEHOLDER", text.split(" #", 1)[0])):
        try:
            words = _strip_wrappers(shlex.split(part))
        except ValueError:
            continue
        if not words:
            continue
        python = bool(_PYTHON.match(words[0]))
        if python:
            words = words[1:]
        if words[:1] == ["-m"] and len(words) > 1 and (m := _MODULE.match(words[1])):
            return BenchCommand(where, text.strip(), m[1], True, tuple(_placeholders(words[2:])))
        if words and (m := _SCRIPT.match(words[0])):
            reference = span and not python and len(words) == 1
            args = None if reference else tuple(_placeholders(words[1:]))
            return BenchCommand(where, text.strip(), m[1], False, args)
    return None


def _spans(token: Any) -> Iterator[tuple[int, str]]:
    """(line index, text) of each code span in an inline token (a paragraph, a table cell...)."""
    offset = 0
    for child in token.children or ():
        if child.type == "code_inline":
            found = token.content.find(child.content, offset)
            offset = max(found, offset)
            yield token.map[0] + token.content.count("\n", 0, offset), child.content


def bench_commands(path: Path) -> list[BenchCommand]:
    """Every bench command (and bench file reference) of a Markdown file, with its line."""
    name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    commands = []
    for token in MarkdownIt("commonmark").enable("table").parse(path.read_text(encoding="utf-8")):
        if token.type in ("fence", "code_block") and token.map:
            start = token.map[0] + (1 if token.type == "fence" else 0)
            lines = token.content.replace("\\\n", " \n").splitlines()
            for i, line in enumerate(lines):
                if cmd := parse_command(line, f"{name}:{start + i + 1}", span=False):
                    commands.append(cmd)
        elif token.type == "inline" and token.map:
            for line, text in _spans(token):
                if cmd := parse_command(text.replace("\n", " "), f"{name}:{line + 1}", span=True):
                    commands.append(cmd)
    return commands


def _takes_arguments(module: ModuleType) -> bool:
    """Whether a bench reads a command line: it imports argparse or click (or defines a click command)."""
    names = vars(module).values()
    return any(v is argparse or v is click or isinstance(v, click.Command) for v in names)


@contextlib.contextmanager
def _stop_after_parsing() -> Iterator[pytest.MonkeyPatch]:
    """argparse's and click's parsing run as usual, then raise `_Parsed` instead of returning.
    parse_args calls parse_known_args (as do subparsers): only the outermost call stops."""
    depth = [0]

    def stopping(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            try:
                result = original(*args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                raise _Parsed
            return result

        return wrapper

    def invoke(self: click.Command, ctx: click.Context) -> Any:
        raise _Parsed  # click parsed the line into ctx (make_context) before invoking

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", stopping(argparse.ArgumentParser.parse_args))
        mp.setattr(
            argparse.ArgumentParser, "parse_known_args", stopping(argparse.ArgumentParser.parse_known_args)
        )
        mp.setattr(click.Command, "invoke", invoke)
        mp.setattr(sys, "path", list(sys.path))  # a bench may put the root on it (bench/engine.py)
        yield mp


def check_bench_command(cmd: BenchCommand, bench_dir: Path = ROOT / "bench") -> str | None:
    """Why `cmd` would not start, or None: its bench is missing, does not import, or refuses its
    arguments. Run without the bench doing any work (see the module's docstring)."""
    script = bench_dir / f"{cmd.name}.py"
    if not script.is_file():
        return f"{cmd.where}: {cmd.text}: there is no {script.relative_to(bench_dir.parent)}"
    package = bench_dir.name
    try:
        module = __import__(f"{package}.{cmd.name}", fromlist=["_"])
    except ModuleNotFoundError as error:
        if error.name and error.name.split(".")[0] not in (package, "deployer", "tests"):
            pytest.skip(f"{cmd.where}: {cmd.name} needs {error.name}, not installed here (a GPU machine's)")
        return f"{cmd.where}: {cmd.text}: {package}.{cmd.name} does not import: {error!r}"
    except Exception as error:  # any import failure is the finding
        return f"{cmd.where}: {cmd.text}: {package}.{cmd.name} does not import: {error!r}"
    if cmd.args is None:
        return None
    if not _takes_arguments(module):
        return None if not cmd.args else f"{cmd.where}: {cmd.text}: {cmd.name} takes no arguments"
    argv0 = f"-m {package}.{cmd.name}" if cmd.as_module else str(script)
    stderr = io.StringIO()
    with (
        _stop_after_parsing() as mp,
        contextlib.redirect_stderr(stderr),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        sys.argv = [argv0, *cmd.args]
        try:
            if cmd.as_module:
                mp.delitem(sys.modules, f"{package}.{cmd.name}")  # `-m` runs it fresh, as __main__
                runpy.run_module(f"{package}.{cmd.name}", run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(str(script), run_name="__main__")
        except _Parsed:
            return None
        except SystemExit as exit:
            if exit.code in (0, None):
                return None  # --help
            why = (stderr.getvalue().strip().splitlines() or [f"exit status {exit.code}"])[-1]
            return f"{cmd.where}: {cmd.text}: {why}"
    return f"{cmd.where}: {cmd.text}: {cmd.name} ended without parsing a command line"


ALL = [cmd for path in DOCS for cmd in bench_commands(path)]


def test_the_docs_give_bench_commands():
    commands = [c for c in ALL if c.args is not None]
    assert len(commands) > 10
    assert any(c.as_module for c in commands) and any(not c.as_module for c in commands)


@pytest.mark.parametrize("cmd", ALL, ids=lambda c: c.where)
def test_bench_command_parses(cmd: BenchCommand, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert check_bench_command(cmd) is None


def test_the_checker_reads_prefixes_and_placeholders():
    cmd = parse_command(
        "flock /tmp/x.lock PYTHONPATH=. .venv/bin/python -m bench.scale_load --with-8b", "d:1", span=False
    )
    assert cmd == BenchCommand("d:1", cmd.text, "scale_load", True, ("--with-8b",))
    cmd = parse_command("python bench/quality.py --rows gguf --llama-tools ...", "d:2", span=True)
    assert cmd is not None and cmd.args == ("--rows", "gguf")
    cmd = parse_command("bench/serve.py --device cuda --tokenizer <SmolLM2's>", "d:3", span=True)
    assert cmd is not None and cmd.args == ("--device", "cuda", "--tokenizer", "PLACEHOLDER")
    assert parse_command("bench/shapes.py", "d:4", span=True) == BenchCommand(
        "d:4", "bench/shapes.py", "shapes", False, None
    )
    assert parse_command("--shapes S --no-baseline", "d:5", span=True) is None


def _fake_bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A package of three benches (argparse, click, none) that fail the test if they do any work."""
    bench = tmp_path / "fakebench"
    bench.mkdir()
    work = "raise AssertionError('the bench ran')"
    (bench / "argp.py").write_text(
        "import argparse\n"
        "def main():\n"
        "    parser = argparse.ArgumentParser()\n"
        "    parser.add_argument('--mode', choices=['a', 'b'])\n"
        "    parser.parse_args()\n"
        f"    {work}\n"
        "if __name__ == '__main__':\n    main()\n"
    )
    (bench / "clicky.py").write_text(
        "import click\n"
        "@click.command()\n@click.option('--n', type=int)\n"
        f"def main(n):\n    {work}\n"
        "if __name__ == '__main__':\n    main()\n"
    )
    (bench / "plain.py").write_text(f"def main():\n    {work}\nif __name__ == '__main__':\n    main()\n")
    (bench / "needs.py").write_text("import no_such_module_here\n")
    (bench / "broken.py").write_text("from fakebench import no_such_bench\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    return bench


def test_the_checker_catches_mistakes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _fake_bench(tmp_path, monkeypatch)

    def check(line: str) -> str | None:
        cmd = parse_command(line.replace("fakebench", "bench"), "doc.md:7", span=False)
        assert cmd is not None
        return check_bench_command(cmd, bench)

    assert check("python bench/argp.py --mode a") is None
    assert check("python -m bench.argp --help") is None
    assert check("python bench/clicky.py --n 3") is None
    assert check("python bench/plain.py") is None
    assert "unrecognized arguments: --mdoe" in (check("python bench/argp.py --mdoe a") or "")
    assert "invalid choice: 'c'" in (check("python -m bench.argp --mode c") or "")
    assert "No such option '--m'" in (check("python bench/clicky.py --m 3") or "")
    assert "plain takes no arguments" in (check("python bench/plain.py --fast") or "")
    assert "there is no fakebench/gone.py" in (check("python -m bench.gone") or "")
    assert "does not import" in (check("python bench/broken.py") or "")
    with pytest.raises(pytest.skip.Exception, match="needs no_such_module_here"):
        check("python bench/needs.py")
    assert (check("python bench/argp.py --mdoe a") or "").startswith(
        "doc.md:7: python bench/argp.py --mdoe a"
    )
