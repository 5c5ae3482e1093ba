#!/usr/bin/env bash
# headroom's two images (see Dockerfile), built and run with no registry and no Docker engine:
#   scripts/image.sh all                  build, check and export both, then print times and sizes
#   scripts/image.sh build NAME...        build headroom and/or headroom-engine
#   scripts/image.sh check NAME           run it: headroom --help as uid 10001 on a read-only
#                                         root; headroom-engine serves the tiny model on /health
#   scripts/image.sh export NAME          write an OCI archive under $HEADROOM_CACHE/images
#   scripts/image.sh tags                 "NAME TAG" per image: what the chart and operator name
#   scripts/image.sh ref NAME             this checkout's own name for its last build of NAME
#   scripts/image.sh context NAME DIR     the build context of NAME (requirements, wheels, dist)
#   scripts/image.sh podman|buildah ARG.. either, with the repository's containers.conf and
#                                         storage.conf (the user's global config is never read)
# Everything lives under $HEADROOM_CACHE/containers (default ~/.cache/headroom): the base image,
# the layers and the wheels, so a second build is fast. HEADROOM_IMAGE_BASE names a registry
# base (docker.io/library/python:3.11.7-slim-bookworm) instead of the mmdebstrap one.
# Clones share that store: each checks, sizes and exports the image it built itself (`ref`),
# whichever clone last took the release tag.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export HEADROOM_CACHE=${HEADROOM_CACHE:-$HOME/.cache/headroom}
store=$HEADROOM_CACHE/containers
registry=${HEADROOM_IMAGE_REGISTRY:-ghcr.io/headroom-dev}
version=$(sed -n 's/^version = "\([^"]*\)"$/\1/p' "$root/pyproject.toml" | head -n1)
names=(headroom headroom-engine)
# Layer and file times: the last commit's, so the same tree builds the same layers.
epoch=${SOURCE_DATE_EPOCH:-$(git -C "$root" log -1 --format=%ct 2>/dev/null || echo 0)}

tag() { echo "$registry/$1:$version"; }
checkout=$(printf '%s' "$root" | sha256sum | cut -c1-12)
ref() { echo "localhost/headroom-checkout-$checkout/$1:$version"; }

# Seconds and archive per image, for the summary `all` prints.
declare -A built_s archive

say() { echo "headroom image: $*" >&2; }

known() {
  case "$1" in headroom | headroom-engine) ;; *)
    echo "scripts/image.sh: unknown image '$1' (known: ${names[*]})" >&2
    exit 2
    ;;
  esac
}

# The repository's containers.conf with this machine's hard limits filled in (containers.conf
# cannot read them): nofile at most `ulimit -Hn`, nproc at most `ulimit -Hu` and pid_max.
configure() {
  mkdir -p "$store"
  local nofile nproc pid_max
  nofile=$(ulimit -Hn)
  nproc=$(ulimit -Hu)
  pid_max=$(cat /proc/sys/kernel/pid_max)
  [ "$nofile" = unlimited ] && nofile=1048576
  [ "$nproc" = unlimited ] || [ "$nproc" -gt "$pid_max" ] && nproc=$pid_max
  sed -e "s/@NOFILE@/$nofile/g" -e "s/@NPROC@/$nproc/g" \
    "$root/scripts/containers/containers.conf" >"$store/containers.conf.$$"
  mv -f "$store/containers.conf.$$" "$store/containers.conf"
  export CONTAINERS_CONF=$store/containers.conf
  export CONTAINERS_STORAGE_CONF=$root/scripts/containers/storage.conf
  export BUILDAH_ISOLATION=oci
}

