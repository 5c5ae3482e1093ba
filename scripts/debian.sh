# shellcheck shell=bash
# Sourced by tools.sh and image-tools.sh: install Debian packages quietly (as root, or with
# sudo), then stop the services the packages enable, since the scripts run these tools directly.
# Usage: debian_install "PACKAGES" "SERVICES"   (space-separated lists; SERVICES may be empty)
debian_install() {
  local packages=$1 services=$2 sudo_cmd="" svc
  echo "headroom: installing $packages from Debian" >&2
  export DEBIAN_FRONTEND=noninteractive
  [ "$(id -u)" = 0 ] || sudo_cmd=sudo
  # Another clone installing at the same time holds dpkg's lock: wait for it, not fail.
  local wait=(-o DPkg::Lock::Timeout=600)
  $sudo_cmd apt-get "${wait[@]}" update -qq >/dev/null
  # shellcheck disable=SC2086  # word splitting is the list
  $sudo_cmd apt-get "${wait[@]}" install -y -qq --no-install-recommends $packages >/dev/null
  for svc in $services; do
    $sudo_cmd systemctl disable --now "$svc" >/dev/null 2>&1 || true
    # Without systemd the package's daemon runs as its own system user: stop only that one,
    # never a same-named process of ours (a concurrent clone's test Prometheus).
    if id -u "$svc" >/dev/null 2>&1; then
      $sudo_cmd pkill -u "$svc" -x "$svc" >/dev/null 2>&1 || true
    fi
  done
}
