#!/bin/sh
# The pre-deploy hook of the seed example: refuse to deploy while a database migration that the
# new model version depends on has not been applied. Set SITS_DB_MIGRATION_MARKER to a file that
# your migration job writes when it finishes; without it the check passes (demo mode).
# Environment: SITS_DEVICE, SITS_HOST, SITS_FROM_VERSION, SITS_TO_VERSION, SITS_PHASE.
set -eu

marker="${SITS_DB_MIGRATION_MARKER:-}"
if [ -n "$marker" ] && [ ! -f "$marker" ]; then
  echo "pre-deploy: migration marker $marker missing; not deploying ${SITS_TO_VERSION:-?} to ${SITS_DEVICE:-?}" >&2
  exit 1
fi
echo "pre-deploy: database migration check passed for ${SITS_DEVICE:-?}"
