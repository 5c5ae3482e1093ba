"""The real operator against a real control plane (kube-apiserver, controller-manager, kwok).

It runs in this process (kopf in a thread, so the scaling tests can feed it KV metrics: kwok pods
run nothing and their IPs are fake) under a ServiceAccount bound to exactly the ClusterRole of
`headroom.operator.rbac`, so a missing verb fails here. One test runs `python -m
headroom.operator operator` as a subprocess, the way the chart runs it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kopf._core.reactor import observation
from prometheus_client import generate_latest

from e2e.cluster.harness import Cluster
from headroom.operator import observers
from headroom.operator.crd.models import InferenceDeploymentSpec
from headroom.operator.crd.schema import CRD_NAME, crd_yaml
from headroom.operator.handlers import FINALIZER, Context, Options, operate
from headroom.operator.kube import Kube, load_configuration
from headroom.operator.rbac import cluster_role
from headroom.operator.reconcile.children import FIELD_MANAGER, SELECTOR_LABEL
from headroom.operator.reconcile.sizing import budget, size
from headroom.operator.scaling.decide import PodSample
from headroom.operator.scaling.exporter import OperatorMetrics
from headroom.operator.scaling.metrics_sources import PodInfo, ScrapeTarget
from headroom.operator.status import SCALING_MANAGER

pytest_plugins = ["e2e.cluster.pytest_plugin"]
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[1]
SA_NAMESPACE = "headroom-operator-test"
SPEC: dict[str, Any] = {
    "model": {"preset": "llama-3.1-8b"},
    "gpu": {"type": "h100-80gb"},
    "traffic": {"peakConcurrency": 50, "contextTokens": 4096},
    "scaling": {"minReplicas": 1, "maxReplicas": 3, "intervalSeconds": 1},
}


def eventually(what: str, probe: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def get(cluster: Cluster, kind: str, name: str, ns: str) -> dict[str, Any] | None:
    proc = cluster.kubectl(
        "get", kind, name, "-n", ns, "-o", "json", "--show-managed-fields", check=False
    )
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return dict(c)
    return {}


def apply_cr(cluster: Cluster, ns: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    cluster.apply(
        [{"apiVersion": "headroom.dev/v1alpha1", "kind": "InferenceDeployment",
          "metadata": {"name": name, "namespace": ns}, "spec": spec}]
    )  # fmt: skip
    obj = get(cluster, "infd", name, ns)
    assert obj is not None
    return obj


class Levels:
    """KV figures the test sets per InferenceDeployment; what its 'sidecars' report."""

    def __init__(self) -> None:
        self.by_target: dict[tuple[str, str], tuple[float, float | None] | None] = {}

    async def sample(self, target: ScrapeTarget, pods: list[PodInfo]) -> dict[str, PodSample]:
        level = self.by_target.get((target.namespace, target.name))
        if level is None:
            return {}
        occ, eta = level
        return {
            p.name: PodSample(occupancy=occ, sampled_at=time.time(), eta_seconds=eta,
                              hit_ratio=0.5)
            for p in pods if p.ready
        }  # fmt: skip


class InProcessOperator:
    """`operate()` in a thread with its own event loop; stop() ends it cleanly."""

    def __init__(self, kubeconfig: Path, levels: Levels, namespaces: tuple[str, ...] = ("t-*",)):
        self.kubeconfig = kubeconfig
        self.levels = levels
        self.namespaces = list(namespaces)
        self.metrics = OperatorMetrics()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self) -> None:
        self.stop_flag, self.ready_flag = threading.Event(), threading.Event()
        options = Options(namespaces=self.namespaces, metrics_port=0)
        kube = Kube(load_configuration(str(self.kubeconfig)), discovery_ttl=1.0)

        def source(kind: str, ctx: Context) -> Levels:
            return self.levels

        def run() -> None:
            try:
                asyncio.run(
                    operate(options, kube=kube, metrics=self.metrics, source_factory=source,
                            stop_flag=self.stop_flag, ready_flag=self.ready_flag)
                )  # fmt: skip
            except BaseException as exc:  # surfaced by check()
                self.error = exc

        self.thread = threading.Thread(target=run, name="headroom-operator", daemon=True)
        self.thread.start()
        assert self.ready_flag.wait(60), f"operator did not start: {self.error!r}"

    def check(self) -> None:
        assert self.error is None, f"operator crashed: {self.error!r}"
        assert self.thread is not None and self.thread.is_alive(), "operator thread exited"

    def stop(self) -> None:
        self.stop_flag.set()
        assert self.thread is not None
        self.thread.join(60)
        assert not self.thread.is_alive(), "operator did not stop within 60 s"


@pytest.fixture(scope="module")
def operator_kubeconfig(cluster: Cluster) -> Path:
    """The CRD installed, and a ServiceAccount bound to exactly the operator's ClusterRole."""
    cluster.apply(crd_yaml())
    cluster.wait("--for=condition=Established", f"crd/{CRD_NAME}", timeout=60)
    if cluster.kubectl("get", "namespace", SA_NAMESPACE, check=False).returncode != 0:
        cluster.create_namespace(SA_NAMESPACE)
    role = cluster_role("headroom-operator-test")
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "headroom-operator-test"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "headroom-operator-test"},
        "subjects": [{"kind": "ServiceAccount", "name": "operator", "namespace": SA_NAMESPACE}],
    }  # fmt: skip
    kc = cluster.sa_kubeconfig(SA_NAMESPACE, "operator")
    cluster.apply([role, binding])
    return kc


