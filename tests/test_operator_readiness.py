"""Ready from the owned Deployment (rollouts included), and the watch's write of it between
scaling ticks: `headroom.operator.status.ready_condition`, `headroom.operator.readiness`."""

from __future__ import annotations

from typing import Any

import pytest

from headroom.operator.readiness import figures, readiness
from headroom.operator.status import ready_condition, set_condition


def deployment(
    want: int, *, total: int, updated: int, ready: int, generation: int = 2, seen: int = 2
) -> dict[str, Any]:
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": want},
        "status": {"observedGeneration": seen, "replicas": total, "updatedReplicas": updated,
                   "readyReplicas": ready},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("dep", "expected"),
    [
        (deployment(2, total=2, updated=2, ready=2), ("True", "AllReplicasReady")),
        (deployment(2, total=2, updated=2, ready=1), ("False", "ReplicasNotReady")),
        # A stuck rollout: the previous spec's pod is still the one ready.
        (deployment(1, total=2, updated=1, ready=1), ("False", "RollingOut")),
        (deployment(2, total=3, updated=1, ready=2), ("False", "RollingOut")),
        # The controller has not yet seen the new spec: the ready pods are the previous one's.
        (deployment(1, total=1, updated=1, ready=1, generation=3, seen=2), ("False", "RollingOut")),
        # Just created: nothing of a previous spec, only not ready yet.
        (
            {"metadata": {"generation": 1}, "spec": {"replicas": 2}, "status": {}},
            ("False", "ReplicasNotReady"),
        ),
        (None, ("False", "NoDeployment")),
    ],
)
def test_ready_is_every_replica_ready_on_the_current_spec(
    dep: dict[str, Any] | None, expected: tuple[str, str]
) -> None:
    status, reason, message = ready_condition(dep)
    assert (status, reason) == expected, message


def test_a_stuck_rollout_says_how_far_it_got() -> None:
    _, _, message = ready_condition(deployment(2, total=3, updated=1, ready=2))
    assert message == "1/2 replicas on the current spec, 2 of the previous one left; 2 ready"


def body(generation: int = 4, **status: Any) -> dict[str, Any]:
    conditions = set_condition([], "Feasible", "True", "Sized", "sized", generation=generation,
                               now=100.0)  # fmt: skip
    conditions = set_condition(conditions, "Ready", "False", "ReplicasNotReady",
                               "0/1 replicas ready", generation=generation, now=100.0)  # fmt: skip
    return {
        "metadata": {"name": "chat", "namespace": "ns", "uid": "u", "generation": generation},
        "status": {"observedGeneration": generation, "replicas": 1, "readyReplicas": 0,
                   "conditions": conditions, **status},
    }  # fmt: skip


def test_the_deployment_becoming_ready_is_written_with_its_counts() -> None:
    out = readiness(body(), deployment(1, total=1, updated=1, ready=1), now=200.0)
    assert out is not None
    (ready,) = out.status["conditions"]
    assert (ready["type"], ready["status"], ready["reason"]) == (
        "Ready",
        "True",
        "AllReplicasReady",
    )
    assert ready["observedGeneration"] == 4
    assert (out.status["replicas"], out.status["readyReplicas"]) == (1, 1)
    assert set(out.status) == {"replicas", "readyReplicas", "conditions"}, "nothing else"


def test_nothing_is_written_when_the_status_already_says_it() -> None:
    dep = deployment(1, total=1, updated=1, ready=0)
    assert figures(dep) == ("False", "ReplicasNotReady", "0/1 replicas ready", 1, 0)
    assert readiness(body(), dep, now=200.0) is None


@pytest.mark.parametrize(
    "held",
    [
        body(observedGeneration=3),  # the new spec is not reconciled yet
        {**body(), "status": {**body()["status"], "conditions": set_condition(
            [], "Feasible", "False", "Infeasible", "x", generation=4, now=1.0)}},
        {**body(), "status": {**body()["status"], "conditions": set_condition(
            set_condition([], "Feasible", "True", "Sized", "x", generation=4, now=1.0),
            "Ready", "False", "ApplyFailed", "refused", generation=4, now=1.0)}},
    ],
    ids=["not-reconciled", "infeasible", "children-refused"],
)  # fmt: skip
def test_ready_is_left_to_the_reconcile_when_it_is_not_the_deployments_to_say(
    held: dict[str, Any],
) -> None:
    assert readiness(held, deployment(1, total=1, updated=1, ready=1), now=200.0) is None


@pytest.mark.parametrize(
    ("dep", "expected"),
    [
        # Scaled to zero by hand: no replica serves, so it is not Ready.
        (
            {"metadata": {"generation": 2}, "spec": {"replicas": 0},
             "status": {"observedGeneration": 2}},
            ("False", "ReplicasNotReady", "0/0 replicas ready", 0, 0),
        ),
        # The API server leaves zero counts out, and spec.replicas defaults to 1: a rollout
        # whose new pod is not created yet reports neither updatedReplicas nor readyReplicas.
        (
            {"metadata": {"generation": 2}, "spec": {},
             "status": {"observedGeneration": 2, "replicas": 1}},
            ("False", "RollingOut",
             "0/1 replicas on the current spec, 1 of the previous one left; 0 ready", 1, 0),
        ),
    ],
    ids=["scaled-to-zero", "counts-left-out"],
)  # fmt: skip
def test_counts_the_api_server_leaves_out_read_as_its_defaults(
    dep: dict[str, Any], expected: tuple[str, str, str, int, int]
) -> None:
    """An absent count is Kubernetes' default (replicas 1, the rest 0), and none is not Ready."""
    assert figures(dep) == expected
