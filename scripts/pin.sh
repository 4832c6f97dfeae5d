#!/usr/bin/env bash
# Rewrite constraints.txt from what .venv holds now: run it after changing a dependency in
# pyproject.toml and running scripts/setup.sh (tests/test_dependency_pins.py fails until then).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SITS_VENV:-$ROOT/.venv}"
{
    cat <<'HEADER'
# The exact versions scripts/setup.sh installs into .venv (pip's -c), so a fresh clone tests what
# main was tested with, whatever PyPI has released since. `pip install sits-deployer` follows
# pyproject.toml's ranges instead; a device's wheelhouse, the versions its controller runs. Written
# by scripts/pin.sh; not by hand.
HEADER
    # Our own llama-cpp-python build (scripts/llamacpp.sh) is pinned there, by its patches' hash;
    # torch's local label (+cpu) names the build on this disk, not a version PyPI has.
    "$VENV/bin/pip" freeze --exclude-editable | grep -iv '^llama.cpp.python' | sed 's/+cpu$//'
} > "$ROOT/constraints.txt"
