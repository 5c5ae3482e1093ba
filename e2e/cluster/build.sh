#!/usr/bin/env bash
# Build the test control plane's binaries (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl, kwok, helm) from the Go module in e2e/cluster/go, through the Go
# module proxy, into a versioned directory under ~/.cache/headroom/bin that is reused.
#
# Idempotent: when the versioned directory is complete it prints its path and exits at once.
# Prints the directory on the last line of stdout (the harness reads it), and how long the
# cold build took. Exit status: 0 all built; 2 the build is impossible here (no Go, Go too old);
# 3 some pieces failed to build: "FAILED PIECES: ..." on stderr, their errors in DIR/.failed,
# the pieces that did build in DIR; anything else: an unexpected error.
#
# Environment:
#   HEADROOM_CACHE   cache root (default ~/.cache/headroom)
#   HEADROOM_GO_P    parallel Go build actions (default: number of CPUs, at most 2)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.sh
source "$HERE/versions.sh"

log() { echo "[cluster-build] $*" >&2; }

if [[ -f "$HR_BIN_DIR/.complete" ]]; then
  ok=1
  for b in "${HR_BINARIES[@]}"; do [[ -x "$HR_BIN_DIR/$b" ]] || ok=0; done
  if [[ $ok == 1 ]]; then
    log "binaries present in $HR_BIN_DIR (warm; nothing to build)"
    echo "$HR_BIN_DIR"
    exit 0
  fi
fi

command -v go >/dev/null 2>&1 || { log "FATAL: the Go toolchain (go) is not on PATH"; exit 2; }
need_go="1.26"
have_go="$(go env GOVERSION | sed 's/^go//')"
if [[ "$(printf '%s\n%s\n' "$need_go" "$have_go" | sort -V | head -1)" != "$need_go" ]]; then
  log "FATAL: Go $have_go is older than $need_go, which k8s.io/kubernetes $HR_K8S_VERSION needs"
  exit 2
fi

export GOMODCACHE="$HR_CACHE/go/mod"
export GOCACHE="$HR_CACHE/go/build"
export CGO_ENABLED=0
export GOTOOLCHAIN=local
export GOFLAGS="-mod=readonly -trimpath -buildvcs=false"
mkdir -p "$GOMODCACHE" "$GOCACHE" "$(dirname "$HR_BIN_DIR")"

ncpu="$(nproc 2>/dev/null || echo 2)"
par="${HEADROOM_GO_P:-$(( ncpu < 2 ? ncpu : 2 ))}"

lock="$HR_CACHE/bin/.build.lock"
exec 9>"$lock"
if ! flock -n 9; then
  log "another build holds $lock; waiting for it"
  flock 9
fi
# Checked again under the lock, also when it came at once: a build may have finished between
# the check above and the lock, and rebuilding would replace binaries its tests are using.
if [[ -f "$HR_BIN_DIR/.complete" ]]; then echo "$HR_BIN_DIR"; exit 0; fi

start=$(date +%s)
# "cold" only when the Go build cache starts empty; otherwise it is a rebuild on a warm cache.
if [[ -n "$(ls -A "$GOCACHE" 2>/dev/null | grep -v README | head -1)" ]]; then kind=rebuild; else kind=cold; fi
tmp="$HR_BIN_DIR.tmp.$$"
rm -rf "$tmp"
mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT

cd "$HERE/go"
log "downloading modules through $(go env GOPROXY) (cache $GOMODCACHE)"
t0=$(date +%s)
go mod download
log "modules ready in $(( $(date +%s) - t0 ))s"

kv="component-base/version"
k8s_ld="-X k8s.io/$kv.gitVersion=$HR_K8S_VERSION -X k8s.io/$kv.gitMajor=${HR_K8S_MINOR%%.*}"
k8s_ld+=" -X k8s.io/$kv.gitMinor=${HR_K8S_MINOR#*.} -X k8s.io/$kv.gitTreeState=clean"
k8s_ld+=" -X k8s.io/$kv.buildDate=1970-01-01T00:00:00Z"
k8s_ld+=" -X k8s.io/client-go/pkg/version.gitVersion=$HR_K8S_VERSION"
k8s_ld+=" -X k8s.io/client-go/pkg/version.gitMajor=${HR_K8S_MINOR%%.*}"
k8s_ld+=" -X k8s.io/client-go/pkg/version.gitMinor=${HR_K8S_MINOR#*.}"
helm_ld="-X helm.sh/helm/v3/internal/version.version=$HR_HELM_VERSION"
helm_ld+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"

# package of each binary
declare -A PKG=(
  [etcd]=go.etcd.io/etcd/server/v3
  [kube-apiserver]=./cmd/kube-apiserver
  [kube-controller-manager]=./cmd/kube-controller-manager
  [kube-scheduler]=./cmd/kube-scheduler
  [kubectl]=./cmd/kubectl
  [helm]=helm.sh/helm/v3/cmd/helm
  [kwok]=sigs.k8s.io/kwok/cmd/kwok
)
ldflags="-s -w $k8s_ld $helm_ld"

log "building ${HR_BINARIES[*]}" \
  "(k8s $HR_K8S_VERSION, etcd $HR_ETCD_VERSION, kwok $HR_KWOK_VERSION, helm $HR_HELM_VERSION; -p=$par, ${ncpu} CPUs)"
t0=$(date +%s)
# One invocation, so the shared k8s.io packages compile once; helm and kwok are built from their
# own main packages (the go.mod `tool` entries) against this module's pinned k8s.io versions.
pkgs=()
for b in "${HR_BINARIES[@]}"; do pkgs+=("${PKG[$b]}"); done
failed=()
if go build -p "$par" -ldflags "$ldflags" -o "$tmp/" "${pkgs[@]}"; then
  mv "$tmp/server" "$tmp/etcd"  # go names go.etcd.io/etcd/server/v3's binary "server"
else
  log "the combined build failed; building each piece alone to tell which cannot be built"
  for b in "${HR_BINARIES[@]}"; do
    rm -f "$tmp/$b"
    if ! go build -p "$par" -ldflags "$ldflags" -o "$tmp/$b" "${PKG[$b]}" 2>"$tmp/.$b.err"; then
      failed+=("$b")
      { echo "== $b (${PKG[$b]}):"; tail -n 20 "$tmp/.$b.err"; } >>"$tmp/.failed"
    fi
    rm -f "$tmp/.$b.err"
  done
fi
log "compiled and linked in $(( $(date +%s) - t0 ))s"

if (( ${#failed[@]} )); then
  cat "$tmp/.failed" >&2
  rm -rf "$HR_BIN_DIR"
  mv "$tmp" "$HR_BIN_DIR"
  trap - EXIT
  log "FAILED PIECES: ${failed[*]} (details in $HR_BIN_DIR/.failed); the others are in $HR_BIN_DIR"
  echo "$HR_BIN_DIR"
  exit 3
fi
"$tmp/etcd" --version >&2
"$tmp/kube-apiserver" --version >&2
"$tmp/kubectl" version --client >&2 || true
"$tmp/helm" version --short >&2 || true

rm -rf "$HR_BIN_DIR"
mv "$tmp" "$HR_BIN_DIR"
trap - EXIT
elapsed=$(( $(date +%s) - start ))
echo "$kind build: ${elapsed}s on ${ncpu} CPUs" > "$HR_BIN_DIR/.complete"
log "$kind build took ${elapsed}s ($(( elapsed / 60 ))m$(( elapsed % 60 ))s) on ${ncpu} CPUs -> $HR_BIN_DIR"
echo "$HR_BIN_DIR"