# localhost/headroom-base: Debian bookworm minbase with Python 3.11, made once per recipe (the
# tag carries the recipe's hash). Reproducible: the same SOURCE_DATE_EPOCH and mirror state
# give the same root filesystem, whose sha256 the image's label records.
base_image() {
  if [ -n "${HEADROOM_IMAGE_BASE:-}" ]; then
    echo "$HEADROOM_IMAGE_BASE"
    return
  fi
  local suites=(
    "deb http://deb.debian.org/debian bookworm main"
    "deb http://deb.debian.org/debian bookworm-updates main"
    "deb http://deb.debian.org/debian-security bookworm-security main"
  )
  # merged-usr: /bin -> usr/bin made by mmdebstrap, so usrmerge and the full perl it needs
  # (50 MB) stay out. No manuals, documentation (but the licences) or translations: 50 MB more.
  # shellcheck disable=SC2054  # the commas are mmdebstrap's package list
  local opts=(
    --variant=minbase --include=python3,python3-venv,ca-certificates
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias'
    --aptopt='Acquire::Retries "3"'
  )
  local recipe ref
  recipe=$(printf '%s\n' "${opts[@]}" "${suites[@]}" | sha256sum | cut -c1-12)
  ref=localhost/headroom-base:bookworm-$recipe
  exec 8>"$store/.base.lock"
  flock 8
  if ! podman image exists "$ref"; then
    local tmp start sum ctr=""
    tmp=$(mktemp -d "$store/base.XXXXXX")
    # This runs in `$(...)`: the trap is the subshell's, and a failure leaves no 130 MB tarball
    # or half-made container behind.
    # shellcheck disable=SC2064  # expand now: $tmp is local
    trap "rm -rf '$tmp'; [ -z \"\${ctr:-}\" ] || buildah rm \"\$ctr\" >/dev/null 2>&1" EXIT
    start=$SECONDS
    say "making the base root filesystem (mmdebstrap bookworm minbase, python3)"
    if ! SOURCE_DATE_EPOCH=$epoch mmdebstrap --quiet "${opts[@]}" bookworm "$tmp/rootfs.tar" \
      "${suites[@]}" >"$tmp/mmdebstrap.log" 2>&1; then
      cat "$tmp/mmdebstrap.log" >&2
      exit 1
    fi
    sum=$(sha256sum "$tmp/rootfs.tar" | cut -d' ' -f1)
    ctr=$(buildah from scratch)
    buildah add --quiet "$ctr" "$tmp/rootfs.tar" / >/dev/null
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      --env LANG=C.UTF-8 --cmd '["python3"]' \
      --label dev.headroom.rootfs-sha256="$sum" --label dev.headroom.source-date-epoch="$epoch" \
      "$ctr"
    buildah commit --quiet --rm --timestamp "$epoch" "$ctr" "$ref" >/dev/null
    ctr=""
    rm -rf "$tmp"
    trap - EXIT
    say "base $ref (rootfs sha256 $sum) in $((SECONDS - start)) s"
    # Bases of earlier recipes (an image still built on one keeps its layers).
    podman images --format '{{.Repository}}:{{.Tag}}' localhost/headroom-base |
      grep -vxF "$ref" | xargs -r podman rmi >/dev/null 2>&1 || true
  fi
  exec 8>&-
  echo "$ref"
}