@pytest.fixture(scope="module")
def levels() -> Levels:
    return Levels()


def terminating_test_namespaces(cluster: Cluster) -> list[str]:
    """Test namespaces (t-*) still being deleted, e.g. by an earlier test module."""
    items = json.loads(cluster.kubectl("get", "namespaces", "-o", "json").stdout)["items"]
    return [
        ns["metadata"]["name"]
        for ns in items
        if ns["metadata"]["name"].startswith("t-") and ns["status"].get("phase") == "Terminating"
    ]


@pytest.fixture(scope="module")
def operator(
    cluster: Cluster, operator_kubeconfig: Path, levels: Levels
) -> Iterator[InProcessOperator]:
    # Earlier modules delete their namespaces without waiting. An operator started among their
    # dying objects adopts them (finalizer, failing applies into a terminating namespace) and
    # that interference has delayed this module's first reconcile past its timeout in CI.
    eventually("earlier test namespaces to finish terminating",
               lambda: not terminating_test_namespaces(cluster), timeout=120)  # fmt: skip
    op = InProcessOperator(operator_kubeconfig, levels)
    op.start()
    yield op
    op.stop()


def reconciled(cluster: Cluster, ns: str, name: str, want: str = "True") -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        obj = get(cluster, "infd", name, ns)
        return obj if condition(obj, "Feasible").get("status") == want else None

    return dict(eventually(f"{ns}/{name} Feasible={want}", probe))


def test_children_owner_references_budget_and_readiness(
    cluster: Cluster, operator: InProcessOperator, cluster_namespace: str
) -> None:
    ns = cluster_namespace
    created = apply_cr(cluster, ns, "chat", SPEC)
    obj = reconciled(cluster, ns, "chat")
    uid = created["metadata"]["uid"]
    for kind in ("deployment", "service", "poddisruptionbudget"):
        child = eventually(f"the {kind}", lambda kind=kind: get(cluster, kind, "chat", ns))
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["uid"], ref["kind"], ref["controller"]) == (uid, "InferenceDeployment", True)
        managers = {e["manager"] for e in child["metadata"]["managedFields"]}
        assert FIELD_MANAGER in managers
    dep = get(cluster, "deployment", "chat", ns)
    assert dep is not None
    engine = dep["spec"]["template"]["spec"]["containers"][0]
    args = engine["args"]
    planned = budget(size(InferenceDeploymentSpec.model_validate(obj["spec"]))).wire()
    assert obj["status"]["budget"] == planned  # what `headroom plan` computes for this spec
    assert args[args.index("--num-blocks") + 1] == str(planned["kvBlocksPerPod"])
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert dep["spec"]["replicas"] == planned["sizedReplicas"] == 1
    assert obj["status"]["selector"] == "headroom.dev/inferencedeployment=chat"
    ready = eventually(
        "Ready=True (kwok runs the pod)",
        lambda: condition(get(cluster, "infd", "chat", ns), "Ready").get("status") == "True",
    )
    assert ready
    events = cluster.kubectl(
        "get", "events", "-n", ns, "--field-selector", "involvedObject.name=chat", "-o", "json"
    ).stdout
    reasons = {e["reason"] for e in json.loads(events)["items"]}
    assert {"Sized", "Created"} <= reasons
    table = cluster.kubectl("get", "infd", "chat", "-n", ns).stdout
    assert "True" in table.splitlines()[1]
    operator.check()


