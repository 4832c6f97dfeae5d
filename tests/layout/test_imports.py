"""The house rules of deployer/: imports flow one way, and no two modules import each other.

    cli ─► demo ─► push ─► pull ─► release ─► build ─► config ─► transport ─► core, errors
    agent ─► core, errors (the device installs nothing else)

and inside the agent, folder by folder (docs/architecture.md draws it):

    cli ─► http ─► serving ─► runtime ─► engines | openai ─► chat ─► ota | settings | notify | types
    inside engines: the factory (engines/__init__) ─► torch/ | llamacpp/ ─► the shared modules

A higher step may import any lower one, never the reverse. Imports inside functions count too:
a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "deployer"

# Highest first: a package may import those after it in this list (and itself).
ORDER = ("cli", "demo", "push", "pull", "release", "build", "config", "transport", "core")
BASE = {"deployer", "deployer.errors"}
ENTRY = "deployer.__main__"  # `python -m deployer`: the CLI by another name
AGENT_MAY_IMPORT = ("deployer.agent", "deployer.core", "deployer.errors")
# The agent's own layers, highest first: a unit (a folder or a top-level module of deployer/agent/)
# may import itself and any unit of a later layer, never one of its own layer or an earlier one.
AGENT_LAYERS = (
    ("cli",),
    ("http",),
    ("serving",),
    ("runtime",),
    ("engines", "openai"),
    ("chat",),
    ("ota", "settings", "notify", "types"),
)
ENGINE_FAMILIES = ("torch", "llamacpp")  # engines/<family>/: one engine each


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every `import deployer...` and `from deployer... import` in a file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("deployer"):
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and not node.level:
            module = node.module or ""
            if module.startswith("deployer"):
                yield node.lineno, module


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _agent_unit(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else ""


def _agent_violation(importer: str, imported: str) -> str | None:
    """The agent's inner order (AGENT_LAYERS), and inside engines/ the factory over the engines over
    what they share."""
    src, dst = _agent_unit(importer), _agent_unit(imported)
    if not dst or not src:
        return None if not dst else "deployer/agent/__init__ imports nothing"
    layer = {unit: i for i, units in enumerate(AGENT_LAYERS) for unit in units}
    if src not in layer or dst not in layer:
        return f"agent/{src or dst} is in no layer of AGENT_LAYERS (tests/layout/test_imports.py)"
    if src != dst and layer[dst] <= layer[src]:
        order = " → ".join(" | ".join(units) for units in AGENT_LAYERS)
        return f"agent/{src} may not import agent/{dst}: inside the agent imports flow {order}"
    if src == dst == "engines":
        return _engines_violation(importer.split(".")[3:], imported.split(".")[3:])
    return None


def _engines_violation(src: list[str], dst: list[str]) -> str | None:
    src_family = src[0] if src and src[0] in ENGINE_FAMILIES else None
    dst_family = dst[0] if dst and dst[0] in ENGINE_FAMILIES else None
    if not dst:
        return None if not src else "nothing in engines/ may import the factory (engines/__init__)"
    if dst_family and src_family != dst_family and src:
        return f"engines/{'/'.join(src)} may not import engines/{dst_family}/: each engine stands alone"
    return None


def _violation(importer: str, imported: str) -> str | None:
    if importer == ENTRY:
        return None if imported == "deployer.cli.main" else "__main__ only starts the CLI"
    if imported in BASE:
        return None
    if _package(importer) == _package(imported):
        return _agent_violation(importer, imported) if _package(importer) == "agent" else None
    src, dst = _package(importer), _package(imported)
    if src == "agent" or importer in BASE:
        allowed = any(imported == a or imported.startswith(a + ".") for a in AGENT_MAY_IMPORT)
        return None if allowed else f"the agent may import only {', '.join(AGENT_MAY_IMPORT)}"
    if dst == "agent":
        # The controller runs agents only in the demo (a local fleet) and reads none of their code.
        return None if src == "demo" else "only the demo starts agents; the controller imports none"
    if src not in ORDER or dst not in ORDER:
        return f"{src or dst!r} is not a known step of the data flow (tests/layout/test_imports.py)"
    if ORDER.index(dst) <= ORDER.index(src):
        return f"{src}/ may not import {dst}/: imports flow {' → '.join(ORDER)}"
    return None


def test_every_module_belongs_to_a_step() -> None:
    loose = [m for m in MODULES if m not in {*BASE, ENTRY} and _package(m) not in (*ORDER, "agent")]
    assert loose == [], f"modules outside the step folders: {loose}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_flow_one_way(module: str) -> None:
    problems = [
        f"{MODULES[module].relative_to(ROOT.parent)}:{line}: imports {imported}: {why}"
        for line, imported in _imports(MODULES[module])
        if (why := _violation(module, imported))
    ]
    assert problems == []


def test_no_two_modules_import_each_other() -> None:
    graph = {m: {i for _, i in _imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}
    # A package's __init__ re-exporting its own modules is not a cycle of responsibilities.
    pairs = sorted(
        (a, b)
        for a, deps in graph.items()
        for b in deps
        if a < b and a in graph.get(b, set()) and not (_is_init_of(a, b) or _is_init_of(b, a))
    )
    assert pairs == []


def _is_init_of(package: str, module: str) -> bool:
    return MODULES[package].name == "__init__.py" and module.startswith(package + ".")


def test_rules_catch_a_backward_import() -> None:
    assert _violation("deployer.release.desired", "deployer.cli.build_cmds")
    assert _violation("deployer.agent.cli", "deployer.cli.main")
    assert _violation("deployer.pull.promote", "deployer.push.fleet")
    assert _violation("deployer.push.fleet", "deployer.pull.publish") is None


def test_rules_catch_a_backward_import_inside_the_agent() -> None:
    assert _violation("deployer.agent.serving.fallback.metrics", "deployer.agent.http.metrics")
    assert _violation("deployer.agent.chat", "deployer.agent.engines.base")
    assert _violation("deployer.agent.settings", "deployer.agent.serving.fallback.source")
    assert _violation("deployer.agent.http.routes", "deployer.agent.openai.schemas") is None
    assert _violation("deployer.agent.openai.schemas", "deployer.agent.engines.base")  # peers
    assert _violation("deployer.agent.engines.base", "deployer.agent.engines.torch.engine")
    assert _violation("deployer.agent.engines.llamacpp.engine", "deployer.agent.engines.torch.loader")
    assert _violation("deployer.agent.engines.torch.engine", "deployer.agent.engines")
    assert _violation("deployer.agent.engines", "deployer.agent.engines.torch.engine") is None
    assert _violation("deployer.agent.http.server", "deployer.agent.ota.store") is None
