#!/bin/sh
# Example post-deploy hook: a smoke test after a device reports the new version healthy.
# Environment: SITS_DEVICE, SITS_HOST, SITS_FROM_VERSION, SITS_TO_VERSION, SITS_PHASE
# ("post-deploy"). Set SITS_AGENT_URL (e.g. http://device:8080) to probe the agent's health.
# A non-zero exit marks the device failed; with auto_rollback it returns to the old version.
set -eu

: "${SITS_DEVICE:?SITS_DEVICE is not set: run this hook through sits-deployer}"

if [ -n "${SITS_AGENT_URL:-}" ] && command -v curl >/dev/null 2>&1; then
  curl --silent --show-error --fail --max-time 10 "$SITS_AGENT_URL/healthz" >/dev/null
  echo "post-deploy: $SITS_DEVICE answers at $SITS_AGENT_URL"
else
  echo "post-deploy: $SITS_DEVICE now on ${SITS_TO_VERSION:-?} (set SITS_AGENT_URL to probe it)"
fi
