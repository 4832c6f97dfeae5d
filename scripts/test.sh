#!/usr/bin/env bash
# Set up (if needed) and run the linters and the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
ruff check deployer tests bench
ruff format --check deployer tests bench
mypy
actionlint
python -m pytest "$@"
