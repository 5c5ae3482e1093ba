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
  echo "headroom: installing ${need[*]} from Debian" >&2
  export DEBIAN_FRONTEND=noninteractive
  sudo_cmd=""
  [ "$(id -u)" = 0 ] || sudo_cmd=sudo
  $sudo_cmd apt-get update -qq >/dev/null
  $sudo_cmd apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  # The podman package enables a socket and restart units; the scripts run podman directly.
  for unit in podman.socket podman.service podman-restart.service; do
    $sudo_cmd systemctl disable --now "$unit" >/dev/null 2>&1 || true
  done
fi