# requirements/NAME.txt, wheels/ and dist/ in DIR: the lock exported with hashes, its wheels
# (downloaded once into $store/wheels, hash-checked by pip, hard-linked here) and this checkout.
context() {
  local name=$1 dir=$2 uv
  known "$name"
  uv=$("$root/scripts/uv.sh")
  mkdir -p "$dir/requirements" "$dir/wheels" "$dir/dist" "$store/wheels"
  local extras=()
  [ "$name" = headroom-engine ] && extras=(--extra engine --extra cuda)
  UV_CACHE_DIR=$HEADROOM_CACHE/uv UV_PYTHON_DOWNLOADS=never "$uv" export --project "$root" \
    --locked --no-dev --no-emit-project --no-header --quiet --format requirements-txt \
    "${extras[@]}" >"$dir/requirements/$name.txt"
  # A stamp per requirements file: a warm build neither asks the index nor rehashes GBs.
  local stamp
  stamp=$store/wheels/.complete-$(sha256sum <"$dir/requirements/$name.txt" | cut -c1-16)
  if [ ! -e "$stamp" ]; then
    say "downloading the wheels of $name (uv.lock, hash-checked)"
    (
      flock 9
      # The host's Python 3.11 picks the wheels for the image's (Debian 12: 3.11, glibc 2.36).
      "${HEADROOM_PYTHON:-python3.11}" -m pip download --quiet --disable-pip-version-check \
        --no-deps --require-hashes --only-binary=:all: --dest "$store/wheels" \
        -r "$dir/requirements/$name.txt"
    ) 9>"$store/.wheels.lock"
    touch "$stamp"
  fi
  # Hard links (no copy of GBs); a copy where DIR is on another file system.
  cp -al "$store/wheels/." "$dir/wheels/" 2>/dev/null || cp -a "$store/wheels/." "$dir/wheels/"
  cp "$dir/requirements/$name.txt" "$store/requirements-$name.txt"
  rm -f "$dir"/wheels/.complete-*
  SOURCE_DATE_EPOCH=$epoch UV_CACHE_DIR=$HEADROOM_CACHE/uv UV_PYTHON_DOWNLOADS=never \
    "$uv" build --quiet --python "${HEADROOM_PYTHON:-python3.11}" --out-dir "$dir/build" "$root"
  mv "$dir"/build/*.whl "$dir/dist/"
  rm -rf "$dir/build"
}

# Untags the builds of clones whose directory is gone (and refs no record owns: those of
# builds before the records), so that `podman image prune` can free their layers.
forget_gone_clones() {
  local image hash dir record
  podman images --format '{{.Repository}}:{{.Tag}}' \
    --filter "reference=localhost/headroom-checkout-*/*" 2>/dev/null |
    while read -r image; do
      case "$image" in localhost/headroom-checkout-*/*) ;; *) continue ;; esac
      hash=${image#localhost/headroom-checkout-}
      hash=${hash%%/*}
      [ "$hash" = "$checkout" ] && continue
      dir=$(cat "$store/checkouts/$hash" 2>/dev/null || true)
      [ -n "$dir" ] && [ -d "$dir" ] && continue
      # The name twice: `podman untag IMAGE` alone drops every name of the image, and a clone
      # of the same tree shares it (this checkout's ref and the release tag included).
      podman untag "$image" "$image" >/dev/null 2>&1 || true
    done
  for record in "$store"/checkouts/*; do
    [ -e "$record" ] || continue
    dir=$(cat "$record" 2>/dev/null || true)
    [ -n "$dir" ] && [ -d "$dir" ] || rm -f "$record"
  done
}

build() {
  local name=$1 ref ctx start
  known "$name"
  "$root/scripts/image-tools.sh"
  ref=$(base_image)
  start=$SECONDS
  ctx=$(mktemp -d "$store/context.XXXXXX")
  # shellcheck disable=SC2064  # expand now: the trap outlives this function's locals
  trap "rm -rf '$ctx'" EXIT
  context "$name" "$ctx"
  say "building $(tag "$name") from $ref"
  local log=$store/$name-$checkout.log
  # Which directory owns this checkout's refs: a record in the store, not an image label. A
  # clone's build of the same tree is a layer-cache hit that reuses the first clone's image,
  # labels included, so a label names whichever clone built it first.
  mkdir -p "$store/checkouts"
  printf '%s\n' "$root" >"$store/checkouts/$checkout"
  if ! buildah build --layers --force-rm --network none --target "$name" --build-arg BASE="$ref" \
    --timestamp "$epoch" -f "$root/Dockerfile" \
    -t "$(ref "$name")" -t "$(tag "$name")" "$ctx" >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "scripts/image.sh: building $name failed (log: $log)" >&2
    exit 1
  fi
  rm -rf "$ctx"
  trap - EXIT
  forget_gone_clones
  podman image prune --force >/dev/null 2>&1 || true
  built_s[$name]=$((SECONDS - start))
  say "built $(tag "$name") in ${built_s[$name]} s, $(size "$name")"
}

# Wheels that neither image's last requirements name (an older lock's torch is GBs), and the
# stamps of other requirements: the store holds one lock's wheels.
prune_wheels() {
  python3 - "$store/wheels" "$store"/requirements-*.txt <<'PY'
import hashlib, re, sys
from pathlib import Path

def key(name: str, version: str) -> str:
    return f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}"

store, *reqs = map(Path, sys.argv[1:])
texts = [r.read_bytes() for r in reqs]
pins = {key(*m) for t in texts for m in re.findall(r"^([A-Za-z0-9_.-]+)==([^ ;\\]+)", t.decode(), re.M)}
stamps = {f".complete-{hashlib.sha256(t).hexdigest()[:16]}" for t in texts}
for wheel in store.glob("*.whl"):
    if key(*wheel.name.split("-")[:2]) not in pins:
        wheel.unlink()
for stamp in store.glob(".complete-*"):
    if stamp.name not in stamps:
        stamp.unlink()
PY
}

size() {
  podman image inspect --format '{{.Size}}' "$(ref "$1")" |
    awk '{ printf "%.0f MB", $1 / 1e6 }'
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

check() {
  local name=$1
  known "$name"
  case "$name" in
  headroom)
    local out
    out=$(podman run --rm --read-only --user 10001:10001 "$(ref headroom)" --help)
    grep -q sidecar <<<"$out" || {
      echo "$out" >&2
      exit 1
    }
    say "headroom --help answers as uid 10001 on a read-only root"
    ;;
  headroom-engine)
    local port ctr start code
    port=$(free_port)
    ctr=headroom-image-check-$$
    start=$SECONDS
    podman run --detach --name "$ctr" --read-only --user 10001:10001 "$(ref headroom-engine)" \
      serve --model tiny --host 127.0.0.1 --port "$port" >/dev/null
    # shellcheck disable=SC2064  # expand now: $ctr is local
    trap "podman rm --force --time 0 '$ctr' >/dev/null 2>&1" EXIT
    until curl -fsS "http://127.0.0.1:$port/health" >/dev/null 2>&1; do
      if [ "$(podman inspect --format '{{.State.Running}}' "$ctr")" != true ] ||
        [ $((SECONDS - start)) -gt 300 ]; then
        podman logs "$ctr" >&2 || true
        echo "scripts/image.sh: the engine container never answered /health" >&2
        exit 1
      fi
      sleep 1
    done
    say "headroom-engine serve --model tiny answered /health after $((SECONDS - start)) s"
    # STOPSIGNAL SIGINT: the engine shuts down by itself; 137 would be the kill after 30 s.
    podman stop --time 30 "$ctr" >/dev/null
    code=$(podman inspect --format '{{.State.ExitCode}}' "$ctr")
    podman rm --force "$ctr" >/dev/null
    trap - EXIT
    if [ "$code" = 137 ]; then
      echo "scripts/image.sh: the engine ignored the stop signal and was killed" >&2
      exit 1
    fi
    say "headroom-engine stopped on SIGINT (exit $code)"
    ;;
  esac
}

export_archive() {
  local name=$1 out id
  known "$name"
  mkdir -p "$HEADROOM_CACHE/images"
  out=$HEADROOM_CACHE/images/$name-$version.oci.tar
  id=$(podman image inspect --format '{{.Id}}' "$(ref "$name")")
  # One archive per image, rewritten only when the image changed (the engine's takes minutes).
  # Under a lock, this checkout's image given the release tag just before it is saved.
  (
    flock 9
    if [ ! -e "$out" ] || [ "$(cat "$out.id" 2>/dev/null)" != "$id" ]; then
      rm -f "$out" "$out.id"
      podman tag "$id" "$(tag "$name")"
      podman save --quiet --format oci-archive -o "$out.part" "$(tag "$name")"
      mv -f "$out.part" "$out"
      echo "$id" >"$out.id"
    fi
  ) 9>"$out.lock"
  archive[$name]="$out ($(du -m "$out" | cut -f1) MB)"
  say "exported ${archive[$name]}"
}

configure
cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
tags) for n in "${names[@]}"; do echo "$n $(tag "$n")"; done ;;
ref)
  [ $# = 1 ] || {
    echo "usage: scripts/image.sh ref NAME" >&2
    exit 2
  }
  known "$1"
  ref "$1"
  ;;
podman | buildah) exec "$cmd" "$@" ;;
context)
  [ $# = 2 ] || {
    echo "usage: scripts/image.sh context NAME DIR" >&2
    exit 2
  }
  context "$1" "$2"
  ;;
build)
  [ $# -gt 0 ] || set -- "${names[@]}"
  for n in "$@"; do build "$n"; done
  ;;
check)
  [ $# -gt 0 ] || set -- "${names[@]}"
  for n in "$@"; do check "$n"; done
  ;;
export)
  [ $# -gt 0 ] || set -- "${names[@]}"
  for n in "$@"; do export_archive "$n"; done
  ;;
all)
  for n in "${names[@]}"; do build "$n"; done
  for n in "${names[@]}"; do check "$n"; done
  for n in "${names[@]}"; do export_archive "$n"; done
  prune_wheels
  printf '\n%-16s %-45s %8s %9s  %s\n' image tag build size "OCI archive"
  for n in "${names[@]}"; do
    printf '%-16s %-45s %6s s %9s  %s\n' "$n" "$(tag "$n")" "${built_s[$n]}" "$(size "$n")" \
      "${archive[$n]}"
  done
  ;;
*)
  [ -z "$cmd" ] || echo "scripts/image.sh: unknown command '$cmd'" >&2
  sed -n '2,14s/^# \{0,1\}//p' "$0" >&2
  exit 2
  ;;
esac
