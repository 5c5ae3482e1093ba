"""The scaling loop's tick: observe pods and KV metrics, call `decide()`, act, report.

A shell: everything it decides comes from `decide.decide`; everything it writes is returned as
an `Outcome` (status patch + Events) except the Deployment apply itself, which in auto mode is
the point of the tick. The kopf timer in handlers.py calls `tick()` once per interval per CR.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from typing import Any

from headroom.operator.crd.models import (
    MAX_DECISIONS,
    DecisionInputs,
    DecisionRecord,
    InferenceDeploymentSpec,
    KVStatus,
)
from headroom.operator.kube import KubeAPI, KubeError, owner_of, with_retries
from headroom.operator.reconcile.children import deployment, selector_string
from headroom.operator.reconcile.sizing import Sizing, blocks_per_sequence, parse
from headroom.operator.scaling.decide import (
    Decision,
    Inputs,
    PodView,
    Policy,
    ScaleInWindow,
    decide,
)
from headroom.operator.scaling.metrics_sources import (
    MetricsError,
    MetricsSource,
    PodInfo,
    Target,
    pod_infos,
)
from headroom.operator.status import (
    Event,
    Outcome,
    condition_changed,
    parse_time,
    ready_condition,
    rfc3339,
    set_status_condition,
)

log = logging.getLogger("headroom.operator.scaling.loop")


def policy_for(spec: InferenceDeploymentSpec, sizing: Sizing) -> Policy:
    """The decision policy of a spec, with the planned pod capacity."""
    s = spec.scaling
    return Policy(
        min_replicas=s.min_replicas,
        max_replicas=s.max_replicas,
        blocks_per_pod=max(1, sizing.plan.kv_blocks_per_pod),
        blocks_per_sequence=blocks_per_sequence(spec),
        target_occupancy=s.target_occupancy,
        scale_out_occupancy=s.scale_out_occupancy,
        scale_in_hysteresis=s.scale_in_hysteresis,
        lookahead_seconds=float(s.saturation_lookahead_seconds),
        scale_up_stabilization_seconds=float(s.scale_up_stabilization_seconds),
        scale_down_stabilization_seconds=float(s.scale_down_stabilization_seconds),
        max_scale_up_pods=s.max_scale_up_pods,
        max_scale_down_pods=s.max_scale_down_pods,
        metrics_max_age_seconds=float(s.metrics_max_age_seconds),
        startup_grace_seconds=float(s.startup_grace_seconds),
        warmup_seconds=float(s.warmup_seconds),
        growth_window_seconds=float(s.growth_window_seconds),
    )


def last_changes(status: dict[str, Any]) -> tuple[float | None, float | None]:
    """(last scale-up, last scale-down) times from status.lastDecisions."""
    up = down = None
    for rec in status.get("lastDecisions") or []:
        t = parse_time(rec.get("time"))
        if t is None:
            continue
        if rec.get("to", 0) > rec.get("from", 0):
            up = t if up is None else max(up, t)
        elif rec.get("to", 0) < rec.get("from", 0):
            down = t if down is None else max(down, t)
    return up, down


def views(infos: list[PodInfo], samples: dict[str, Any]) -> tuple[PodView, ...]:
    """Pods joined with their samples."""
    return tuple(
        PodView(
            name=i.name,
            ready=i.ready,
            created_at=i.created_at,
            terminating=i.terminating,
            sample=samples.get(i.name),
            ready_since=i.ready_since,
        )
        for i in infos
    )


def kv_status(d: Decision, now: float) -> dict[str, Any]:
    """status.kv from a decision's figures."""
    f = d.figures
    eta = f.min_eta_seconds
    kv = KVStatus(
        occupancy=round(f.mean_occupancy, 4) if f.mean_occupancy is not None else None,
        occupancy_percent=round(100 * f.mean_occupancy) if f.mean_occupancy is not None else None,
        max_occupancy=round(f.max_occupancy, 4) if f.max_occupancy is not None else None,
        hit_ratio=round(f.hit_ratio, 4) if f.hit_ratio is not None else None,
        hit_percent=round(100 * f.hit_ratio) if f.hit_ratio is not None else None,
        eta_seconds=round(eta) if eta is not None else None,
        eta=(f"{eta:.0f}s" if eta is not None else "steady") if f.reporting else None,
        waiting=f.waiting if f.reporting else None,
        preemption_rate_per_second=round(f.preemption_rate, 4) if f.reporting else None,
        pods_reporting=f.reporting,
        observed_at=rfc3339(now),
    )
    return kv.merge_patch()


