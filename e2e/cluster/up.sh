#!/usr/bin/env bash
# Start a real Kubernetes control plane for the tests, all on 127.0.0.1 with free ports:
# etcd (Debian's /usr/bin/etcd), kube-apiserver (RBAC + Node authorization, service-account
# issuer), kube-controller-manager, kube-scheduler and kwok, which runs fake nodes that advertise
# `nvidia.com/gpu: 8` and 80 GiB-class GPU labels and moves their pods to Running.
#
# Usage: up.sh [NAME]            (NAME defaults to $HEADROOM_CLUSTER_NAME or "default")
#
# Writes $DIR/cluster.env (KEY=value lines, sourceable by bash) where DIR is
# $HEADROOM_CLUSTER_DIR or ~/.cache/headroom/cluster/NAME. It holds KUBECONFIG, the API server
# URL, the bin directory and the pid of every process started here; down.sh reads it.
#
# Environment:
#   HEADROOM_CLUSTER_NAME   cluster name (default "default")
#   HEADROOM_CLUSTER_DIR    state directory (default ~/.cache/headroom/cluster/NAME)
#   HEADROOM_KWOK_NODES     number of fake GPU nodes (default 2)
#   HEADROOM_KWOK_POD_CIDR  the cluster's pod network, a /16 inside 127.0.0.0/8 (default: one
#                           picked from NAME that no other cluster here claims; see podnet.py).
#                           Node i gets podCIDR 127.X.(i+1).0/24 and kwok hands each pod an IP
#                           from its node's podCIDR, so every pod IP is a loopback address:
#                           nothing that talks to a pod (the operator's sidecar polls) can leave
#                           the machine. The nodes' address is 127.X.0.1.
#   HEADROOM_ETCD           etcd binary (default: the etcd build.sh builds; Debian's 3.4 is too old
#                           for the watch-list streams of 1.36 clients, see versions.sh)
#   HEADROOM_UP_TIMEOUT     seconds to wait for readiness (default 120)
set -Eeuo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.sh
source "$HERE/versions.sh"

NAME="${1:-${HEADROOM_CLUSTER_NAME:-default}}"
[[ "$NAME" =~ ^[a-zA-Z0-9][a-zA-Z0-9_.-]*$ ]] || { echo "bad cluster name: $NAME" >&2; exit 2; }
DIR="$(realpath -m "${HEADROOM_CLUSTER_DIR:-$HR_CACHE/cluster/$NAME}")"
NODES="${HEADROOM_KWOK_NODES:-2}"
POD_CIDR_WANTED="${HEADROOM_KWOK_POD_CIDR:-}"
TIMEOUT="${HEADROOM_UP_TIMEOUT:-120}"
ENVF="$DIR/cluster.env"

log() { echo "[cluster-up $NAME] $*" >&2; }
# proc_alive PID: the process exists and is not a zombie (exited, waiting to be reaped).
proc_alive() {
  local st
  st="$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)" || return 1
  [[ -n "$st" && "$st" != Z && "$st" != X ]]
}
t_start=$(date +%s%N)
elapsed() { local ms=$(( ($(date +%s%N) - t_start) / 1000000 )); printf '%d.%d' $(( ms / 1000 )) $(( ms % 1000 / 100 )); }

mkdir -p "$(dirname "$DIR")"
exec 8>"$DIR.lock"
flock 8  # one up.sh per cluster at a time

if [[ -f "$ENVF" ]]; then
  state="$(sed -n 's/^HEADROOM_CLUSTER_STATE=//p' "$ENVF")"
  pids="$(sed -n 's/^HEADROOM_CLUSTER_PIDS="\(.*\)"$/\1/p' "$ENVF")"
  all_alive=1
  for p in $pids; do proc_alive "${p#*:}" || all_alive=0; done
  if [[ "$state" == ready && $all_alive == 1 ]]; then
    log "already running (state in $DIR); run down.sh $NAME first to restart it"
    echo "$ENVF"
    exit 0
  fi