def test_a_namespace_created_while_the_operator_starts_is_watched(
    cluster: Cluster, operator_kubeconfig: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kopf lists the namespaces, then lists them again as its watch starts and took nothing
    from that second listing: a namespace created between the two was never watched (CI saw
    the first reconcile of this module time out). The window is held open here: the namespace
    is created after the first listing, before the watch starts."""
    for name, original in observers.ORIGINALS.items():  # operate() itself must amend kopf
        monkeypatch.setattr(observation, name, original)
    listed, created = threading.Event(), threading.Event()
    watcher = observation.queueing.watcher

    async def late_watch(**kwargs: Any) -> None:
        if kwargs["resource"].plural == "namespaces":
            listed.set()
            while not created.is_set():
                await asyncio.sleep(0.05)
        await watcher(**kwargs)

    monkeypatch.setattr(observation.queueing, "watcher", late_watch)
    pattern = f"late-{os.getpid() % 100000}-*"
    ns = pattern.replace("*", str(int(time.time() * 1000) % 100000))
    op = InProcessOperator(operator_kubeconfig, Levels(), namespaces=(pattern,))
    op.start()
    try:
        assert listed.wait(60), "kopf's namespace watch never started"
        cluster.create_namespace(ns)
        created.set()
        apply_cr(cluster, ns, "late", SPEC)
        reconciled(cluster, ns, "late")
        op.check()
        # While this operator runs, so its finalizer is removed and the namespace can go.
        cluster.kubectl("delete", "infd", "late", "-n", ns, "--timeout=60s")
    finally:
        op.stop()
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_never_writes_spec(
    cluster: Cluster, operator: InProcessOperator, cluster_namespace: str
) -> None:
    ns = cluster_namespace
    apply_cr(cluster, ns, "gitops", SPEC)
    reconciled(cluster, ns, "gitops")
    time.sleep(5)  # several scaling ticks and status writes
    obj = get(cluster, "infd", "gitops", ns)
    assert obj is not None
    assert obj["metadata"]["generation"] == 1, "spec changed after creation"
    assert obj["metadata"].get("finalizers") == [FINALIZER]
    for entry in obj["metadata"]["managedFields"]:
        fields = entry.get("fieldsV1", {})
        if "f:spec" in fields:
            assert entry["manager"].startswith("kubectl"), entry
        if entry["manager"].startswith("kubectl"):
            continue
        # The operator's own writes: status, and the finalizer in metadata, nothing else.
        assert set(fields) <= {"f:status", "f:metadata"}, entry
        assert set(fields.get("f:metadata", {})) <= {"f:finalizers"}, entry
    applied = cluster.kubectl(
        "diff", "-f", "-", input=yaml.safe_dump(
            {"apiVersion": "headroom.dev/v1alpha1", "kind": "InferenceDeployment",
             "metadata": {"name": "gitops", "namespace": ns}, "spec": SPEC}
        ), check=False,
    )  # fmt: skip
    assert applied.returncode == 0, f"kubectl diff sees drift:\n{applied.stdout}"


def test_infeasible_spec_then_the_fix(
    cluster: Cluster, operator: InProcessOperator, cluster_namespace: str
) -> None:
    ns = cluster_namespace
    spec = {**SPEC, "model": {"preset": "llama-3.1-70b"}}
    apply_cr(cluster, ns, "big", spec)
    obj = reconciled(cluster, ns, "big", want="False")
    feasible = condition(obj, "Feasible")
    assert feasible["reason"] == "Infeasible"
    assert "weights 131.4 GiB/GPU" in feasible["message"] and "tp" in feasible["message"]
    assert condition(obj, "Ready")["reason"] == "Infeasible"
    time.sleep(2)
    assert get(cluster, "deployment", "big", ns) is None
    cluster.kubectl(
        "patch", "infd", "big", "-n", ns, "--type", "merge",
        "-p", json.dumps({"spec": {"gpu": {"type": "h100-80gb", "countPerPod": 4},
                                   "model": {"path": "/models/70b"},
                                   "engine": {"runtime": "sglang"}}}),
    )  # fmt: skip
    obj = reconciled(cluster, ns, "big")
    assert condition(obj, "Feasible")["observedGeneration"] == 2
    assert obj["status"]["budget"]["feasible"] is True
    assert "reason" not in obj["status"]["budget"]  # the infeasible verdict does not linger
    dep = eventually("the Deployment after the fix", lambda: get(cluster, "deployment", "big", ns))
    limits = dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "4"
    operator.check()


def test_scales_out_before_the_wall_and_holds_without_metrics(
    cluster: Cluster, operator: InProcessOperator, levels: Levels, cluster_namespace: str
) -> None:
    ns = cluster_namespace
    apply_cr(cluster, ns, "hot", SPEC)
    reconciled(cluster, ns, "hot")
    eventually(
        "the pod to be ready",
        lambda: condition(get(cluster, "infd", "hot", ns), "Ready").get("status") == "True",
    )
    # 90 % of the pool in use and no demand counters: the KV in use is the demand, and its
    # upper band does not fit one pod.
    levels.by_target[(ns, "hot")] = (0.9, 60.0)

    def scaled() -> bool:
        dep = get(cluster, "deployment", "hot", ns)
        return bool(dep and dep["spec"]["replicas"] >= 2)

    eventually("the operator to scale the Deployment out", scaled)
    obj = get(cluster, "infd", "hot", ns)
    assert obj is not None
    st = obj["status"]
    rec = st["lastDecisions"][0]
    assert rec["from"] == 1 and rec["to"] >= 2 and rec["applied"] is True
    assert rec["reason"] in ("KVForecast", "HighOccupancy") and rec["inputs"]["readyReplicas"] == 1
    # Replicas changed through the scale subresource, under the scaling loop's own manager.
    dep = get(cluster, "deployment", "hot", ns)
    assert dep is not None and any(
        e["manager"] == SCALING_MANAGER and e.get("subresource") == "scale"
        for e in dep["metadata"]["managedFields"]
    )
    assert st["kv"]["occupancyPercent"] == 90 and st["kv"]["hitPercent"] == 50
    events = json.loads(cluster.kubectl(
        "get", "events", "-n", ns, "--field-selector", "involvedObject.name=hot", "-o", "json"
    ).stdout)["items"]  # fmt: skip
    assert any(e["reason"] == "ScaledOut" for e in events)

    levels.by_target[(ns, "hot")] = None  # the sidecars go silent

    def limited() -> dict[str, Any]:
        c = condition(get(cluster, "infd", "hot", ns), "ScalingLimited")
        return c if c.get("reason") == "MetricsUnavailable" else {}

    c = eventually("ScalingLimited=MetricsUnavailable", limited)
    assert c["status"] == "True"
    # Read once the loop holds: a tick that read 90 % just before the sidecars went silent
    # may still land its scale-out (the new pod is ready at once on kwok) after that moment.
    before = get(cluster, "deployment", "hot", ns)
    assert before is not None
    time.sleep(3)
    after = get(cluster, "deployment", "hot", ns)
    assert after is not None and after["spec"]["replicas"] == before["spec"]["replicas"]
    operator.check()


def test_advisory_publishes_and_leaves_replicas_alone(
    cluster: Cluster, operator: InProcessOperator, levels: Levels, cluster_namespace: str
) -> None:
    ns = cluster_namespace
    spec = {**SPEC, "scaling": {**SPEC["scaling"], "mode": "advisory"}}
    apply_cr(cluster, ns, "adv", spec)
    reconciled(cluster, ns, "adv")
    dep = eventually("the Deployment", lambda: get(cluster, "deployment", "adv", ns))
    assert "replicas" not in {k for e in dep["metadata"]["managedFields"]
                              if e["manager"] == FIELD_MANAGER
                              for k in e.get("fieldsV1", {}).get("f:spec", {})}  # fmt: skip
    levels.by_target[(ns, "adv")] = (0.95, 20.0)

    def advised() -> dict[str, Any] | None:
        obj = get(cluster, "infd", "adv", ns)
        st = (obj or {}).get("status") or {}
        return obj if st.get("desiredReplicas", 0) > st.get("replicas", 0) else None

    obj = eventually("an advisory decision", advised)
    time.sleep(2)
    dep = get(cluster, "deployment", "adv", ns)
    assert dep is not None and dep["spec"]["replicas"] == 1
    assert condition(obj, "ScalingLimited")["reason"] == "Advisory"
    assert obj["status"]["lastDecisions"][-1]["applied"] is False
    text = generate_latest(operator.metrics.registry).decode()
    want = (
        f'headroom_desired_replicas{{inferencedeployment="adv",mode="advisory",namespace="{ns}"}} '
        f"{float(obj['status']['desiredReplicas'])}"
    )
    assert want in text
    operator.check()


def test_an_hpa_scales_an_advisory_inference_deployment_through_its_scale_subresource(
    cluster: Cluster, operator: InProcessOperator, cluster_namespace: str
) -> None:
    ns = cluster_namespace
    spec = {**SPEC, "scaling": {**SPEC["scaling"], "mode": "advisory"}}
    apply_cr(cluster, ns, "hpa", spec)
    reconciled(cluster, ns, "hpa")
    scale = f"/apis/headroom.dev/v1alpha1/namespaces/{ns}/inferencedeployments/hpa/scale"
    # Without spec.replicas the API server cannot answer /scale (the README says to set it).
    unset = cluster.kubectl("get", "--raw", scale, check=False)
    assert unset.returncode != 0 and ".spec.replicas" in unset.stderr, unset.stderr
    cluster.kubectl("patch", "infd", "hpa", "-n", ns, "--type", "merge",
                    "-p", json.dumps({"spec": {"replicas": 1}}))  # fmt: skip
    hpa = {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "hpa", "namespace": ns},
        "spec": {"scaleTargetRef": {"apiVersion": "headroom.dev/v1alpha1",
                                    "kind": "InferenceDeployment", "name": "hpa"},
                 "minReplicas": 2, "maxReplicas": 3,
                 "metrics": [{"type": "Resource", "resource": {
                     "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 50}}}]},
    }  # fmt: skip
    cluster.apply([hpa])

    def got_scale() -> bool:
        h = json.loads(cluster.kubectl("get", "hpa", "hpa", "-n", ns, "-o", "json").stdout)
        conds = {c["type"]: c for c in (h.get("status") or {}).get("conditions") or []}
        able = conds.get("AbleToScale", {})
        return able.get("status") == "True"

    eventually("the HPA to read the InferenceDeployment's /scale", got_scale, timeout=90)
    # Below its minReplicas, the HPA writes spec.replicas through /scale; the operator follows
    # it onto the Deployment (advisory mode, within min/max).
    eventually("the Deployment to follow the HPA",
               lambda: (d := get(cluster, "deployment", "hpa", ns)) and d["spec"]["replicas"] == 2,
               timeout=90)  # fmt: skip
    obj = get(cluster, "infd", "hpa", ns)
    assert obj is not None and obj["spec"]["replicas"] == 2
    operator.check()


def test_an_infeasible_spec_is_not_ready_and_leaves_the_running_deployment(
    cluster: Cluster, operator: InProcessOperator, cluster_namespace: str
) -> None:
    """A GitOps commit that cannot fit: nothing is applied, the old Deployment keeps running,
    and `Ready` is False (Infeasible) for the new generation, so `kubectl apply && kubectl
    wait --for=condition=Ready` does not pass for a spec that never ran. The fix brings it
    back."""
    ns = cluster_namespace
    apply_cr(cluster, ns, "stale", SPEC)
    eventually("Ready", lambda: condition(get(cluster, "infd", "stale", ns), "Ready").get("status")
               == "True")  # fmt: skip
    before = get(cluster, "deployment", "stale", ns)
    assert before is not None
    cluster.kubectl("patch", "infd", "stale", "-n", ns, "--type", "merge",
                    "-p", json.dumps({"spec": {"traffic": {"contextTokens": 200000}}}))  # fmt: skip

    def infeasible(ready_message: str) -> Callable[[], dict[str, Any] | None]:
        def probe() -> dict[str, Any] | None:
            obj = get(cluster, "infd", "stale", ns)
            ready = condition(obj, "Ready")
            return obj if (
                obj is not None
                and obj["status"].get("observedGeneration") == 2
                and (ready.get("status"), ready.get("reason")) == ("False", "Infeasible")
                and ready.get("observedGeneration") == 2
                and ready.get("message", "").endswith(ready_message)
            ) else None  # fmt: skip

        return probe

    obj = eventually("Ready=False/Infeasible for generation 2", infeasible("1/1 replicas ready"))
    assert obj["metadata"]["generation"] == 2
    assert "keeps its last feasible configuration" in condition(obj, "Ready")["message"]
    assert condition(obj, "Feasible")["reason"] == "Infeasible"
    # What a GitOps pipeline runs after its apply: it must not pass (the scaling ticks, every
    # second here, and the Deployment's watch all keep it False).
    waited = cluster.kubectl("wait", "--for=condition=Ready", "infd/stale", "-n", ns,
                             "--timeout=3s", check=False)  # fmt: skip
    assert waited.returncode != 0, f"kubectl wait passed: {waited.stdout}{waited.stderr}"
    after = get(cluster, "deployment", "stale", ns)
    assert after is not None
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert after["spec"]["template"] == before["spec"]["template"], "the Deployment was changed"
    nodes = [n["metadata"]["name"] for n in json.loads(
        cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]]  # fmt: skip
    try:
        for node in nodes:  # the pod's replacement cannot schedule
            cluster.kubectl("cordon", node)
        cluster.kubectl("delete", "pod", "-n", ns, "-l", f"{SELECTOR_LABEL}=stale", "--wait=true")
        # The message follows the running Deployment.
        obj = eventually("Ready's message to follow the running Deployment",
                         infeasible("0/1 replicas ready"))  # fmt: skip
    finally:
        for node in nodes:
            cluster.kubectl("uncordon", node)
    assert obj["status"]["readyReplicas"] == 0
    assert condition(obj, "ScalingLimited")["reason"] == "Infeasible"
    # The fix: a feasible generation is applied and reads Ready off its Deployment again.
    cluster.kubectl("patch", "infd", "stale", "-n", ns, "--type", "merge",
                    "-p", json.dumps({"spec": {"traffic": {"contextTokens": 4096}}}))  # fmt: skip

    def ready_again() -> dict[str, Any] | None:
        obj = get(cluster, "infd", "stale", ns)
        ready = condition(obj, "Ready")
        fixed = (ready.get("status"), ready.get("observedGeneration")) == ("True", 3)
        return obj if fixed else None

    obj = eventually("Ready=True for the fixed generation 3", ready_again, timeout=90)
    assert condition(obj, "Feasible")["status"] == "True"
    operator.check()


def test_restart_is_idempotent(
    cluster: Cluster, operator: InProcessOperator, cluster_namespace: str
) -> None:
    ns = cluster_namespace
    apply_cr(cluster, ns, "steady", SPEC)
    reconciled(cluster, ns, "steady")
    before = {
        kind: eventually(kind, lambda kind=kind: get(cluster, kind, "steady", ns))
        for kind in ("deployment", "service", "poddisruptionbudget")
    }
    operator.stop()
    operator.start()
    time.sleep(6)  # resume handlers and a few ticks
    for kind, old in before.items():
        new = get(cluster, kind, "steady", ns)
        assert new is not None
        # A server-side apply that changes nothing neither bumps generation nor the spec.
        assert new["metadata"].get("generation") == old["metadata"].get("generation"), kind
        assert new["spec"] == old["spec"], kind
    obj = get(cluster, "infd", "steady", ns)
    assert obj is not None and obj["metadata"]["generation"] == 1
    operator.check()


def test_garbage_collected_on_delete(
    cluster: Cluster, operator: InProcessOperator, cluster_namespace: str
) -> None:
    ns = cluster_namespace
    apply_cr(cluster, ns, "gone", SPEC)
    reconciled(cluster, ns, "gone")
    eventually("the Deployment", lambda: get(cluster, "deployment", "gone", ns))
    cluster.kubectl("delete", "infd", "gone", "-n", ns, "--wait=false")

    def collected() -> bool:
        return all(
            get(cluster, kind, "gone", ns) is None
            for kind in ("infd", "deployment", "service", "poddisruptionbudget")
        )

    assert eventually("the CR (finalizer released) and its children to go", collected, 90)
    operator.check()


def _stub_crd(kind: str, plural: str) -> dict[str, Any]:
    """A schemaless stand-in for a Prometheus operator CRD (only its presence matters)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com",
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": plural[:-1],
                      "listKind": f"{kind}List"},
            "versions": [{"name": "v1", "served": True, "storage": True, "schema": {
                "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
            }}],
        },
    }  # fmt: skip