def decision_record(d: Decision, current: int, now: float, applied: bool) -> dict[str, Any]:
    """One entry of status.lastDecisions."""
    f = d.figures
    rec = DecisionRecord(
        time=rfc3339(now),
        from_=current,
        to=d.replicas,
        reason=d.reason,
        message=d.message[:4096],
        applied=applied,
        inputs=DecisionInputs(
            ready_replicas=f.ready,
            starting_replicas=f.starting,
            pods_reporting=f.reporting,
            mean_occupancy=_r(f.mean_occupancy),
            max_occupancy=_r(f.max_occupancy),
            min_eta_seconds=_r(f.min_eta_seconds),
            waiting=f.waiting if f.reporting else None,
            preemption_rate_per_second=_r(f.preemption_rate) if f.reporting else None,
            demand_blocks=_r(f.demand_blocks),
            projected_occupancy=_r(f.projected_occupancy),
        ),
    )
    return rec.wire()


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


@dataclass
class TickResult:
    """A tick's outcome plus what the caller keeps between ticks."""

    outcome: Outcome
    decision: Decision | None = None
    scale_in: ScaleInWindow | None = None
    recent: tuple[tuple[float, float], ...] = ()
    current: int | None = None
    mode: str = "auto"
    # The Deployment is gone (someone deleted it): the caller reconciles to recreate it.
    needs_reconcile: bool = False


async def tick(
    kube: KubeAPI,
    source: MetricsSource,
    body: dict[str, Any],
    now: float,
    scale_in: ScaleInWindow | None = None,
    recent: tuple[tuple[float, float], ...] = (),
) -> TickResult:
    """One scaling decision for one InferenceDeployment."""
    if body.get("metadata", {}).get("deletionTimestamp"):
        return TickResult(Outcome())  # going away: its children are being collected
    parsed = parse(body.get("spec"))
    if parsed.spec is None or parsed.sizing is None or not parsed.sizing.feasible:
        return TickResult(Outcome())  # reconcile() reports why; nothing to scale
    spec, sizing = parsed.spec, parsed.sizing
    owner = owner_of(body)
    status = body.get("status") or {}

    live = await asyncio.to_thread(kube.get, "apps/v1", "Deployment", owner.namespace, owner.name)
    if live is None:
        # Someone deleted the Deployment: recreate the children rather than wait for an update.
        return TickResult(Outcome(), needs_reconcile=True)
    current = int(live.get("spec", {}).get("replicas", 1) or 0)
    pods = await asyncio.to_thread(
        kube.list, "v1", "Pod", owner.namespace, selector_string(owner.name)
    )
    infos = pod_infos(pods, parse_time)
    target = Target(owner.namespace, owner.name, spec.scaling.prometheus_url)
    metrics_error: str | None = None
    try:
        samples = await source.sample(target, infos)
    except MetricsError as exc:
        samples, metrics_error = {}, str(exc)

    last_up, last_down = last_changes(status)
    d = decide(
        Inputs(
            now=now,
            current_replicas=current,
            pods=views(infos, samples),
            policy=policy_for(spec, sizing),
            last_scale_up_at=last_up,
            last_scale_down_at=last_down,
            scale_in=scale_in,
            recent=recent,
        )
    )
    if metrics_error and d.reason == "MetricsUnavailable":
        d = _with_message(d, metrics_error)

    out = Outcome()
    st = out.status
    auto = spec.scaling.mode == "auto"
    records = list(status.get("lastDecisions") or [])
    applied_replicas = current
    if d.replicas != current and auto:
        manifest = deployment(owner, spec, sizing, d.replicas)
        try:
            applied = await asyncio.to_thread(with_retries, lambda: kube.apply(manifest))
        except KubeError as exc:
            out.events.append(Event("Warning", "ScaleFailed", f"{current} -> {d.replicas}: {exc}"))
            raise
        applied_replicas = int(applied.get("spec", {}).get("replicas", d.replicas))
        live = applied
        verb = "ScaledOut" if d.replicas > current else "ScaledIn"
        out.events.append(Event("Normal", verb, f"{current} -> {d.replicas}: {d.message}"))
        records.append(decision_record(d, current, now, applied=True))
        log.info(
            "scaled %s/%s %d -> %d (%s)", owner.namespace, owner.name, current, d.replicas,
            d.reason, extra={"namespace": owner.namespace, "inferencedeployment": owner.name,
                             "from": current, "to": d.replicas, "reason": d.reason},
        )  # fmt: skip
    elif not auto and d.replicas != status.get("desiredReplicas"):
        if d.replicas != current:
            out.events.append(
                Event("Normal", "Advised", f"advisory: {current} -> {d.replicas}: {d.message}")
            )
        records.append(decision_record(d, current, now, applied=False))
    else:
        log.debug("hold %s/%s at %d: %s", owner.namespace, owner.name, current, d.message)
    if records != list(status.get("lastDecisions") or []):
        st["lastDecisions"] = records[-MAX_DECISIONS:]

    st["desiredReplicas"] = d.replicas
    st["replicas"] = applied_replicas
    st["readyReplicas"] = d.figures.ready
    st["kv"] = kv_status(d, now)
    _conditions(body, st, d, auto, current, now, out)
    ready = ready_condition(live)
    set_status_condition(body, st, "Ready", *ready, now)
    return TickResult(
        out, d, d.scale_in, d.recent, current=applied_replicas, mode=spec.scaling.mode
    )


