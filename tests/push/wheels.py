"""Wheels for wheelhouse tests: tiny ones pip resolves, tagged for any platform and holding a
library built (by its ELF header) for any CPU (the `links` fixture, in conftest.py, is the folder
pip then sees alone)."""

from __future__ import annotations

import zipfile
from pathlib import Path

EM = {"x86_64": 62, "aarch64": 183}


def _elf(arch: str) -> bytes:
    """The first bytes of a 64-bit little-endian ELF shared object for `arch`: what a loader reads."""
    return b"\x7fELF\x02\x01\x01" + bytes(9) + (3).to_bytes(2, "little") + EM[arch].to_bytes(2, "little")


def fake_wheel(
    folder: Path, name: str, version: str, tag: str, library: str | None = None, *, requires: str = ""
) -> Path:
    """A wheel pip can resolve, tagged `tag`, holding a shared library built for `library` (an arch);
    `requires`: more METADATA lines (Requires-Dist, Provides-Extra)."""
    info = f"{name}-{version}.dist-info"
    path = folder / f"{name}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{requires}"
        )
        wheel = f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: {tag}\n"
        zf.writestr(f"{info}/WHEEL", wheel)
        zf.writestr(f"{info}/RECORD", "")
        if library is not None:
            zf.writestr(f"{name}/lib/lib{name}.so", _elf(library) + bytes(64))
    return path