STUB_CRDS = [
    _stub_crd("ServiceMonitor", "servicemonitors"),
    _stub_crd("PrometheusRule", "prometheusrules"),
]


def test_monitoring_children_when_the_prometheus_operator_crds_exist(
    cluster: Cluster, operator: InProcessOperator, cluster_namespace: str
) -> None:
    ns = cluster_namespace
    cluster.apply(STUB_CRDS)
    try:
        for crd in STUB_CRDS:
            cluster.wait("--for=condition=Established", f"crd/{crd['metadata']['name']}")
        apply_cr(cluster, ns, "watched", SPEC)
        reconciled(cluster, ns, "watched")
        for kind in ("servicemonitor", "prometheusrule"):
            child = eventually(kind, lambda kind=kind: get(cluster, kind, "watched", ns), 60)
            assert child["metadata"]["ownerReferences"][0]["name"] == "watched"
        rule = get(cluster, "prometheusrule", "watched", ns)
        assert rule is not None
        alerts = [r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]]
        assert "HeadroomKVSaturationSoon" in alerts
    finally:
        for crd in STUB_CRDS:
            cluster.kubectl("delete", "crd", crd["metadata"]["name"], "--wait=false", check=False)
    operator.check()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return str(resp.read().decode())
    except OSError:
        return None


