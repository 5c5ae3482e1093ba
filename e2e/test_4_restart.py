"""Scenario 4: kill the operator (SIGKILL) while it is reconciling a batch of new
InferenceDeployments, start it again, and check the end state: every resource converged, exactly
one Deployment, Service and PodDisruptionBudget each, and no Deployment rolled twice."""

from __future__ import annotations

import time
from typing import Any

import yaml

from e2e.cluster.harness import Cluster
from e2e.helpers import Operator, Timings, wait_until
from e2e.kube import CHILD_KINDS, SELECTOR_LABEL, condition, get_obj

COUNT = 6
# kwok's pod IPs are fake and must never be sent traffic, so these read "Prometheus" at a port
# nothing listens on: the scaling loop then holds with MetricsUnavailable, as it should.
NO_METRICS = {"metricsSource": "prometheus", "prometheusURL": "http://127.0.0.1:1"}


def _manifest(ns: str) -> str:
    docs = [
        {
            "apiVersion": "headroom.dev/v1alpha1",
            "kind": "InferenceDeployment",
            "metadata": {"name": f"r{i}", "namespace": ns},
            "spec": {
                "model": {"preset": "llama-3.2-1b"},
                "gpu": {"type": "l4-24gb"},
                "traffic": {"peakConcurrency": 8 + i, "contextTokens": 2048},
                "scaling": NO_METRICS,
            },
        }
        for i in range(COUNT)
    ]
    return yaml.safe_dump_all(docs)


def _state(cluster: Cluster, ns: str) -> dict[str, Any]:
    """Per InferenceDeployment: converged?, and the children that exist for it, by kind."""
    crs = get_obj(cluster, "inferencedeployment", namespace=ns)["items"]
    assert isinstance(crs, list)
    children: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for kind in (*CHILD_KINDS, "replicaset"):
        items = get_obj(cluster, kind, namespace=ns)["items"]
        assert isinstance(items, list)
        for obj in items:
            owner = (obj["metadata"].get("labels") or {}).get(SELECTOR_LABEL)
            if owner:
                children.setdefault(owner, {}).setdefault(kind, []).append(obj)
    out: dict[str, Any] = {}
    for cr in crs:
        name = cr["metadata"]["name"]
        st = cr.get("status") or {}
        feasible = condition(cr, "Feasible")
        converged = (
            st.get("observedGeneration") == cr["metadata"]["generation"]
            and "budget" in st
            and feasible is not None
            and feasible["status"] == "True"
            and bool(children.get(name, {}).get("deployment"))
        )
        out[name] = {"converged": converged, "children": children.get(name, {})}
    return out


def test_restart_mid_reconcile_converges_without_duplicates(
    cluster: Cluster, cluster_namespace: str, operator: Operator, timings: Timings
) -> None:
    ns = cluster_namespace
    t0 = time.monotonic()
    cluster.apply(_manifest(ns))

    # Kill it the moment the first child appears: it is then in the middle of the batch.
    def started() -> dict[str, Any] | None:
        state = _state(cluster, ns)
        return state if any(s["children"] for s in state.values()) else None

    at_kill = wait_until(
        started, timeout=60, interval=0.05, what="the first child", alive=operator.check_alive
    )
    assert operator.proc is not None
    operator.proc.kill()
    done = sum(1 for s in at_kill.values() if s["converged"])
    with_children = sum(1 for s in at_kill.values() if s["children"])
    print(
        f"\n[scenario 4] SIGKILL after {time.monotonic() - t0:.1f} s: {done}/{COUNT} converged, "
        f"{with_children}/{COUNT} with children"
    )

    t1 = time.monotonic()
    operator.start()

    def converged() -> dict[str, Any] | None:
        state = _state(cluster, ns)
        ok = len(state) == COUNT and all(s["converged"] for s in state.values())
        return state if ok else None

    final = wait_until(
        converged,
        timeout=120,
        what=f"all {COUNT} to converge after the restart",
        alive=operator.check_alive,
    )
    timings.figure("scenario 4: restart -> converged", time.monotonic() - t1)

    for name, s in sorted(final.items()):
        kids = s["children"]
        for kind in CHILD_KINDS:
            found = [o["metadata"]["name"] for o in kids.get(kind, [])]
            assert found == [name], f"{name}: {kind}s {found} (expected exactly [{name!r}])"
        dep = kids["deployment"][0]
        # Applied once with one template: a re-apply after the restart must not roll it.
        assert dep["metadata"]["generation"] == 1, f"{name}: Deployment rolled after restart"
        assert len(kids.get("replicaset", [])) == 1, f"{name}: {len(kids['replicaset'])} RSs"
        cr = get_obj(cluster, "inferencedeployment", name, namespace=ns)
        uid = cr["metadata"]["uid"]
        for kind in CHILD_KINDS:
            refs = kids[kind][0]["metadata"].get("ownerReferences") or []
            assert [r["uid"] for r in refs if r.get("controller")] == [uid], (name, kind)
