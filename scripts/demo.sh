#!/usr/bin/env bash
# Set up (if needed) and run the demo: a local fleet on this machine, with the embedded model.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
exec sits-deployer demo "$@"
