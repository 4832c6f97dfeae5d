"""constraints.txt pins every dependency scripts/setup.sh installs, within the ranges of
pyproject.toml and agent/pyproject.toml, and the virtual environment the tests run in holds exactly
those versions."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
# Our own builds: llama-cpp-python (scripts/llamacpp.sh, pinned there by version and patches) and the
# agent's distribution (installed from the checkout, at the controller's own version).
NOT_PINNED = {"llama-cpp-python", "sits-agent"}
PROJECTS = (ROOT / "pyproject.toml", ROOT / "agent" / "pyproject.toml")


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def _requirements() -> list[tuple[str, Requirement]]:
    """(where, requirement) for the dependencies and every extra of both projects."""
    found = []
    for path in PROJECTS:
        project = tomllib.loads(path.read_text())["project"]
        where = path.relative_to(ROOT)
        found += [(f"{where} dependencies", Requirement(line)) for line in project["dependencies"]]
        for extra, lines in project["optional-dependencies"].items():
            found += [(f"{where} [{extra}]", Requirement(line)) for line in lines]
    return found


def test_every_dependency_is_pinned_within_its_range():
    pins = _pins()
    problems = []
    for where, req in _requirements():
        name = canonicalize_name(req.name)
        if name in NOT_PINNED or (req.marker is not None and not req.marker.evaluate()):
            continue
        if name not in pins:
            problems.append(f"{where} {req}: not in constraints.txt")
        elif not req.specifier.contains(pins[name], prereleases=True):
            problems.append(f"{where} {req}: constraints.txt pins {pins[name]}")
    assert not problems, "run scripts/setup.sh, then scripts/pin.sh:\n" + "\n".join(problems)


def test_the_environment_holds_the_pinned_versions():
    drift = []
    for name, version in _pins().items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            drift.append(f"{name}: pinned {version}, not installed")
            continue
        if installed.split("+")[0] != version:
            drift.append(f"{name}: pinned {version}, installed {installed}")
    assert not drift, "run scripts/setup.sh (it installs constraints.txt's versions):\n" + "\n".join(drift)
