# Pinned versions of the test control plane; sourced by build.sh, up.sh and down.sh.
# Change a version here together with e2e/cluster/go/go.mod (the key below hashes go.mod/go.sum
# and the mains, so any change there builds into a new directory).
# shellcheck shell=bash
HR_K8S_VERSION=v1.36.3
HR_K8S_MINOR=1.36
HR_KWOK_VERSION=v0.8.0
HR_HELM_VERSION=v3.21.4
# etcd built from go.etcd.io/etcd/server/v3 at the version k8s.io/kubernetes pins: Debian's etcd
# 3.4.23 is too old for RequestWatchProgress (needs 3.4.31+/3.5.13+), without which the
# apiserver refuses the watch-list streams that client-go 0.36 informers open.
HR_ETCD_VERSION=v3.6.8
HR_BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok helm)

HR_CACHE="${HEADROOM_CACHE:-$HOME/.cache/headroom}"
_hr_here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# LC_ALL=C: the key must not follow the shell's collation (en_US sorts kubectl before kube-*).
_hr_key="$(cd "$_hr_here/go" && cat go.mod go.sum $(find cmd -name '*.go' | LC_ALL=C sort) \
  | sha256sum | cut -c1-10)"
HR_BIN_DIR="$HR_CACHE/bin/k8s-${HR_K8S_VERSION}_etcd-${HR_ETCD_VERSION}_kwok-${HR_KWOK_VERSION}_helm-${HR_HELM_VERSION}_${_hr_key}"
unset _hr_here _hr_key
