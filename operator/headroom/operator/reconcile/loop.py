"""Reconcile one InferenceDeployment: validate, size, render the children, apply them.

A shell around pure parts (models, sizing, children, status). It returns the status patch
and the Events to post instead of writing them, so the kopf handlers stay a few lines and the
logic is testable against a fake API. It never writes the resource's spec.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

from headroom.operator.bounds import clamp
from headroom.operator.crd.models import InferenceDeploymentSpec, name_error
from headroom.operator.kube import KubeAPI, KubeError, owner_of, owns_field, with_retries
from headroom.operator.reconcile.adoption import conflict
from headroom.operator.reconcile.children import (
    FIELD_MANAGER,
    Owner,
    render,
    selector_string,
)
from headroom.operator.reconcile.runtimes import DEFAULT_IMAGES, HeadroomImages
from headroom.operator.reconcile.sizing import Sizing, budget, parse, summary
from headroom.operator.status import (
    Event,
    Outcome,
    carried,
    condition_changed,
    infeasible_ready,
    ready_condition,
    replica_counts,
    set_status_condition,
)

log = logging.getLogger("headroom.operator.reconcile.loop")
HANDOFF_MANAGER = "headroom-operator-handoff"
# How often a spec whose child name is taken looks again: the object in the way is not ours,
# so no watch event says when it is gone.
CONFLICT_RETRY_SECONDS = 30.0
MONITORING_GV = "monitoring.coreos.com/v1"
MONITORING_KINDS = frozenset({"ServiceMonitor", "PrometheusRule"})
# Reads of the Deployment one reconcile makes when it keeps changing between read and apply;
# past that, it is applied from the freshest read without the precondition (_apply_fresh).
STALE_READ_ATTEMPTS = 3


def replicas_to_apply(
    spec: InferenceDeploymentSpec, sizing: Sizing, live: dict[str, Any] | None
) -> int | None:
    """The Deployment's replicas: auto keeps the live count (the scaling loop's last decision)
    or starts at the sized count; advisory follows spec.replicas (set through /scale by the
    external autoscaler) or leaves the field to whoever owns it."""
    lo, hi = spec.scaling.min_replicas, spec.scaling.max_replicas
    if spec.scaling.mode == "advisory":
        return clamp(spec.replicas, lo, hi) if spec.replicas is not None else None
    if live is not None and live.get("spec", {}).get("replicas") is not None:
        return clamp(int(live["spec"]["replicas"]), lo, hi)
    return clamp(sizing.replicas, lo, hi)


def monitoring_kinds(kube: KubeAPI) -> frozenset[str]:
    """Which Prometheus operator kinds the cluster serves (none when its CRDs are absent)."""
    try:
        return kube.served_kinds(MONITORING_GV) & MONITORING_KINDS
    except KubeError as exc:
        log.warning("cannot discover %s: %s", MONITORING_GV, exc)
        return frozenset()


class NameConflict(Exception):
    """A child's name is taken by an object this InferenceDeployment does not own."""


class StaleRead(Exception):
    """The Deployment changed after it was read (the scaling loop scaled it): its replicas, and
    the precondition that guards them, must be read again."""


def _apply_read(kube: KubeAPI, obj: dict[str, Any], read: dict[str, Any] | None,
                **kw: Any) -> dict[str, Any]:  # fmt: skip
    """Apply `obj`, derived from `read` (the object as last read), only if the object is still
    that one. The replicas a reconcile applies are the live count it read; the scaling loop may
    scale the Deployment through /scale before the apply lands (several round trips later), and
    a forced apply of the count read would undo that scale unseen. Server-side apply takes
    `metadata.resourceVersion` as a precondition and answers 409 Conflict when the object has
    moved on; then the caller reads again. (A lock between the two loops would cover only this
    process, and leaving replicas out of the apply would hand them to no one: reset to 1.)"""
    version = ((read or {}).get("metadata") or {}).get("resourceVersion")
    if version:
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": version}}
    try:
        return with_retries(partial(kube.apply, obj, **kw), conflicts=not version)
    except KubeError as exc:
        if version and exc.status == 409:
            raise StaleRead(exc.message) from None
        raise


