#!/usr/bin/env bash
# Installs the Debian packages the tests drive for real (Prometheus, promtool, etcd) when missing.
set -euo pipefail
need=()
command -v prometheus >/dev/null || need+=(prometheus)
command -v promtool >/dev/null || need+=(prometheus)
command -v etcd >/dev/null || need+=(etcd-server)
command -v openssl >/dev/null || need+=(openssl)
if [ ${#need[@]} -gt 0 ]; then
  echo "headroom: installing ${need[*]} from Debian" >&2
  export DEBIAN_FRONTEND=noninteractive
  sudo_cmd=""
  [ "$(id -u)" = 0 ] || sudo_cmd=sudo
  $sudo_cmd apt-get update -qq >/dev/null
  # The prometheus package starts a system service by default; the tests start their own.
  $sudo_cmd apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  for svc in prometheus etcd; do
    $sudo_cmd systemctl disable --now "$svc" >/dev/null 2>&1 || true
    $sudo_cmd pkill -x "$svc" >/dev/null 2>&1 || true
  done
fi
