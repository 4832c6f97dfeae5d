#!/usr/bin/env bash
# Set up (if needed) and run the linters and the whole test suite. Extra arguments go to pytest.
# --fast (first argument): the linters, then only the tests that need no real model, no device lab
# and no nginx and are not long (the markers in pyproject.toml, which tests/conftest.py applies from
# the fixtures a test uses and its LONG list): day-to-day work. CI runs everything.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tier=()
if [ "${1:-}" = --fast ]; then
    shift
    tier=(-m "not slow and not lab and not nginx and not long")
fi
source scripts/setup.sh
ruff check deployer tests bench
ruff format --check deployer tests bench
mypy
actionlint
python -m pytest "${tier[@]}" "$@"
