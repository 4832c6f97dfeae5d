"""`sits-deployer init`: write a small working project (deploy.yaml, inventory, a hook, schemas).

The files come from `project_template/` next to this module. Nothing is overwritten unless asked,
and nothing at all is written when any target already exists. The two local devices get two free
loopback ports of this machine (so they never share one), the Python that runs this command (a
local device is this machine, and its agent needs the packages sits-deployer was installed with),
and their root directories under `.sits/fleet/`.
"""

from __future__ import annotations

import json
import re
import socket
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from deployer.config.schema import render_schema
from deployer.errors import ConfigError

_TEMPLATE = Path(__file__).with_name("project_template")
# Template file -> where it goes in the new project (names a package must not hold as-is).
_RENAMES = {"gitignore.txt": ".gitignore"}
_EXECUTABLE_SUFFIX = ".sh"
LOCAL_DEVICES = 2  # __PORT_1__, __PORT_2__ in the inventory template
DEVICE_ROOTS = tuple(Path(f".sits/fleet/dev{i}") for i in range(1, LOCAL_DEVICES + 1))


@dataclass(frozen=True)
class ScaffoldFile:
    """One file `init` writes: its place in the project and its contents."""

    relative: Path
    text: str

    @property
    def executable(self) -> bool:
        """Hook scripts must be executable for `validate` to accept them."""
        return self.relative.suffix == _EXECUTABLE_SUFFIX


def application_name(directory: Path) -> str:
    """A valid application name derived from the project directory's name."""
    name = re.sub(r"[^a-z0-9-]+", "-", directory.resolve().name.lower()).strip("-")[:63].strip("-")
    return name or "my-app"


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports free right now (all held open together, then released)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def scaffold_files(
    application: str, ports: list[int] | None = None, python: str | None = None
) -> list[ScaffoldFile]:
    """Every file of a new project, in a stable order (ports and python: see the module docstring)."""
    values = {"__APPLICATION__": application, "__PYTHON__": json.dumps(python or sys.executable)}
    for i, port in enumerate(ports or free_ports(LOCAL_DEVICES), start=1):
        values[f"__PORT_{i}__"] = str(port)
    files = []
    for path in sorted(_TEMPLATE.rglob("*")):
        if not path.is_file():
            continue
        relative = path.relative_to(_TEMPLATE)
        text = path.read_text(encoding="utf-8")
        for placeholder, value in values.items():
            text = text.replace(placeholder, value)
        files.append(ScaffoldFile(relative.with_name(_RENAMES.get(relative.name, relative.name)), text))
    files.append(ScaffoldFile(Path("schemas/deploy.schema.json"), render_schema("deploy")))
    files.append(ScaffoldFile(Path("schemas/inventory.schema.json"), render_schema("inventory")))
    return files


def scaffold_project(directory: Path, *, force: bool = False) -> list[Path]:
    """Write a new project into ``directory`` and make its device roots; return the files written.

    Raises ConfigError, writing nothing, if any file exists already and ``force`` is false.
    """
    files = scaffold_files(application_name(directory))
    existing = [f.relative for f in files if (directory / f.relative).exists()]
    if existing and not force:
        names = ", ".join(str(p) for p in existing)
        raise ConfigError(
            f"{directory}: would overwrite {names}",
            hint="run init in an empty directory, or pass --force to overwrite",
        )
    written = []
    for file in files:
        target = directory / file.relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(file.text, encoding="utf-8")
        if file.executable:
            target.chmod(0o755)
        written.append(target)
    for root in DEVICE_ROOTS:
        (directory / root).mkdir(parents=True, exist_ok=True)
    return written