def check_ownership(
    kube: KubeAPI, owner: Owner, children: list[dict[str, Any]], live: dict[str, Any] | None
) -> None:
    """Raise NameConflict before anything is applied if any child's name is someone else's
    object: a forced apply would take it over (`live` is the Deployment, already read)."""
    for child in children:
        kind, name = child["kind"], child["metadata"]["name"]
        try:
            current = (
                live if kind == "Deployment"
                else kube.get(child["apiVersion"], kind, owner.namespace, name)
            )  # fmt: skip
        except KubeError as exc:
            if kind in MONITORING_KINDS and exc.status == 403:
                # An operator not allowed monitoring objects applies the rest: its apply is
                # refused the same way and becomes a MonitoringSkipped warning.
                continue
            raise
        reason = conflict(kind, current, owner)
        if reason is not None:
            raise NameConflict(reason)


def apply_children(
    kube: KubeAPI,
    owner: Owner,
    spec: InferenceDeploymentSpec,
    sizing: Sizing,
    replicas: int | None,
    live: dict[str, Any] | None,
    guarded: bool = True,
    images: HeadroomImages = DEFAULT_IMAGES,
) -> tuple[dict[str, Any], list[Event]]:
    """Server-side apply every child; returns the applied Deployment and any warnings.
    Raises NameConflict, having applied nothing, when a child's name is taken, and StaleRead,
    having applied nothing but maybe the replicas handoff, when `live` is out of date (only
    `guarded`: the Deployment is applied on `live`'s resourceVersion)."""
    read = live if guarded else None
    events: list[Event] = []
    kinds = monitoring_kinds(kube)
    children = render(owner, spec, sizing, replicas, monitoring=kinds, images=images)
    check_ownership(kube, owner, children, live)
    if (
        replicas is None
        and live is not None
        and owns_field(live, FIELD_MANAGER, ("spec", "replicas"))
    ):
        # Leaving a field out of an apply deletes it when no one else owns it, which would
        # reset the Deployment to 1 replica. Hand it to a second manager first (the pattern the
        # server-side apply docs give for passing replicas to an HPA).
        current = int(live.get("spec", {}).get("replicas", 1))
        handoff = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": owner.name, "namespace": owner.namespace},
            "spec": {"replicas": current},
        }
        live = _apply_read(kube, handoff, read, field_manager=HANDOFF_MANAGER)
        read = live if guarded else None
    applied_deployment: dict[str, Any] = {}
    for obj in children:
        try:
            if obj["kind"] == "Deployment":
                out = _apply_read(kube, obj, read)
            else:
                out = with_retries(partial(kube.apply, obj))
        except KubeError as exc:
            if obj["kind"] in MONITORING_KINDS and exc.status in (403, 404):
                events.append(
                    Event(
                        "Warning",
                        "MonitoringSkipped",
                        f"{obj['kind']} not applied ({exc.status} {exc.reason}): {exc.message}",
                    )
                )
                continue
            raise
        if obj["kind"] == "Deployment":
            applied_deployment = out
    return applied_deployment, events


# What a reconcile writes besides its conditions: an apply under the same field manager that
# left one out would delete it (the /scale subresource reads `selector`).
_RECONCILED_FIELDS = ("budget", "replicas", "readyReplicas", "desiredReplicas")


def apply_failed(body: dict[str, Any], exc: KubeError, now: float) -> Outcome:
    """The status and Event of an apply the API server refused for good (an invalid child):
    retrying the same object cannot succeed, so it waits for the next spec change. The last
    reconcile's figures and Feasible condition stay: the running Deployment is unchanged."""
    out = Outcome()
    out.status["observedGeneration"] = body["metadata"].get("generation")
    out.status["selector"] = selector_string(body["metadata"]["name"])
    out.status |= carried(body.get("status") or {}, _RECONCILED_FIELDS, ("Feasible",))
    message = f"the API server refused a child of this spec ({exc}); fix the spec"
    out.events.append(Event("Warning", "ApplyFailed", message))
    set_status_condition(body, out.status, "Ready", "False", "ApplyFailed", message, now)
    return out


def _apply_fresh(
    kube: KubeAPI,
    owner: Owner,
    spec: InferenceDeploymentSpec,
    sizing: Sizing,
    live: dict[str, Any] | None,
    images: HeadroomImages = DEFAULT_IMAGES,
) -> tuple[int | None, dict[str, Any], list[Event]]:
    """apply_children with the replicas of the Deployment as it is when the apply lands: read
    again after each StaleRead. A Deployment that moves on at every read (its controller
    writing status through a rollout moves the resourceVersion too) would never meet the
    precondition, and its drift would stay: once the attempts are spent it is applied without
    one, from the freshest read, the race with a scale as narrow as one read and one apply."""
    for _ in range(STALE_READ_ATTEMPTS):
        replicas = replicas_to_apply(spec, sizing, live)
        try:
            applied, warnings = apply_children(
                kube, owner, spec, sizing, replicas, live, images=images
            )
        except StaleRead:
            live = kube.get("apps/v1", "Deployment", owner.namespace, owner.name)
            continue
        return replicas, applied, warnings
    replicas = replicas_to_apply(spec, sizing, live)
    applied, warnings = apply_children(
        kube, owner, spec, sizing, replicas, live, guarded=False, images=images
    )
    return replicas, applied, warnings


