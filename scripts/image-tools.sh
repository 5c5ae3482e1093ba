#!/usr/bin/env bash
# Installs the Debian packages that build and run headroom's images with no Docker engine and
# no registry: mmdebstrap (the base root filesystem), buildah and podman, runc (crun fails on
# this machine's hybrid cgroups) and uidmap. Idempotent and quiet when they are present.
set -euo pipefail
need=()
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v buildah >/dev/null || need+=(buildah)
command -v podman >/dev/null || need+=(podman)
command -v runc >/dev/null || need+=(runc)
command -v newuidmap >/dev/null || need+=(uidmap)
if [ ${#need[@]} -gt 0 ]; then
  # shellcheck source=scripts/debian.sh
  . "$(dirname "$0")/debian.sh"
  # The podman package enables a socket and restart units; the scripts run podman directly.
  debian_install "${need[*]}" "podman.socket podman.service podman-restart.service"
fi
