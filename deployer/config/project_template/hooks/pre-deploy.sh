#!/bin/sh
# Runs before each device is updated; a non-zero exit stops that device's update.
# Environment: SITS_DEVICE, SITS_HOST, SITS_FROM_VERSION, SITS_TO_VERSION, SITS_PHASE.
set -eu
echo "pre-deploy: ${SITS_DEVICE:-?} ${SITS_FROM_VERSION:-none} -> ${SITS_TO_VERSION:-?}"