fi
if [[ -e "$DIR" ]]; then
  log "stale or half-started state in $DIR: stopping what is left of it and removing it"
  HEADROOM_KEEP_CLUSTER_DIR=0 "$HERE/down.sh" "$NAME"
  rm -rf "$DIR"
fi

command -v openssl >/dev/null || { log "FATAL: openssl not found (apt-get install openssl)"; exit 2; }
command -v curl >/dev/null || { log "FATAL: curl not found (apt-get install curl)"; exit 2; }
[[ "$NODES" =~ ^[0-9]+$ ]] && (( NODES >= 1 && NODES <= 254 )) \
  || { log "HEADROOM_KWOK_NODES must be 1..254 (one /24 of the pod network each), got $NODES"; exit 2; }

# ---- pod network: a loopback /16 of this cluster's own -----------------------------------------
# Claimed by writing it into the state directory while holding a lock that every up.sh shares,
# so two clusters starting at once do not pick the same one (podnet.py skips claimed ones).
mkdir -p "$DIR"
exec 7>"$(dirname "$DIR")/.pod-net.lock"
flock 7
POD_NET="$(python3 "$HERE/podnet.py" "$NAME" "$(dirname "$DIR")" "$DIR" "$POD_CIDR_WANTED")" \
  || { log "FATAL: no pod network (HEADROOM_KWOK_POD_CIDR=${POD_CIDR_WANTED:-unset})"
       rmdir "$DIR" 2>/dev/null; exit 2; }
echo "$POD_NET" >"$DIR/pod-net"
flock -u 7
exec 7>&-
POD_OCTET="$(cut -d. -f2 <<<"$POD_NET")"
NODE_IP="127.$POD_OCTET.0.1"

rc=0
BIN="$("$HERE/build.sh" | tail -1)" || rc=$?
# 3: some pieces failed (helm is optional for a running cluster; the check below is exact).
if [[ $rc != 0 && $rc != 3 ]]; then log "FATAL: build.sh failed (rc=$rc)"; exit 2; fi
for b in etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok; do
  [[ -x "$BIN/$b" ]] || { log "FATAL: $BIN/$b missing after build.sh"; exit 2; }
done
ETCD="${HEADROOM_ETCD:-$BIN/etcd}"
[[ -x "$ETCD" ]] || { log "FATAL: etcd not found at $ETCD"; exit 2; }
etcd_extra=()
# A throwaway test cluster needs no fsync (etcd 3.5+ has the flag; Debian's 3.4 does not).
if "$ETCD" --help 2>&1 | grep -q -- '--unsafe-no-fsync'; then etcd_extra+=(--unsafe-no-fsync); fi

mkdir -p "$DIR"/{pki,logs,pids,etcd}
chmod 700 "$DIR" "$DIR/etcd"
PKI="$DIR/pki"
PIDS=""

