"""Smoke test of the real control plane that e2e/cluster builds and starts.

CEL validation on a CRD, scheduling of GPU pods onto kwok nodes, garbage collection, helm, a
ServiceAccount kubeconfig under RBAC, and pod IPs that are loopback addresses. Timings are
printed (run with ``-s``), never asserted.
"""

from __future__ import annotations

import ipaddress
import json
import time
from typing import Any

import pytest

from e2e.cluster.harness import Cluster

pytest_plugins = ["e2e.cluster.pytest_plugin"]

pytestmark = pytest.mark.cluster

CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.smoke.headroom.dev
spec:
  group: smoke.headroom.dev
  scope: Namespaced
  names: {kind: Widget, plural: widgets, singular: widget, listKind: WidgetList}
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            required: [minReplicas, maxReplicas]
            x-kubernetes-validations:
            - rule: "self.minReplicas <= self.maxReplicas"
              message: "minReplicas must not exceed maxReplicas"
            properties:
              minReplicas: {type: integer, minimum: 0}
              maxReplicas: {type: integer, minimum: 0}
"""

WIDGET = """
apiVersion: smoke.headroom.dev/v1
kind: Widget
metadata:
  name: {name}
spec:
  minReplicas: {lo}
  maxReplicas: {hi}
"""

DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata:
  name: gpu-smoke
  labels: {app: gpu-smoke}
spec:
  replicas: 3
  selector:
    matchLabels: {app: gpu-smoke}
  template:
    metadata:
      labels: {app: gpu-smoke}
    spec:
      containers:
      - name: engine
        image: registry.invalid/headroom/engine:smoke
        resources:
          requests: {cpu: 100m, memory: 1Gi, nvidia.com/gpu: "2"}
          limits: {nvidia.com/gpu: "2"}
"""


def _eventually(what: str, check: object, timeout: float = 60, every: float = 0.3) -> None:
    assert callable(check)
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def test_timings(cluster: Cluster) -> None:
    res = cluster.build_result
    if res is not None:
        state = "built now" if res.cold else "cached"
        print(f"\n[cluster] binaries {state} in {res.bin_dir}; {res.recorded}")
        if res.cold:
            print(
                f"[cluster] this run's build took {res.seconds:.0f}s ({res.seconds / 60:.1f} min)"
            )
    if cluster.start_seconds is not None:
        print(f"[cluster] warm start of the control plane took {cluster.start_seconds:.1f}s")
    print(f"[cluster] {cluster.version} at {cluster.server}, components {cluster.pids}")
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == cluster.version


