"""What the operator writes back: metav1.Condition bookkeeping (pure functions over the
status.conditions list), the Events to post, and the `Outcome` a reconcile or a scaling tick
returns instead of writing. Both loops write through here, each server-side applying the fields
it owns under a field manager of its own (`RECONCILE_MANAGER`, `SCALING_MANAGER`), so the two
never overwrite each other's conditions."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from headroom.operator.crd.models import CONDITION_TYPES

Status = Literal["True", "False", "Unknown"]
RECONCILE_MANAGER = "headroom-reconcile"
SCALING_MANAGER = "headroom-scaling"


def log_fields(namespace: str | None, name: str | None) -> dict[str, str | None]:
    """The `extra=` that names the InferenceDeployment a log line is about (JSON logs filter on
    it)."""
    return {"namespace": namespace, "inferencedeployment": name}


def rfc3339(ts: float) -> str:
    """Unix seconds as the RFC 3339 UTC form Kubernetes stores (second precision)."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> float | None:
    """RFC 3339 back to unix seconds; None when absent or unreadable."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def set_condition(
    conditions: list[dict[str, Any]] | None,
    type_: str,
    status: Status,
    reason: str,
    message: str,
    *,
    generation: int | None,
    now: float,
) -> list[dict[str, Any]]:
    """A new list with one condition set; `lastTransitionTime` moves only when status flips."""
    if type_ not in CONDITION_TYPES:
        raise ValueError(f"unknown condition type {type_!r}")
    out: list[dict[str, Any]] = []
    previous: dict[str, Any] | None = None
    for cond in conditions or []:
        if cond.get("type") == type_:
            previous = cond
        else:
            out.append(dict(cond))
    changed = previous is None or previous.get("status") != status
    entry: dict[str, Any] = {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message[:32768],
        "lastTransitionTime": rfc3339(now)
        if changed or previous is None
        else previous.get("lastTransitionTime", rfc3339(now)),
    }
    if generation is not None:
        entry["observedGeneration"] = generation
    out.append(entry)
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    out.sort(key=lambda c: order.get(str(c.get("type")), len(order)))
    return out


def get_condition(conditions: list[dict[str, Any]] | None, type_: str) -> dict[str, Any] | None:
    """The condition of this type, if set."""
    for cond in conditions or []:
        if cond.get("type") == type_:
            return cond
    return None


EventType = Literal["Normal", "Warning"]


@dataclass(frozen=True, slots=True)
class Event:
    """A Kubernetes Event to post on the InferenceDeployment."""

    type: EventType
    reason: str
    message: str


@dataclass
class Outcome:
    """What a reconcile or a scaling tick wants written: a status merge patch and Events."""

    status: dict[str, Any] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    # Seconds until the same spec is worth reconciling again (a conflict someone else must
    # clear, with nothing of ours to watch); None: only the next change.
    retry_after: float | None = None


def replica_counts(deployment: dict[str, Any]) -> tuple[int, int]:
    """A Deployment's wanted replicas (its default 1 when unset) and ready replicas."""
    want = int(deployment.get("spec", {}).get("replicas", 1) or 0)
    return want, int((deployment.get("status") or {}).get("readyReplicas", 0) or 0)


def ready_condition(
    deployment: dict[str, Any] | None,
) -> tuple[Literal["True", "False"], str, str]:
    """(status, reason, message) of Ready from the owned Deployment: every replica ready on
    its current spec, as `kubectl rollout status` has it, not only `readyReplicas` (which
    counts the previous spec's pods while a rollout is stuck)."""
    if deployment is None:
        return "False", "NoDeployment", "no Deployment exists for this InferenceDeployment"
    want, ready = replica_counts(deployment)
    st = deployment.get("status", {}) or {}
    updated = int(st.get("updatedReplicas", 0) or 0)
    total = int(st.get("replicas", 0) or 0)
    generation = deployment.get("metadata", {}).get("generation")
    seen = st.get("observedGeneration")
    unseen = generation is not None and (seen is None or int(seen) < int(generation))
    if unseen and total:
        return "False", "RollingOut", (
            f"the Deployment's controller has not yet acted on its new spec; {ready}/{want} "
            "replicas ready on the previous one"
        )  # fmt: skip
    if total > updated:
        return "False", "RollingOut", (
            f"{updated}/{want} replicas on the current spec, {total - updated} of the "
            f"previous one left; {ready} ready"
        )  # fmt: skip
    if want > 0 and ready >= want and not unseen:
        return "True", "AllReplicasReady", f"{ready}/{want} replicas ready"
    return "False", "ReplicasNotReady", f"{ready}/{want} replicas ready"


def infeasible_ready(
    deployment: dict[str, Any],
) -> tuple[Literal["False"], str, str]:
    """Ready while the spec cannot be sized: False, reason Infeasible, whatever the running
    Deployment says. Nothing of this generation was applied; the Deployment still runs the
    last feasible spec, so its readiness is not this spec's (`kubectl wait
    --for=condition=Ready` and GitOps health checks must not pass for a spec never rolled
    out). The message keeps the running Deployment's readiness."""
    _, _, message = ready_condition(deployment)
    return "False", "Infeasible", (
        "the spec cannot be sized (see Feasible); the running Deployment keeps its last "
        f"feasible configuration: {message}"
    )  # fmt: skip


def carried(
    previous: dict[str, Any], fields: tuple[str, ...], conditions: tuple[str, ...]
) -> dict[str, Any]:
    """The `fields` and condition types of `previous` (a status) that are set: what a loop's
    status apply must repeat when it writes nothing new for them, since server-side apply
    deletes the fields its manager leaves out."""
    kept = {k: previous[k] for k in fields if previous.get(k) is not None}
    found = [get_condition(previous.get("conditions"), t) for t in conditions]
    if any(found):
        kept["conditions"] = [dict(c) for c in found if c is not None]
    return kept


def set_status_condition(
    body: dict[str, Any],
    status: dict[str, Any],
    type_: str,
    st: Literal["True", "False", "Unknown"],
    reason: str,
    message: str,
    now: float,
) -> None:
    """Set one condition in the status a loop will write. The list holds only the types this
    loop sets: each loop server-side applies its own, keyed by type, so neither can drop the
    other's (the transition time still comes from what the object holds now)."""
    generation = body.get("metadata", {}).get("generation")
    current = get_condition((body.get("status") or {}).get("conditions"), type_)
    mine = [c for c in status.get("conditions", []) if c.get("type") != type_]
    status["conditions"] = set_condition(
        [*mine, *([current] if current else [])], type_, st, reason, message,
        generation=generation, now=now,
    )  # fmt: skip


def condition_changed(body: dict[str, Any], type_: str, st: str, reason: str) -> bool:
    cond = get_condition((body.get("status") or {}).get("conditions"), type_)
    return cond is None or cond.get("status") != st or cond.get("reason") != reason
