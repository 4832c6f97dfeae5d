#!/bin/sh
# Example pre-deploy hook. sits-deployer runs it before a device is updated, with:
#   SITS_DEVICE        device name from deploy.yaml      SITS_HOST  its host (or "local")
#   SITS_FROM_VERSION  installed model version (empty on first install)
#   SITS_TO_VERSION    version being deployed            SITS_PHASE "pre-deploy"
# A non-zero exit stops the update of this device (it counts as a failure for the strategy).
set -eu

: "${SITS_DEVICE:?SITS_DEVICE is not set: run this hook through sits-deployer}"
: "${SITS_TO_VERSION:?SITS_TO_VERSION is not set}"

case "$SITS_TO_VERSION" in
  [0-9]*.[0-9]*.[0-9]*) ;;
  *) echo "pre-deploy: '$SITS_TO_VERSION' is not a semantic version" >&2; exit 1 ;;
esac

if [ "${SITS_FROM_VERSION:-}" = "$SITS_TO_VERSION" ]; then
  echo "pre-deploy: $SITS_DEVICE already runs $SITS_TO_VERSION"
fi
echo "pre-deploy: $SITS_DEVICE (${SITS_HOST:-local}) ${SITS_FROM_VERSION:-none} -> $SITS_TO_VERSION ok"
