"""The attack suite reuses the device-store fixtures (real tiny artifacts, patches and a release
key) and pull mode's (a project that publishes channels of tiny artifacts)."""

from __future__ import annotations

from pathlib import Path

from tests.agent.ota.conftest import device, kit  # noqa: F401  (fixtures, used by name)
from tests.pull.conftest import built_store, project, sources  # noqa: F401  (fixtures, used by name)


def snapshot(root: Path) -> dict[str, bytes | str]:
    """Every path under `root` with its bytes (files) or link target; the lock file aside."""
    out: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.name == ".lock":
            continue
        if path.is_symlink():
            out[rel] = f"-> {path.readlink()}"
        elif path.is_file():
            out[rel] = path.read_bytes()
        else:
            out[rel] = "dir"
    return out
