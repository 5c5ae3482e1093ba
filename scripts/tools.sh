#!/usr/bin/env bash
# Installs the Debian packages the tests drive for real (Prometheus, promtool) and the tools the
# cluster scripts use (openssl, curl) when missing. etcd is built with the control plane.
set -euo pipefail
need=()
command -v prometheus >/dev/null || need+=(prometheus)
command -v promtool >/dev/null || need+=(prometheus)
command -v openssl >/dev/null || need+=(openssl)
command -v curl >/dev/null || need+=(curl)
command -v g++ >/dev/null || need+=(g++)
if [ ${#need[@]} -gt 0 ]; then
  echo "headroom: installing ${need[*]} from Debian" >&2
  export DEBIAN_FRONTEND=noninteractive
  sudo_cmd=""
  [ "$(id -u)" = 0 ] || sudo_cmd=sudo
  $sudo_cmd apt-get update -qq >/dev/null
  # The prometheus package starts a system service by default; the tests start their own.
  $sudo_cmd apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  for svc in prometheus; do
    $sudo_cmd systemctl disable --now "$svc" >/dev/null 2>&1 || true
    $sudo_cmd pkill -x "$svc" >/dev/null 2>&1 || true
  done
fi