on_error() {
  local rc=$?
  log "FAILED (rc=$rc) after $(elapsed)s; last log lines:"
  for f in "$DIR"/logs/*.log; do
    [[ -f "$f" ]] || continue
    echo "----- $f" >&2
    tail -n 15 "$f" >&2
  done
  HEADROOM_KEEP_CLUSTER_DIR="${HEADROOM_KEEP_CLUSTER_DIR:-1}" "$HERE/down.sh" "$NAME" >&2 || true
  exit "$rc"
}
trap on_error ERR

# ---- free ports on 127.0.0.1 -------------------------------------------------------------------
free_ports() {
  python3 - "$1" <<'PY'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}
read -r ETCD_PORT ETCD_PEER_PORT APISERVER_PORT KCM_PORT SCHED_PORT KWOK_PORT <<<"$(free_ports 6)"
SERVER="https://127.0.0.1:$APISERVER_PORT"

# ---- PKI -----------------------------------------------------------------------------------------
ossl() { openssl "$@" 2>>"$DIR/logs/openssl.log"; }
# EC P-256 keys: generating them costs nothing, unlike RSA on a busy 2-core machine.
EC=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1)
ossl req -x509 -new -nodes "${EC[@]}" -keyout "$PKI/ca.key" -out "$PKI/ca.crt" -days 3650 \
  -subj "/CN=headroom-test-ca" >/dev/null
# The front-proxy CA signs the client certificate the apiserver uses towards aggregated APIs.
ossl req -x509 -new -nodes "${EC[@]}" -keyout "$PKI/front-proxy-ca.key" \
  -out "$PKI/front-proxy-ca.crt" -days 3650 -subj "/CN=headroom-test-front-proxy-ca" >/dev/null
# cert NAME CN ORG [SAN [CA]] : a key and a certificate signed by the CA (default "ca").
cert() {
  local name=$1 cn=$2 org=$3 san=${4:-} ca=${5:-ca} subj="/CN=$2" ext="$PKI/$1.ext"
  [[ -n "$org" ]] && subj="/O=$org/CN=$cn"
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature"
    if [[ -n "$san" ]]; then
      echo "extendedKeyUsage=serverAuth,clientAuth"
      [[ "$san" == none ]] || echo "subjectAltName=$san"
    else
      echo "extendedKeyUsage=clientAuth"
    fi
  } >"$ext"
  ossl req -new -nodes "${EC[@]}" -keyout "$PKI/$name.key" -out "$PKI/$name.csr" \
    -subj "$subj" >/dev/null
  ossl x509 -req -in "$PKI/$name.csr" -CA "$PKI/$ca.crt" -CAkey "$PKI/$ca.key" -CAcreateserial \
    -days 3650 -extfile "$ext" -out "$PKI/$name.crt" >/dev/null
  rm -f "$PKI/$name.csr" "$ext"
}
cert apiserver kube-apiserver "" \
  "IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
cert kcm-serving kube-controller-manager "" "IP:127.0.0.1,DNS:localhost"
cert sched-serving kube-scheduler "" "IP:127.0.0.1,DNS:localhost"
cert admin headroom-admin system:masters
cert kcm system:kube-controller-manager ""
cert scheduler system:kube-scheduler ""
cert kwok headroom-kwok system:masters
cert front-proxy-client front-proxy-client "" "" front-proxy-ca
ossl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:prime256v1 -out "$PKI/sa.key"
ossl pkey -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub"
chmod 600 "$PKI"/*.key

# kubeconfig FILE USER : a kubeconfig for USER's client certificate.
kubeconfig() {
  local file=$1 user=$2
  cat >"$file" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: headroom-$NAME
  cluster:
    server: $SERVER
    certificate-authority-data: $(base64 -w0 "$PKI/ca.crt")
users:
- name: $user
  user:
    client-certificate-data: $(base64 -w0 "$PKI/$user.crt")
    client-key-data: $(base64 -w0 "$PKI/$user.key")
contexts:
- name: headroom-$NAME
  context:
    cluster: headroom-$NAME
    user: $user
    namespace: default
current-context: headroom-$NAME
EOF
  chmod 600 "$file"
}
kubeconfig "$DIR/kubeconfig" admin
kubeconfig "$DIR/kcm.kubeconfig" kcm
kubeconfig "$DIR/scheduler.kubeconfig" scheduler
kubeconfig "$DIR/kwok.kubeconfig" kwok
log "certificates and kubeconfigs ready ($(elapsed)s)"

# ---- processes -------------------------------------------------------------------------------------
write_env() {
  cat >"$ENVF.tmp" <<EOF
HEADROOM_CLUSTER_NAME=$NAME
HEADROOM_CLUSTER_DIR=$DIR
HEADROOM_CLUSTER_BIN=$BIN
KUBECONFIG=$DIR/kubeconfig
HEADROOM_KUBE_SERVER=$SERVER
HEADROOM_KUBE_VERSION=$HR_K8S_VERSION
HEADROOM_ETCD_URL=http://127.0.0.1:$ETCD_PORT
HEADROOM_KWOK_POD_NET=$POD_NET
HEADROOM_CLUSTER_PIDS="${PIDS# }"
HEADROOM_CLUSTER_STATE=${1:-starting}
EOF
  mv "$ENVF.tmp" "$ENVF"
}
# start NAME CMD... : run CMD in its own session, logs to logs/NAME.log, pid recorded.
start() {
  local name=$1
  shift
  # 8>&-: the daemons must not inherit (and so hold) this script's lock.
  setsid "$@" >"$DIR/logs/$name.log" 2>&1 </dev/null 8>&- &
  local pid=$!
  echo "$pid" >"$DIR/pids/$name.pid"
  PIDS="$PIDS $name:$pid"
  write_env
}
alive() { proc_alive "$(cat "$DIR/pids/$1.pid")" || { log "$1 exited; see $DIR/logs/$1.log"; return 1; }; }
# wait_for WHAT COMPONENT CMD... : poll CMD until it succeeds or TIMEOUT passes; fail at once
# if COMPONENT ("-" for none) has exited.
wait_for() {
  local what=$1 comp=$2 deadline=$(( $(date +%s) + TIMEOUT ))
  shift 2
  until "$@" >/dev/null 2>&1; do
    if [[ "$comp" != - ]] && ! alive "$comp"; then return 1; fi
    if (( $(date +%s) > deadline )); then log "timed out after ${TIMEOUT}s waiting for $what"; return 1; fi
    sleep 0.2
  done
  log "$what ready ($(elapsed)s)"
}
KC=("$BIN/kubectl" --kubeconfig "$DIR/kubeconfig")

start etcd "$ETCD" --name headroom --data-dir "$DIR/etcd" \
  --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-cluster "headroom=http://127.0.0.1:$ETCD_PEER_PORT" --initial-cluster-state new \
  --logger zap --log-outputs stderr --quota-backend-bytes 2147483648 "${etcd_extra[@]}"
wait_for etcd etcd curl -sf "http://127.0.0.1:$ETCD_PORT/health"

start kube-apiserver "$BIN/kube-apiserver" \
  --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
  --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$APISERVER_PORT" \
  --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" \
  --client-ca-file "$PKI/ca.crt" \
  --requestheader-client-ca-file "$PKI/front-proxy-ca.crt" \
  --requestheader-allowed-names front-proxy-client \
  --requestheader-username-headers X-Remote-User --requestheader-group-headers X-Remote-Group \
  --requestheader-extra-headers-prefix X-Remote-Extra- \
  --proxy-client-cert-file "$PKI/front-proxy-client.crt" \
  --proxy-client-key-file "$PKI/front-proxy-client.key" \
  --authorization-mode Node,RBAC \
  --enable-admission-plugins NodeRestriction \
  --service-account-issuer https://kubernetes.default.svc.cluster.local \
  --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
  --service-cluster-ip-range 10.96.0.0/16 \
  --endpoint-reconciler-type none \
  --allow-privileged=true \
  --profiling=false \
  --v=1
wait_for kube-apiserver kube-apiserver "${KC[@]}" get --raw=/readyz

start kube-controller-manager "$BIN/kube-controller-manager" \
  --kubeconfig "$DIR/kcm.kubeconfig" \
  --authentication-kubeconfig "$DIR/kcm.kubeconfig" --authorization-kubeconfig "$DIR/kcm.kubeconfig" \
  --bind-address 127.0.0.1 --secure-port "$KCM_PORT" \
  --tls-cert-file "$PKI/kcm-serving.crt" --tls-private-key-file "$PKI/kcm-serving.key" \
  --leader-elect=false \
  --use-service-account-credentials=true \
  --service-account-private-key-file "$PKI/sa.key" --root-ca-file "$PKI/ca.crt" \
  --cluster-signing-cert-file "$PKI/ca.crt" --cluster-signing-key-file "$PKI/ca.key" \
  --controllers '*,-nodeipam' \
  --profiling=false \
  --v=1
start kube-scheduler "$BIN/kube-scheduler" \
  --kubeconfig "$DIR/scheduler.kubeconfig" \
  --authentication-kubeconfig "$DIR/scheduler.kubeconfig" \
  --authorization-kubeconfig "$DIR/scheduler.kubeconfig" \
  --bind-address 127.0.0.1 --secure-port "$SCHED_PORT" \
  --tls-cert-file "$PKI/sched-serving.crt" --tls-private-key-file "$PKI/sched-serving.key" \
  --leader-elect=false \
  --profiling=false \
  --v=1
start kwok "$BIN/kwok" \
  --kubeconfig "$DIR/kwok.kubeconfig" \
  --config "$HERE/kwok-stages.yaml" \
  --manage-all-nodes=false \
  --manage-nodes-with-annotation-selector kwok.x-k8s.io/node=fake \
  --node-lease-duration-seconds 40 \
  --cidr "127.$POD_OCTET.255.0/24" --node-ip "$NODE_IP" \
  --server-address "127.0.0.1:$KWOK_PORT"

wait_for kube-controller-manager kube-controller-manager \
  curl -sf --cacert "$PKI/ca.crt" "https://127.0.0.1:$KCM_PORT/healthz"
wait_for kube-scheduler kube-scheduler \
  curl -sf --cacert "$PKI/ca.crt" "https://127.0.0.1:$SCHED_PORT/healthz"
alive kwok

# ---- fake GPU nodes ------------------------------------------------------------------------------
nodes_yaml() {
  local i
  for (( i = 0; i < NODES; i++ )); do
    cat <<EOF
---
apiVersion: v1
kind: Node
metadata:
  name: kwok-gpu-$i
  annotations:
    node.alpha.kubernetes.io/ttl: "0"
    kwok.x-k8s.io/node: fake
  labels:
    type: kwok
    kubernetes.io/arch: amd64
    kubernetes.io/os: linux
    kubernetes.io/hostname: kwok-gpu-$i
    node-role.kubernetes.io/agent: ""
    node.kubernetes.io/instance-type: kwok-8x-h100-80gb
    nvidia.com/gpu.present: "true"
    nvidia.com/gpu.count: "8"
    nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3
    nvidia.com/gpu.memory: "81559"
    nvidia.com/gpu.family: hopper
    headroom.dev/gpu-memory-gib: "80"
spec:
  podCIDR: 127.$POD_OCTET.$(( i + 1 )).0/24
  podCIDRs: [127.$POD_OCTET.$(( i + 1 )).0/24]
status:
  capacity: &res
    cpu: "96"
    memory: 1536Gi
    ephemeral-storage: 4Ti
    pods: "110"
    nvidia.com/gpu: "8"
  allocatable: *res
EOF
  done
}
nodes_yaml | "${KC[@]}" apply -f - >/dev/null
# Make sure the GPU capacity is on the node status even if the create dropped it.
for (( i = 0; i < NODES; i++ )); do
  gpus="$("${KC[@]}" get node "kwok-gpu-$i" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}')"
  if [[ "$gpus" != "8" ]]; then
    "${KC[@]}" patch node "kwok-gpu-$i" --subresource=status --type=merge -p \
      '{"status":{"capacity":{"cpu":"96","memory":"1536Gi","ephemeral-storage":"4Ti","pods":"110","nvidia.com/gpu":"8"},"allocatable":{"cpu":"96","memory":"1536Gi","ephemeral-storage":"4Ti","pods":"110","nvidia.com/gpu":"8"}}}' \
      >/dev/null
  fi
done
wait_for "$NODES kwok GPU node(s)" kwok \
  "${KC[@]}" wait --for=condition=Ready node -l type=kwok --timeout=2s
wait_for "default ServiceAccount" kube-controller-manager \
  "${KC[@]}" -n default get serviceaccount default
alive kwok

write_env ready
trap - ERR
log "control plane up in $(elapsed)s: $SERVER (KUBECONFIG=$DIR/kubeconfig), pod IPs in $POD_NET"
echo "$ENVF"