def test_headroom_operator_command(
    cluster: Cluster, operator_kubeconfig: Path, tmp_path: Path
) -> None:
    ns = f"cli-{os.getpid() % 100000}"
    cluster.create_namespace(ns)
    metrics, health = free_port(), free_port()
    log = (tmp_path / "operator.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "headroom.operator", "operator", "--namespace", ns,
         "--kubeconfig", str(operator_kubeconfig), "--metrics-port", str(metrics),
         "--liveness-port", str(health), "--log-format", "json"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "KUBECONFIG": "/nonexistent"},
    )  # fmt: skip
    try:
        eventually("/healthz", lambda: http_get(f"http://127.0.0.1:{health}/healthz"), 90)
        apply_cr(cluster, ns, "cli", SPEC)
        reconciled(cluster, ns, "cli")
        eventually("the Deployment", lambda: get(cluster, "deployment", "cli", ns))
        text = eventually(
            "operator metrics",
            lambda: (t := http_get(f"http://127.0.0.1:{metrics}/metrics")) and
            "headroom_desired_replicas{" in t and t,
        )  # fmt: skip
        assert 'headroom_reconciles_total{result="ok"}' in text

        # The stall alert's clock: ticks complete (a decision with its status written), so it
        # moves on from the loop's start, at this machine's Unix time.
        def last_tick() -> float | None:
            found = re.search(
                r'headroom_scaling_last_tick_timestamp_seconds\{[^}]*inferencedeployment="cli"'
                r"[^}]*\} (\S+)",
                http_get(f"http://127.0.0.1:{metrics}/metrics"),
            )
            return float(found.group(1)) if found else None

        first = eventually("a tick's time", last_tick)
        later = eventually("a later tick", lambda: (t := last_tick()) and t > first and t)
        assert abs(later - time.time()) < 60
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    logs = (tmp_path / "operator.log").read_text()
    assert rc == 0, logs[-3000:]
    assert "Traceback" not in logs, logs[-3000:]


