"""Ready and the replica counts, brought up to date when the owned Deployment's status moves.

The reconcile and the scaling tick both write them, but a reconcile runs on spec changes and
the tick every `intervalSeconds` (up to an hour): `kubectl wait --for=condition=Ready` waited
a whole interval after the pods were ready, and a Deployment that lost its pods read Ready
until the next tick. The operator's watch on its Deployments writes them in between, under a
field manager of its own that owns nothing else, so its apply deletes no field of the loops.
"""

from __future__ import annotations

from typing import Any, Literal

from headroom.operator.scaling.loop import reconcile_failed
from headroom.operator.status import (
    Outcome,
    get_condition,
    ready_condition,
    replica_counts,
    set_status_condition,
)

READINESS_MANAGER = "headroom-readiness"


def figures(deployment: dict[str, Any]) -> tuple[Literal["True", "False"], str, str, int, int]:
    """What this module writes, read off a Deployment: Ready's status, reason and message,
    replicas and ready replicas. The watch skips events that change none of them."""
    return (*ready_condition(deployment), *replica_counts(deployment))


def readiness(body: dict[str, Any], deployment: dict[str, Any], now: float) -> Outcome | None:
    """The status apply that brings Ready and the replica counts of `body` in line with its
    Deployment; None when they already are, or when Ready is not the Deployment's to say: a
    spec not yet reconciled, not sized, or whose children were not applied."""
    status = body.get("status") or {}
    generation = body.get("metadata", {}).get("generation")
    feasible = get_condition(status.get("conditions"), "Feasible")
    if (
        status.get("observedGeneration") != generation
        or feasible is None
        or feasible.get("status") != "True"
        or feasible.get("observedGeneration") != generation
        or reconcile_failed(body)
    ):
        return None
    ready, reason, message, replicas, ready_replicas = now_figures = figures(deployment)
    held = get_condition(status.get("conditions"), "Ready") or {}
    held_figures = (held.get("status"), held.get("reason"), held.get("message"),
                    status.get("replicas"), status.get("readyReplicas"))  # fmt: skip
    if held_figures == now_figures:
        return None
    out = Outcome()
    out.status["replicas"] = replicas
    out.status["readyReplicas"] = ready_replicas
    set_status_condition(body, out.status, "Ready", ready, reason, message, now)
    return out
