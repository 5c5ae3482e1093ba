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
  # shellcheck source=scripts/debian.sh
  . "$(dirname "$0")/debian.sh"
  # The prometheus package starts a system service by default; the tests start their own. Only
  # a run that installs it stops that service: one that adds curl leaves the host's alone.
  services=""
  [[ " ${need[*]} " == *" prometheus "* ]] && services=prometheus
  debian_install "${need[*]}" "$services"
fi
