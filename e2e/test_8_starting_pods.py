"""Scenario 8: the pods a cancel removes are the ones still starting.

When the forecast no longer needs pods that were asked for but are not ready, `decide()` lowers
the Deployment's replicas, never below the ready count (`StartingNotNeeded`), and trusts the
ReplicaSet controller to remove pods that are not ready before any ready one: its ranking puts
unscheduled before pending before running, and not ready before ready, ahead of every other
rule (crowded nodes, age, pod-deletion-cost). This checks it on the real
kube-controller-manager for the two ways a GPU pod starts: waiting for a node (unschedulable:
one pod per node here) and loading its model on one (running, not ready: kwok marks its pods
ready at once, so the test sets their Ready condition back to False, as a loading engine's
readiness probe leaves it). Two such pods are asked for and, where pods can be placed, then a
ready pod newer than both; scaling down twice removes the two starting pods and never a ready
one, even the newest. Which of the two starting pods goes first is not asserted: past
readiness the ranking weighs how crowded each pod's node is, then age on a log scale with a
random tie-break.
"""

from __future__ import annotations

import time
from typing import Any

from e2e.cluster.harness import Cluster
from e2e.helpers import wait_until
from e2e.kube import condition, get_obj

NAME = "cancel"
LABELS = {"app": NAME}


def _deployment(ns: str, replicas: int, *, one_per_node: bool) -> dict[str, Any]:
    # One pod per node (required anti-affinity): the pods past the node count stay Pending.
    spread = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": LABELS}, "topologyKey": "kubernetes.io/hostname"}
            ]
        }
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": NAME, "namespace": ns},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": LABELS},
            "template": {
                "metadata": {"labels": LABELS},
                "spec": {
                    "nodeSelector": {"type": "kwok"},
                    "affinity": spread if one_per_node else {},
                    "containers": [{"name": "engine", "image": "headroom.invalid/engine:0"}],
                },
            },
        },
    }


def _pods(cluster: Cluster, ns: str) -> dict[str, dict[str, Any]]:
    """The Deployment's live pods by name (those being deleted left out)."""
    items = get_obj(cluster, "pods", namespace=ns)["items"]
    assert isinstance(items, list)
    return {p["metadata"]["name"]: p for p in items if not p["metadata"].get("deletionTimestamp")}


def _ready(pod: dict[str, Any]) -> bool:
    ready = condition(pod, "Ready")
    return ready is not None and ready["status"] == "True"


def _scale(cluster: Cluster, ns: str, replicas: int) -> None:
    cluster.kubectl("scale", "deployment", NAME, "-n", ns, f"--replicas={replicas}")


def _loading(cluster: Cluster, ns: str, name: str) -> None:
    """Set a running pod's Ready condition back to False: its engine is still loading."""
    patch = '{"status":{"conditions":[{"type":"Ready","status":"False","reason":"Loading"}]}}'
    cluster.kubectl("patch", "pod", name, "-n", ns, "--subresource=status", "-p", patch)


def _cancels_remove_starting_pods_before_ready_ones(
    cluster: Cluster, ns: str, ready: int, *, one_per_node: bool
) -> None:
    cluster.apply([_deployment(ns, ready, one_per_node=one_per_node)])
    running = wait_until(
        lambda: (
            (p := _pods(cluster, ns)) and len(p) == ready and all(map(_ready, p.values())) and p
        ),
        timeout=60,
        what=f"{ready} ready pods",
    )
    seen: list[str] = []

    def ask(loading: bool = True) -> str:
        """One more pod; its name, once it waits for a node or (`loading`) runs not ready."""
        _scale(cluster, ns, ready + len(seen) + 1)

        def probe() -> str | None:
            pods = _pods(cluster, ns)
            new = [name for name in pods if name not in running and name not in seen]
            placed = all(pods[name].get("status", {}).get("phase") == "Running" for name in new)
            return new[0] if len(new) == 1 and (one_per_node or placed) else None

        name = wait_until(probe, timeout=60, what=f"pod {ready + len(seen) + 1} asked for")
        if not one_per_node and loading:
            _loading(cluster, ns, name)
        seen.append(name)
        time.sleep(1.2)  # creationTimestamp has whole seconds: the next pod is newer
        return name

    older, newer = ask(), ask()
    # Where pods can be placed, one more that is ready and newer than both: a pod not ready
    # goes before the newest ready one.
    extra = [] if one_per_node else [ask(loading=False)]
    pods = wait_until(
        lambda: (
            (p := _pods(cluster, ns))
            and not _ready(p[older])
            and not _ready(p[newer])
            and all(_ready(p[name]) for name in extra)
            and p
        ),
        timeout=30,
        what="the two starting pods not ready, the extra one ready",
    )
    created = [pods[name]["metadata"]["creationTimestamp"] for name in seen]
    assert created == sorted(set(created)), created

    # The cancels, as decide() makes them: back to the ready count plus what is still needed.
    keep = ready + len(extra)
    for count in (keep + 1, keep):
        _scale(cluster, ns, count)
        left = wait_until(
            lambda n=count: (p := _pods(cluster, ns)) and len(p) == n and p,
            timeout=60,
            what=f"{count} pods",
        )
        assert {*running, *extra} <= set(left) <= {*running, *extra, older, newer}, sorted(left)
    assert all(map(_ready, left.values()))


def test_a_cancel_removes_pods_waiting_for_a_node_before_ready_ones(
    cluster: Cluster, cluster_namespace: str
) -> None:
    nodes = get_obj(cluster, "nodes")["items"]
    assert isinstance(nodes, list)
    n = sum(1 for node in nodes if (node["metadata"].get("labels") or {}).get("type") == "kwok")
    assert n >= 1
    _cancels_remove_starting_pods_before_ready_ones(
        cluster, cluster_namespace, n, one_per_node=True
    )


def test_a_cancel_removes_pods_loading_their_model_before_ready_ones(
    cluster: Cluster, cluster_namespace: str
) -> None:
    _cancels_remove_starting_pods_before_ready_ones(
        cluster, cluster_namespace, 2, one_per_node=False
    )