def _events(cluster: Cluster, ns: str, name: str) -> list[dict[str, Any]]:
    out = cluster.kubectl(
        "get", "events", "-n", ns, "--field-selector", f"involvedObject.name={name}", "-o", "json"
    ).stdout
    return list(json.loads(out)["items"])


def test_each_new_resource_is_reconciled_once(
    cluster: Cluster, operator: InProcessOperator, cluster_namespace: str
) -> None:
    ns = cluster_namespace
    apply_cr(cluster, ns, "once", SPEC)
    reconciled(cluster, ns, "once")
    eventually("the Deployment", lambda: get(cluster, "deployment", "once", ns))
    time.sleep(4)  # several scaling ticks, none of which may reconcile a second time
    created = [e for e in _events(cluster, ns, "once") if e["reason"] == "Created"]
    assert sum(int(e.get("count") or 1) for e in created) == 1, created
    operator.check()


def test_drift_on_the_owned_deployment_is_undone(
    cluster: Cluster, operator: InProcessOperator, cluster_namespace: str
) -> None:
    ns = cluster_namespace
    apply_cr(cluster, ns, "drift", SPEC)
    reconciled(cluster, ns, "drift")
    dep = eventually("the Deployment", lambda: get(cluster, "deployment", "drift", ns))
    containers = dep["spec"]["template"]["spec"]["containers"]
    image = {c["name"]: c["image"] for c in containers}
    engine = containers[0]["name"]
    cluster.kubectl("set", "image", "deployment/drift", f"{engine}=busybox:drifted", "-n", ns)

    def restored() -> bool:
        d = get(cluster, "deployment", "drift", ns)
        cs = (d or {}).get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
        return {c["name"]: c["image"] for c in cs} == image

    eventually("the operator to put the image back", restored)
    cluster.kubectl("delete", "deployment", "drift", "-n", ns)
    eventually("the operator to re-create the Deployment",
               lambda: (d := get(cluster, "deployment", "drift", ns)) and
               not d["metadata"].get("deletionTimestamp"))  # fmt: skip
    operator.check()


