"""Root of `sits-deployer`: global flags, lazy subcommands, and the one place errors become exit codes."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import traceback

import click

from deployer import __version__
from deployer.cli.common import console
from deployer.core.redact import redact, redacting_stdio
from deployer.errors import SitsError

# name -> "module:function". Loaded on use, so `validate` never pays for importing torch.
COMMANDS: dict[str, str] = {
    "init": "deployer.cli.config_cmds:init",
    "validate": "deployer.cli.config_cmds:validate",
    "schema": "deployer.cli.config_cmds:schema",
    "build": "deployer.cli.build_cmds:build",
    "keygen": "deployer.cli.release_cmds:keygen",
    "sign": "deployer.cli.release_cmds:sign",
    "verify": "deployer.cli.release_cmds:verify",
    "delta": "deployer.cli.release_cmds:delta",
    "patch-apply": "deployer.cli.release_cmds:patch_apply",
    "release": "deployer.cli.release_cmds:release",
    "publish": "deployer.cli.publish_cmds:publish",
    "promote": "deployer.cli.publish_cmds:promote",
    "bundle": "deployer.cli.publish_cmds:bundle",
    "demo": "deployer.cli.demo_cmds:demo",
    "plan": "deployer.cli.fleet_cmds:plan",
    "apply": "deployer.cli.fleet_cmds:apply",
    "rollback": "deployer.cli.fleet_cmds:rollback",
    "status": "deployer.cli.fleet_cmds:status",
    "logs": "deployer.cli.fleet_cmds:logs",
    "down": "deployer.cli.fleet_cmds:down",
    "gc": "deployer.cli.fleet_cmds:gc",
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported only when invoked (or listed in --help)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(name for name in COMMANDS if _available(name))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None or not _available(cmd_name):
            return None
        module, _, attr = target.partition(":")
        return _with_verbosity_flags(getattr(importlib.import_module(module), attr))

    def invoke(self, ctx: click.Context) -> object:
        # Everything a command prints passes the redaction of the secrets it learns (core/redact.py).
        with redacting_stdio():
            try:
                return super().invoke(ctx)
            except SitsError as exc:
                report_error(exc)
                sys.exit(exc.exit_code)
            except KeyboardInterrupt:
                console().print("[red]error:[/red] interrupted")
                sys.exit(130)
            except (click.exceptions.Exit, click.ClickException, SystemExit):
                raise
            except Exception as exc:  # a bug or a foreign error: one line, the traceback only with -v
                if _verbosity(ctx) >= 1:
                    raise
                from rich.markup import escape

                console().print(f"[red]error:[/red] {escape(type(exc).__name__)}: {escape(str(exc))}")
                console().print("[yellow]hint:[/yellow] run again with -v for the traceback")
                sys.exit(1)


def _verbosity(ctx: click.Context) -> int:
    return int((ctx.find_root().obj or {}).get("verbosity", 0))


def _set_verbosity(ctx: click.Context, param: click.Parameter, value: int) -> None:
    """-v/-q given after the subcommand count as if given before it."""
    if not value:
        return
    root = ctx.find_root()
    root.obj = root.obj or {"verbosity": 0}
    if param.name == "sub_quiet":
        root.obj["verbosity"] = -1
    else:
        root.obj["verbosity"] = max(root.obj["verbosity"], 0) + int(value)
    _configure_logging(root.obj["verbosity"])


def _with_verbosity_flags(command: click.Command) -> click.Command:
    """Give a subcommand its own -v/-q (once), feeding the root's verbosity."""
    if not any(p.name == "sub_verbose" for p in command.params):
        command.params.append(
            click.Option(
                ["-v", "--verbose", "sub_verbose"],
                count=True,
                expose_value=False,
                callback=_set_verbosity,
                help="More detail on stderr (repeatable).",
            )
        )
        command.params.append(
            click.Option(
                ["-q", "--quiet", "sub_quiet"],
                is_flag=True,
                expose_value=False,
                callback=_set_verbosity,
                help="Only errors on stderr.",
            )
        )
    return command


def _configure_logging(verbosity: int) -> None:
    """Libraries log through `logging`: paramiko prints whole tracebacks of failed connections at
    ERROR. Our errors already say what failed, so their logs show only with -v."""
    level = logging.DEBUG if verbosity >= 2 else logging.INFO if verbosity == 1 else logging.CRITICAL + 1
    logging.basicConfig(level=level, format="%(name)s: %(message)s", force=True)


def _available(name: str) -> bool:
    module = COMMANDS[name].partition(":")[0]
    return importlib.util.find_spec(module) is not None


def report_error(exc: SitsError) -> None:
    """Print an error and its hint to stderr, never a traceback."""
    from rich.markup import escape

    # Escaped: brackets in messages are text (`pip install 'sits-deployer[llamacpp]'`), not markup.
    for finding in getattr(exc, "findings", None) or []:
        console().print(redact(str(finding)), markup=False, highlight=False)
    console().print(f"[red]error:[/red] {escape(redact(exc.message))}", markup=True)
    if exc.hint:
        console().print(f"[yellow]hint:[/yellow] {escape(redact(exc.hint))}")


@click.group(
    cls=LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog="Examples:\n\n  sits-deployer init my-fleet\n\n  sits-deployer validate -f deploy.yaml\n\n"
    "  sits-deployer build -f deploy.yaml",
)
@click.version_option(__version__, "--version", prog_name="sits-deployer")
@click.option("-v", "--verbose", count=True, help="More detail on stderr (repeatable).")
@click.option("-q", "--quiet", is_flag=True, help="Only errors on stderr.")
@click.pass_context
def cli(ctx: click.Context, verbose: int, quiet: bool) -> None:
    """Declarative edge deployment and OTA updates for quantized LLMs.

    A deploy.yaml names the model, its quantization, the devices, the rollout strategy
    and the hooks; sits-deployer makes the fleet match it.
    """
    ctx.obj = {"verbosity": -1 if quiet else verbose}
    _configure_logging(ctx.obj["verbosity"])


def main() -> None:
    """Console-script entry point."""
    with redacting_stdio():
        try:
            cli(prog_name="sits-deployer")
        except Exception:
            # A bug's traceback passes the redaction of the secrets the command learned, as
            # everything else it printed did; the exit status is Python's own for it.
            traceback.print_exc()
            sys.exit(1)