def test_kwok_nodes_advertise_gpus(cluster: Cluster) -> None:
    nodes = cluster.get("nodes")["items"]
    assert isinstance(nodes, list)
    kwok = [n for n in nodes if n["metadata"]["labels"].get("type") == "kwok"]
    assert kwok, "no kwok nodes registered"
    for n in kwok:
        assert n["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        assert n["metadata"]["labels"]["nvidia.com/gpu.count"] == "8"
        assert int(n["metadata"]["labels"]["nvidia.com/gpu.memory"]) >= 80 * 1000
        ready = {c["type"]: c["status"] for c in n["status"]["conditions"]}
        assert ready.get("Ready") == "True"


def test_crd_cel_validation(cluster: Cluster, cluster_namespace: str) -> None:
    cluster.apply(CRD)
    try:
        cluster.wait("--for=condition=Established", "crd/widgets.smoke.headroom.dev", timeout=60)

        def accepted() -> bool:
            proc = cluster.kubectl(
                "apply",
                "-n",
                cluster_namespace,
                "-f",
                "-",
                input=WIDGET.format(name="ok", lo=1, hi=3),
                check=False,
            )
            return proc.returncode == 0

        # The REST mapping of a new CRD reaches kubectl's discovery a moment after Established.
        _eventually("the valid Widget to be accepted", accepted, timeout=30)
        bad = cluster.kubectl(
            "apply",
            "-n",
            cluster_namespace,
            "-f",
            "-",
            input=WIDGET.format(name="bad", lo=5, hi=2),
            check=False,
        )
        assert bad.returncode != 0
        assert "minReplicas must not exceed maxReplicas" in bad.stderr, bad.stderr
        names = cluster.kubectl(
            "get", "widgets", "-n", cluster_namespace, "-o", "name"
        ).stdout.split()
        assert names == ["widget.smoke.headroom.dev/ok"]
    finally:
        cluster.kubectl("delete", "crd", "widgets.smoke.headroom.dev", "--wait=false", check=False)


def test_gpu_deployment_runs_and_is_garbage_collected(
    cluster: Cluster, cluster_namespace: str
) -> None:
    ns = cluster_namespace
    t0 = time.monotonic()
    cluster.apply(DEPLOYMENT, namespace=ns)
    cluster.wait("--for=condition=Available", "deployment/gpu-smoke", "-n", ns, timeout=90)
    cluster.wait("--for=jsonpath={.status.phase}=Running", "pod", "-l", "app=gpu-smoke", "-n", ns)
    print(f"\n[cluster] 3 GPU pods Running after {time.monotonic() - t0:.1f}s")
    pods = cluster.get("pods", namespace=ns)["items"]
    assert isinstance(pods, list) and len(pods) == 3
    for p in pods:
        assert p["status"]["phase"] == "Running"
        assert p["spec"]["nodeName"].startswith("kwok-gpu-")
        limits = p["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "2"
    assert cluster.get("replicasets", namespace=ns)["items"]

    t0 = time.monotonic()
    cluster.kubectl("delete", "deployment", "gpu-smoke", "-n", ns, "--wait=false")

    def collected() -> bool:
        out = cluster.kubectl("get", "replicasets,pods", "-n", ns, "-o", "name").stdout
        return out.strip() == ""

    _eventually("the ReplicaSet and pods to be garbage-collected", collected, timeout=90)
    print(f"[cluster] ReplicaSet and pods garbage-collected in {time.monotonic() - t0:.1f}s")


def test_helm_runs(cluster: Cluster) -> None:
    res = cluster.build_result
    if res is not None and "helm" in res.failed:
        from e2e.cluster.pytest_plugin import missing_piece

        missing_piece(f"helm could not be built; see {res.bin_dir}/.failed")
    out = cluster.helm("version", "--short").stdout
    assert out.startswith("v3."), out
    print(f"\n[cluster] helm {out.strip()}")
    assert cluster.helm("list", "-A").returncode == 0


def test_service_account_kubeconfig_obeys_rbac(cluster: Cluster, cluster_namespace: str) -> None:
    ns = cluster_namespace
    kc = cluster.sa_kubeconfig(ns, "robot")
    whoami = json.loads(cluster.kubectl("auth", "whoami", "-o", "json", kubeconfig=kc).stdout)
    assert whoami["status"]["userInfo"]["username"] == f"system:serviceaccount:{ns}:robot"
    denied = cluster.kubectl("get", "pods", "-n", ns, kubeconfig=kc, check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied.stderr
    cluster.kubectl(
        "create",
        "rolebinding",
        "robot-view",
        "-n",
        ns,
        "--clusterrole=view",
        f"--serviceaccount={ns}:robot",
    )
    _eventually(
        "the RoleBinding to take effect",
        lambda: (
            cluster.kubectl("get", "pods", "-n", ns, kubeconfig=kc, check=False).returncode == 0
        ),
        timeout=30,
    )


LOOPBACK = ipaddress.IPv4Network("127.0.0.0/8")

POD = """
apiVersion: v1
kind: Pod
metadata:
  name: {name}
  labels: {{app: ip-check}}
spec:
  nodeName: {node}
  hostNetwork: {host_network}
  containers:
  - name: c
    image: registry.invalid/headroom/ip-check:smoke
"""


def _pod_ips(pod: dict[str, Any]) -> list[str]:
    status = pod.get("status") or {}
    ips = [status.get("podIP"), status.get("hostIP")]
    ips += [x.get("ip") for x in status.get("podIPs") or []]
    ips += [x.get("ip") for x in status.get("hostIPs") or []]
    return [ip for ip in ips if ip]


def test_every_pod_and_node_ip_is_a_loopback_address(
    cluster: Cluster, cluster_namespace: str
) -> None:
    """Anything that talks to a pod (the operator polls <pod IP>:9090) must stay on the machine."""
    ns = cluster_namespace
    items: Any = cluster.get("nodes")["items"]
    nodes = sorted(
        n["metadata"]["name"] for n in items if n["metadata"]["labels"]["type"] == "kwok"
    )
    manifests = [
        POD.format(name=f"ip-{i}-{k}", node=node, host_network="false")
        for i, node in enumerate(nodes)
        for k in range(2)
    ]
    manifests.append(POD.format(name="ip-host", node=nodes[0], host_network="true"))
    cluster.apply("---".join(manifests), namespace=ns)
    cluster.wait("--for=jsonpath={.status.phase}=Running", "pod", "-l", "app=ip-check", "-n", ns)

    # Every pod of the cluster, not only this test's: any address outside 127/8 fails.
    everywhere = json.loads(cluster.kubectl("get", "pods", "-A", "-o", "json").stdout)["items"]
    outside = {
        f"{p['metadata']['namespace']}/{p['metadata']['name']} {ip}"
        for p in everywhere
        for ip in _pod_ips(p)
        if ipaddress.ip_address(ip) not in LOOPBACK
    }
    assert not outside, f"pod addresses outside 127.0.0.0/8: {sorted(outside)}"

    # Each node hands out its own /24 of the cluster's /16; no two pods share an IP.
    net = cluster.pod_network
    assert net.subnet_of(LOOPBACK), net
    cidrs: dict[str, ipaddress.IPv4Network] = {}
    for n in items:
        if n["metadata"]["name"] not in nodes:
            continue
        cidrs[n["metadata"]["name"]] = cidr = ipaddress.IPv4Network(n["spec"]["podCIDR"])
        assert cidr.subnet_of(net), (n["metadata"]["name"], cidr, net)
        for addr in n["status"]["addresses"]:
            if addr["type"] in ("InternalIP", "ExternalIP"):
                assert ipaddress.ip_address(addr["address"]) in net, addr
    assert len(set(cidrs.values())) == len(nodes), f"nodes share a podCIDR: {cidrs}"
    mine: Any = cluster.get("pods", namespace=ns)["items"]
    assert len(mine) == 2 * len(nodes) + 1
    pod_ips = [
        ipaddress.ip_address(p["status"]["podIP"]) for p in mine if not p["spec"].get("hostNetwork")
    ]
    for p in mine:
        ip = ipaddress.ip_address(p["status"]["podIP"])
        if not p["spec"].get("hostNetwork"):
            assert ip in cidrs[p["spec"]["nodeName"]], (p["metadata"]["name"], ip)
    assert len(set(pod_ips)) == len(pod_ips), f"two pods got the same IP: {pod_ips}"
    print(f"\n[cluster] pod IPs in {net}: {sorted(str(ip) for ip in pod_ips)}")