def test_ready_follows_the_deployment_between_ticks_and_waits_for_a_stuck_rollout(
    cluster: Cluster, operator: InProcessOperator, cluster_namespace: str
) -> None:
    """Ready came only from the reconcile and the scaling tick: with a long interval,
    `kubectl wait --for=condition=Ready` waited the whole interval after the pod was ready.
    And it read `readyReplicas` alone, so a rollout whose new pods never start (here a PVC
    that does not exist) said Ready=True for the new generation on the previous spec's pod."""
    ns = cluster_namespace
    spec = {**SPEC, "scaling": {**SPEC["scaling"], "intervalSeconds": 600}}
    apply_cr(cluster, ns, "ready", spec)
    reconciled(cluster, ns, "ready")
    obj = eventually(
        "Ready=True long before the next tick (600 s)",
        lambda: (o := get(cluster, "infd", "ready", ns))
        and condition(o, "Ready").get("status") == "True" and o,
    )  # fmt: skip
    assert obj["status"]["readyReplicas"] == 1
    managers = {e["manager"] for e in obj["metadata"]["managedFields"]}
    assert "headroom-readiness" in managers, managers

    cluster.kubectl("patch", "infd", "ready", "-n", ns, "--type", "merge",
                    "-p", '{"spec":{"model":{"volumeClaimName":"no-such-pvc"}}}')  # fmt: skip

    def rolling_out() -> dict[str, Any] | None:
        o = get(cluster, "infd", "ready", ns)
        ready = condition(o, "Ready")
        generation = (o or {}).get("metadata", {}).get("generation")
        stuck = ready.get("reason") == "RollingOut" and ready.get("observedGeneration") == 2
        return o if generation == 2 and stuck else None

    obj = eventually("Ready=False RollingOut for the new generation", rolling_out)
    assert condition(obj, "Ready")["status"] == "False"
    time.sleep(3)  # the previous spec's pod stays ready; Ready must not come back
    assert condition(get(cluster, "infd", "ready", ns), "Ready")["reason"] == "RollingOut"

    cluster.kubectl("patch", "infd", "ready", "-n", ns, "--type", "json",
                    "-p", '[{"op":"remove","path":"/spec/model/volumeClaimName"}]')  # fmt: skip
    eventually(
        "Ready=True once the rollout to the fixed spec completes",
        lambda: (c := condition(get(cluster, "infd", "ready", ns), "Ready"))
        and c.get("status") == "True" and c.get("observedGeneration") == 3,
    )  # fmt: skip
    operator.check()