def _with_message(d: Decision, message: str) -> Decision:
    return replace(d, message=message + f"; holding {d.replicas}", limited_message=message)


def _conditions(
    body: dict[str, Any],
    st: dict[str, Any],
    d: Decision,
    auto: bool,
    current: int,
    now: float,
    out: Outcome,
) -> None:
    f = d.figures
    if d.metrics == "missing":
        set_status_condition(
            body, st, "KVSaturated", "Unknown", "MetricsUnavailable", d.message, now
        )
    elif d.saturated:
        reason = "Preempting" if f.preemption_rate > 0 else "CacheFull"
        if condition_changed(body, "KVSaturated", "True", reason):
            out.events.append(Event("Warning", "KVSaturated", d.saturated_message))
        set_status_condition(body, st, "KVSaturated", "True", reason, d.saturated_message, now)
    else:
        eta = "not growing" if f.min_eta_seconds is None else f"{f.min_eta_seconds:.0f} s"
        msg = (
            f"mean occupancy {f.mean_occupancy or 0:.0%}, max {f.max_occupancy or 0:.0%}, "
            f"soonest saturation {eta}, {f.waiting} waiting, {f.reporting}/{f.ready} pods report"
        )
        set_status_condition(body, st, "KVSaturated", "False", "WithinCapacity", msg, now)

    if d.limited:
        reason, msg = (
            d.limited,
            f"{d.limited_message}: {d.message}" if d.limited_message else d.message,
        )
    elif f.stuck:
        reason, msg = (
            "PodsNotReady",
            (
                f"{f.stuck} pod(s) not ready after the startup grace: no GPU node free, image pull "
                f"or model load failing? They still count as capacity on the way"
            ),
        )
    elif not auto and d.replicas != current:
        reason, msg = (
            "Advisory",
            f"advisory mode: recommends {d.replicas}, Deployment has {current}",
        )
    else:
        set_status_condition(
            body, st, "ScalingLimited", "False", "WithinLimits", d.message or d.reason, now
        )
        return
    if condition_changed(body, "ScalingLimited", "True", reason):
        out.events.append(Event("Warning" if reason != "Advisory" else "Normal", reason, msg))
    set_status_condition(body, st, "ScalingLimited", "True", reason, msg, now)