def reconcile(
    kube: KubeAPI, body: dict[str, Any], now: float, images: HeadroomImages = DEFAULT_IMAGES
) -> Outcome:
    """Bring the children in line with the spec; the returned status goes to .status. `images`:
    headroom's images (the operator's --headroom-image) for pods whose spec names none."""
    out = Outcome()
    st = out.status
    meta = body["metadata"]
    st["observedGeneration"] = meta.get("generation")
    st["selector"] = selector_string(meta["name"])
    bad_name = name_error(meta["name"])
    if bad_name is not None:
        # Stored before the CRD refused such names: the Service and labels cannot take it.
        if condition_changed(body, "Feasible", "False", "InvalidName"):
            out.events.append(Event("Warning", "InvalidName", bad_name))
        set_status_condition(body, st, "Feasible", "False", "InvalidName", bad_name, now)
        set_status_condition(body, st, "Ready", "False", "InvalidName", bad_name, now)
        return out
    parsed = parse(body.get("spec"))
    if parsed.error is not None or parsed.sizing is None or parsed.spec is None:
        message = parsed.error or "spec could not be sized"
        if condition_changed(body, "Feasible", "False", "InvalidSpec"):
            out.events.append(Event("Warning", "InvalidSpec", message))
        set_status_condition(body, st, "Feasible", "False", "InvalidSpec", message, now)
        set_status_condition(
            body, st, "Ready", "False", "InvalidSpec", "the spec is invalid: " + message, now
        )
        return out
    spec, sizing = parsed.spec, parsed.sizing
    owner = owner_of(body)
    st["budget"] = budget(sizing).merge_patch()
    live = kube.get("apps/v1", "Deployment", owner.namespace, owner.name)

    if not sizing.feasible:
        message = summary(sizing)
        if condition_changed(body, "Feasible", "False", "Infeasible"):
            out.events.append(Event("Warning", "Infeasible", message))
        set_status_condition(body, st, "Feasible", "False", "Infeasible", message, now)
        if live is None or conflict("Deployment", live, owner) is not None:
            # A Deployment of this name that is someone else's runs nothing of ours.
            set_status_condition(
                body, st, "Ready", "False", "Infeasible", "no Deployment: " + message, now
            )
        else:
            # Nothing of this generation is applied: the running Deployment is the last
            # feasible spec's, and Ready stays False until a spec that can be sized replaces it.
            set_status_condition(body, st, "Ready", *infeasible_ready(live), now)
        return out

    try:
        replicas, applied, warnings = _apply_fresh(kube, owner, spec, sizing, live, images)
    except NameConflict as exc:
        message = str(exc)
        if condition_changed(body, "Ready", "False", "NameConflict"):
            out.events.append(Event("Warning", "NameConflict", message))
        set_status_condition(body, st, "Feasible", "True", "Sized", summary(sizing), now)
        set_status_condition(body, st, "Ready", "False", "NameConflict", message, now)
        out.retry_after = CONFLICT_RETRY_SECONDS
        return out
    out.events.extend(warnings)
    dep_replicas = applied.get("spec", {}).get("replicas")
    st["replicas"] = dep_replicas
    st["readyReplicas"] = replica_counts(applied)[1]
    previous = (body.get("status") or {}).get("desiredReplicas")
    st["desiredReplicas"] = (
        replicas if spec.scaling.mode == "auto" and replicas is not None
        else previous if previous is not None
        else clamp(sizing.replicas, spec.scaling.min_replicas, spec.scaling.max_replicas)
    )  # fmt: skip
    message = summary(sizing)
    if condition_changed(body, "Feasible", "True", "Sized") or live is None:
        out.events.append(Event("Normal", "Sized", message))
    set_status_condition(body, st, "Feasible", "True", "Sized", message, now)
    status, reason, msg = ready_condition(applied)
    set_status_condition(body, st, "Ready", status, reason, msg, now)
    if live is None:
        out.events.append(
            Event("Normal", "Created", f"Deployment {owner.name} created with {dep_replicas} "
                  f"replicas, {sizing.plan.kv_blocks_per_pod} KV blocks per pod")
        )  # fmt: skip
    return out