def test_a_deleted_service_and_pdb_come_back_at_the_next_resync(
    cluster: Cluster, operator: InProcessOperator, cluster_namespace: str
) -> None:
    """Only Deployments are watched: the resync daemon re-applies the rest. Run here with a
    1 s period beside the in-process operator, against the same API server."""
    import kopf
    from kopf._cogs.aiokits import aioenums
    from kopf._core.intents import stoppers

    from headroom.operator import handlers

    ns = cluster_namespace
    apply_cr(cluster, ns, "lost", SPEC)
    reconciled(cluster, ns, "lost")
    for kind in ("service", "poddisruptionbudget"):
        eventually(f"the {kind}", lambda kind=kind: get(cluster, kind, "lost", ns))
        cluster.kubectl("delete", kind, "lost", "-n", ns)
    time.sleep(2)
    assert get(cluster, "service", "lost", ns) is None  # no watch brings it back

    async def run_resync() -> None:
        kube = Kube(load_configuration(str(operator.kubeconfig)))
        ctx = Context(Options(resync_seconds=1.0), kube)
        setter: aioenums.FlagSetter[stoppers.DaemonStoppingReason] = aioenums.FlagSetter()
        body = kopf.Body(get(cluster, "infd", "lost", ns) or {})
        task = asyncio.create_task(
            handlers.resync(
                body=body,
                stopped=aioenums.AsyncFlagWaiter(setter),  # type: ignore[arg-type]
                memo=kopf.Memo(ctx=ctx),
            )
        )
        await asyncio.sleep(3)
        setter.set(stoppers.DaemonStoppingReason.OPERATOR_EXITING)
        await asyncio.wait_for(task, 10)

    asyncio.run(run_resync())
    assert get(cluster, "service", "lost", ns) is not None
    assert get(cluster, "poddisruptionbudget", "lost", ns) is not None
    operator.check()


def test_a_deployment_it_did_not_create_is_left_alone_until_it_is_gone(
    cluster: Cluster, operator: InProcessOperator, cluster_namespace: str
) -> None:
    ns = cluster_namespace
    theirs = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "web", "namespace": ns},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}},
                              "spec": {"containers": [{"name": "web", "image": "nginx:1"}]}}},
    }  # fmt: skip
    cluster.apply([theirs])
    apply_cr(cluster, ns, "web", SPEC)

    def conflicted() -> dict[str, Any] | None:
        obj = get(cluster, "infd", "web", ns)
        return obj if condition(obj, "Ready").get("reason") == "NameConflict" else None

    obj = eventually("Ready=False NameConflict", conflicted)
    assert (
        "Deployment web already exists and is not managed by headroom"
        in condition(obj, "Ready")["message"]
    )
    time.sleep(3)  # scaling ticks (1 s) and a reconcile retry would have touched it by now
    dep = get(cluster, "deployment", "web", ns)
    assert dep is not None
    assert [c["image"] for c in dep["spec"]["template"]["spec"]["containers"]] == ["nginx:1"]
    assert dep["spec"]["replicas"] == 2 and not dep["metadata"].get("ownerReferences")
    assert get(cluster, "service", "web", ns) is None  # nothing applied while any name is taken
    events = cluster.kubectl(
        "get", "events", "-n", ns, "--field-selector", "involvedObject.name=web", "-o", "json"
    ).stdout
    assert "NameConflict" in {e["reason"] for e in json.loads(events)["items"]}
    cluster.kubectl("delete", "deployment", "web", "-n", ns, "--wait=true")

    def ours() -> bool:
        d = get(cluster, "deployment", "web", ns)
        refs = (d or {}).get("metadata", {}).get("ownerReferences") or []
        return any(r.get("uid") == obj["metadata"]["uid"] for r in refs)

    eventually("the operator to create its own Deployment once the name is free", ours,
               timeout=90)  # fmt: skip
    operator.check()


def _operator_process(ns: str, kubeconfig: Path, log: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "headroom.operator", "operator", "--namespace", ns,
         "--kubeconfig", str(kubeconfig), "--metrics-port", "0", "--log-format", "json"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "KUBECONFIG": "/nonexistent"},
    )  # fmt: skip


def test_no_condition_is_lost_when_the_operator_is_killed_mid_reconcile(
    cluster: Cluster, operator_kubeconfig: Path, tmp_path: Path
) -> None:
    """Five resources, the operator killed -9 within a second of them, then restarted three
    times: every resource ends with every condition, the reconcile loop's (Feasible) and the
    scaling loop's (KVSaturated, ScalingLimited, PoolMatchesPlan) side by side."""
    ns = f"kill-{os.getpid() % 100000}"
    cluster.create_namespace(ns)
    names = [f"r{i}" for i in range(5)]
    want = {"Ready", "Feasible", "KVSaturated", "ScalingLimited", "PoolMatchesPlan"}

    def all_conditions() -> bool:
        for name in names:
            obj = get(cluster, "infd", name, ns) or {}
            have = {c["type"] for c in (obj.get("status") or {}).get("conditions") or []}
            if have != want:
                return False
        return True

    try:
        with (tmp_path / "kill.log").open("w") as log:
            proc = _operator_process(ns, operator_kubeconfig, log)
            time.sleep(3)  # it starts watching
            for name in names:
                apply_cr(cluster, ns, name, SPEC)
            time.sleep(0.8)
            proc.kill()
            proc.wait(30)
        for round_ in range(3):
            with (tmp_path / f"run{round_}.log").open("w") as log:
                proc = _operator_process(ns, operator_kubeconfig, log)
                try:
                    eventually(f"every condition on every resource (run {round_})",
                               all_conditions, timeout=120)  # fmt: skip
                    time.sleep(2)
                    assert all_conditions()
                finally:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(60)
            text = (tmp_path / f"run{round_}.log").read_text()
            assert "Traceback" not in text, text[-3000:]
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
