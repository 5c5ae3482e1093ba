"""The scaling loop's tick: observe pods and KV metrics, call `decide()`, act, report.

A shell: everything it decides comes from `decide.decide`; everything it writes is returned as
an `Outcome` (the status this loop owns, and Events), except the change of replicas itself,
which in auto mode is the point of the tick: a patch of the Deployment's scale subresource.
The decision's `Memory` goes in and comes back out; its one owner is the per-resource daemon in
handlers.py, which calls `tick()` every `scaling.intervalSeconds`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, replace
from typing import Any

from headroom.contract.admission import DEFAULT_WATERMARK
from headroom.operator.crd.models import (
    CONDITION_TYPES,
    MAX_DECISIONS,
    DecisionInputs,
    DecisionRecord,
    InferenceDeploymentSpec,
    KVStatus,
)
from headroom.operator.kube import KubeAPI, KubeError, owner_of, with_retries
from headroom.operator.reconcile.adoption import conflict
from headroom.operator.reconcile.children import selector_string
from headroom.operator.reconcile.sizing import Parsed, Sizing, blocks_per_sequence
from headroom.operator.scaling.decide import (
    Decision,
    Inputs,
    Memory,
    PodSample,
    PodView,
    Policy,
    decide,
)
from headroom.operator.scaling.metrics_sources import (
    MetricsError,
    MetricsSource,
    PodInfo,
    ScrapeTarget,
    pod_infos,
)
from headroom.operator.status import (
    SCALING_MANAGER,
    Event,
    Outcome,
    Status,
    carried,
    condition_changed,
    get_condition,
    infeasible_ready,
    log_fields,
    parse_time,
    ready_condition,
    replica_counts,
    rfc3339,
    set_status_condition,
)

log = logging.getLogger("headroom.operator.scaling.loop")
# A running pool within this of the plan is the plan (pools round to whole pages).
POOL_TOLERANCE = 0.02


def policy_for(spec: InferenceDeploymentSpec, sizing: Sizing) -> Policy:
    """The decision policy of a spec, with the planned pod capacity."""
    s = spec.scaling
    return Policy(
        min_replicas=s.min_replicas,
        max_replicas=s.max_replicas,
        blocks_per_pod=max(1, sizing.plan.kv_blocks_per_pod),
        blocks_per_sequence=blocks_per_sequence(spec, sizing.plan.block_size),
        target_occupancy=s.target_occupancy,
        scale_out_occupancy=s.scale_out_occupancy,
        scale_in_hysteresis=s.scale_in_hysteresis,
        scale_up_stabilization_seconds=float(s.scale_up_stabilization_seconds),
        scale_down_stabilization_seconds=(
            None
            if s.scale_down_stabilization_seconds is None
            else float(s.scale_down_stabilization_seconds)
        ),
        max_scale_up_pods=s.max_scale_up_pods,
        max_scale_down_pods=s.max_scale_down_pods,
        metrics_max_age_seconds=float(s.metrics_max_age_seconds),
        startup_grace_seconds=float(s.startup_grace_seconds),
        warmup_seconds=float(s.warmup_seconds),
        growth_window_seconds=float(s.growth_window_seconds),
        interval_seconds=float(s.interval_seconds),
        pod_start_seconds=float(s.pod_start_seconds),
        forecast_quantile=s.forecast_quantile,
        # headroom's engine admits only while its watermark stays free; vLLM and SGLang fill
        # their pools and preempt.
        usable_occupancy=1.0 - DEFAULT_WATERMARK if spec.engine.runtime == "headroom" else 1.0,
    )


def last_changes(status: dict[str, Any]) -> tuple[float | None, float | None]:
    """(last scale-up, last scale-down) times from status.lastDecisions: the changes made, not
    the advisory recommendations (a tick forgets those too)."""
    up = down = None
    for rec in status.get("lastDecisions") or []:
        t = parse_time(rec.get("time"))
        if t is None or rec.get("applied") is False:
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
    eta = _r(f.min_eta_seconds)
    fc = f.forecast
    occupancy, hit = _r(f.mean_occupancy), _r(f.hit_ratio)
    kv = KVStatus(
        occupancy=occupancy,
        occupancy_percent=round(100 * occupancy) if occupancy is not None else None,
        max_occupancy=_r(f.max_occupancy),
        hit_ratio=hit,
        hit_percent=round(100 * hit) if hit is not None else None,
        eta_seconds=round(eta) if eta is not None else None,
        eta=_eta_column(eta, f.forecast_pending) if f.reporting else None,
        waiting=f.waiting if f.reporting else None,
        preemption_rate_per_second=_r(f.preemption_rate) if f.reporting else None,
        pods_reporting=f.reporting,
        demand_blocks=_r(f.demand_blocks),
        arrival_rate_per_second=_r(f.arrival_rate),
        forecast_blocks=_r(fc.mean) if fc else None,
        forecast_band_blocks=_r(fc.band) if fc else None,
        horizon_seconds=_r(fc.horizon) if fc else None,
        observed_at=rfc3339(now),
    )
    return kv.merge_patch()


def _eta_column(eta: float | None, pending: int) -> str:
    """status.kv.eta: the soonest saturation; with none forecast, "steady" only when every
    reporting pod has a forecast that says not growing, "pending" while one has none yet."""
    if eta is not None:
        return f"{eta:.0f}s"
    return "pending" if pending else "steady"


def _eta_words(eta: float | None, pending: int) -> str:
    """The soonest saturation for the KVSaturated message (see `_eta_column`)."""
    if eta is None:
        return "no forecast yet" if pending else "not growing"
    return f"{eta:.0f} s" + (f" ({pending} pod(s) with no forecast yet)" if pending else "")


def decision_record(d: Decision, current: int, now: float, applied: bool) -> dict[str, Any]:
    """One entry of status.lastDecisions."""
    f = d.figures
    fc = f.forecast
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
            present_blocks=_r(f.present_blocks),
            forecast_blocks=_r(fc.mean) if fc else None,
            forecast_band_blocks=_r(fc.band) if fc else None,
            horizon_seconds=_r(fc.horizon) if fc else None,
            needed_replicas=f.needed_replicas,
        ),
    )
    return rec.wire()


def _r(x: float | None) -> float | None:
    # Status is JSON for the API server: no NaN or infinity, whatever a source let through.
    return None if x is None or not math.isfinite(x) else round(x, 4)


def pool_condition(samples: dict[str, PodSample], planned: int) -> tuple[Status, str, str]:
    """PoolMatchesPlan: whether every reporting pod runs the KV pool the plan sized it for (an
    engine that profiles less memory than planned quietly runs a smaller pool)."""
    pools = {name: s.capacity_blocks for name, s in samples.items() if s.capacity_blocks}
    if not pools:
        return "Unknown", "NoPoolReported", "no pod reports its KV pool size"
    name, smallest = min(pools.items(), key=lambda kv: kv[1])
    if smallest < planned * (1 - POOL_TOLERANCE):
        return (
            "False",
            "PoolBelowPlan",
            f"pod {name} runs {smallest:,} KV blocks against the {planned:,} planned "
            f"({smallest / planned:.0%}): each pod holds fewer sequences than the plan says",
        )
    return "True", "PoolAsPlanned", f"{len(pools)} pod(s) run at least the {planned:,} planned"


@dataclass
class TickResult:
    """A tick's outcome, the decision, and the memory to hand the next tick."""

    outcome: Outcome
    memory: Memory
    decision: Decision | None = None
    current: int | None = None
    mode: str = "auto"
    # Why the tick did not do its job, though it decided and reports it in status: "scale"
    # (the scale was refused) or "metrics" (the metrics source could not be read).
    failure: str | None = None


def seeded(memory: Memory | None, status: dict[str, Any]) -> Memory:
    """The memory to decide with: the loop's own, or after a restart what status kept."""
    if memory is not None:
        return memory
    up, down = last_changes(status)
    return Memory(last_up=up, last_down=down)


async def tick(
    kube: KubeAPI,
    source: MetricsSource,
    body: dict[str, Any],
    parsed: Parsed,
    now: float,
    memory: Memory | None = None,
) -> TickResult:
    """One scaling decision for one InferenceDeployment (`parsed`: its spec, parsed and sized
    once by the caller)."""
    status = body.get("status") or {}
    mem = seeded(memory, status)
    if body.get("metadata", {}).get("deletionTimestamp"):
        return TickResult(Outcome(), mem)  # going away: its children are being collected
    if parsed.spec is None or parsed.sizing is None:
        return TickResult(Outcome(), mem)  # reconcile() reports why; nothing to scale
    spec, sizing = parsed.spec, parsed.sizing
    owner = owner_of(body)

    live = await asyncio.to_thread(kube.get, "apps/v1", "Deployment", owner.namespace, owner.name)
    if live is None:
        # Not created yet, or deleted: the reconcile loop (and its watch on the Deployment)
        # brings it back; there is nothing to scale until it does.
        return TickResult(Outcome(), mem)
    if conflict("Deployment", live, owner) is not None:
        # Someone else's Deployment under this name: reconcile() reports NameConflict, and
        # scaling it would resize their workload.
        return TickResult(Outcome(), mem)
    if not sizing.feasible:
        return TickResult(infeasible_outcome(body, live, now), mem)
    current = replica_counts(live)[0]
    pods = await asyncio.to_thread(
        kube.list, "v1", "Pod", owner.namespace, selector_string(owner.name)
    )
    infos = pod_infos(pods, parse_time)
    target = ScrapeTarget(owner.namespace, owner.name, spec.scaling.prometheus_url)
    metrics_error: str | None = None
    try:
        samples = await source.sample(target, infos)
    except MetricsError as exc:
        samples, metrics_error = {}, str(exc)

    policy = policy_for(spec, sizing)
    d = decide(
        Inputs(
            now=now,
            current_replicas=current,
            pods=views(infos, samples),
            policy=policy,
            memory=mem,
            learned_pod_start_seconds=status.get("podStartSeconds"),
        )
    )
    if metrics_error and d.reason == "MetricsUnavailable":
        d = _with_message(d, metrics_error)

    out = Outcome()
    st = out.status
    auto = spec.scaling.mode == "auto"
    records = list(status.get("lastDecisions") or [])
    applied_replicas = current
    scaled, scale_failed = False, None
    if d.replicas != current and auto:
        try:
            applied_replicas = await asyncio.to_thread(
                with_retries,
                lambda: kube.scale(owner.namespace, owner.name, d.replicas,
                                   field_manager=SCALING_MANAGER),
            )  # fmt: skip
            scaled = True
        except KubeError as exc:
            # Reported, not raised: the tick's status and a Warning say the Deployment stayed
            # at `current` and why (an RBAC denial, an admission webhook), and the decision's
            # memory records no change.
            scale_failed = f"could not scale {current} -> {d.replicas}: {exc}"
    if scaled:
        live = {**live, "spec": {**live.get("spec", {}), "replicas": applied_replicas}}
        verb = "ScaledOut" if d.replicas > current else "ScaledIn"
        out.events.append(Event("Normal", verb, f"{current} -> {d.replicas}: {d.message}"))
        records.append(decision_record(d, current, now, applied=True))
        log.info(
            "scaled %s/%s %d -> %d (%s)", owner.namespace, owner.name, current, d.replicas,
            d.reason, extra={**log_fields(owner.namespace, owner.name), "from": current,
                             "to": d.replicas, "reason": d.reason},
        )  # fmt: skip
    else:
        # Nothing acted on: the decision's record of a change must not stand.
        d = replace(d, memory=replace(d.memory, last_up=mem.last_up, last_down=mem.last_down))
        if not auto and d.replicas != status.get("desiredReplicas"):
            if d.replicas != current:
                out.events.append(
                    Event("Normal", "Advised", f"advisory: {current} -> {d.replicas}: {d.message}")
                )
            records.append(decision_record(d, current, now, applied=False))
        else:
            log.debug("hold %s/%s at %d: %s", owner.namespace, owner.name, current, d.message)
    # This loop owns lastDecisions: it is written whole every time (an apply that left it out
    # would remove it).
    st["lastDecisions"] = records[-MAX_DECISIONS:]
    st["desiredReplicas"] = d.replicas
    st["replicas"] = applied_replicas
    st["readyReplicas"] = d.figures.ready
    st["kv"] = kv_status(d, now)
    starts = d.memory.pod_starts
    if d.figures.pod_start_seconds is not None and (starts or "podStartSeconds" in status):
        st["podStartSeconds"] = round(d.figures.pod_start_seconds, 1)
        st["podStartsObserved"] = max(len(starts), int(status.get("podStartsObserved") or 0))
    else:
        # A tick that stopped before the horizon (no metrics, no pods, spec bounds) learned
        # nothing; leaving the fields out of this apply would delete what earlier ticks learned,
        # the only copy a restarted operator has.
        st |= carried(status, ("podStartSeconds", "podStartsObserved"), ())
    _conditions(body, st, d, auto, current, now, out, scale_failed)
    if not reconcile_failed(body):
        set_status_condition(body, st, "Ready", *ready_condition(live), now)
    set_status_condition(
        body, st, "PoolMatchesPlan", *pool_condition(samples, policy.blocks_per_pod), now
    )
    failure = "scale" if scale_failed else "metrics" if metrics_error else None
    return TickResult(
        out, d.memory, d, current=applied_replicas, mode=spec.scaling.mode, failure=failure
    )


# Ready reasons the reconcile loop sets when the spec's children could not be applied (or, for
# an infeasible spec, were not): the Deployment still running is the previous spec's, so its
# readiness is not this spec's.
RECONCILE_FAILURES = frozenset(
    {"ApplyFailed", "NameConflict", "InvalidSpec", "InvalidName", "Infeasible"}
)
# What this loop writes each tick besides its conditions: a status apply that left one out
# would delete it, so a tick that decides nothing carries them forward.
_SCALING_FIELDS = ("lastDecisions", "desiredReplicas", "kv", "podStartSeconds",
                   "podStartsObserved")  # fmt: skip


def reconcile_failed(body: dict[str, Any]) -> bool:
    """Whether the reconcile loop reported, for this generation, that its children were not
    applied, or that the spec cannot be sized (then Ready is its to say, not read off the
    previous spec's Deployment)."""
    ready = get_condition((body.get("status") or {}).get("conditions"), "Ready")
    return (
        ready is not None
        and ready.get("status") == "False"
        and ready.get("reason") in RECONCILE_FAILURES
        and ready.get("observedGeneration") == body.get("metadata", {}).get("generation")
    )


def rebase_ready(
    status: dict[str, Any], computed_from: dict[str, Any], fresh: dict[str, Any]
) -> dict[str, Any]:
    """A tick's `status`, computed from `computed_from`, to apply over `fresh`: the object as
    read again after the apply met a newer one (409 on the read's resourceVersion). When
    `fresh` says Ready is not the running Deployment's to say (the reconcile reported its
    children not applied, or the spec infeasible, for its current generation), or holds a
    newer generation than the tick saw (whose Deployment the tick did not read), the tick
    carries `fresh`'s Ready as it stands: the same values, so server-side apply keeps the
    field co-owned instead of the tick's stale Ready replacing it. Otherwise `status`."""
    generation = fresh.get("metadata", {}).get("generation")
    moved = generation != computed_from.get("metadata", {}).get("generation")
    held = get_condition((fresh.get("status") or {}).get("conditions"), "Ready")
    if held is None or not (moved or reconcile_failed(fresh)):
        return status
    mine = [c for c in status.get("conditions", []) if c.get("type") != "Ready"]
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    conditions = sorted([*mine, dict(held)], key=lambda c: order.get(str(c.get("type")), 99))
    return {**status, "conditions": conditions}


def infeasible_outcome(body: dict[str, Any], live: dict[str, Any], now: float) -> Outcome:
    """A tick for a spec that cannot be sized: the last feasible Deployment keeps running,
    unscaled; its replicas stay current, Ready stays False (reason Infeasible, the running
    Deployment's readiness in its message: nothing of this spec was applied), and
    ScalingLimited says why nothing scales. The rest of this loop's status is carried forward
    as it was."""
    out = Outcome()
    st = out.status
    st |= carried(body.get("status") or {}, _SCALING_FIELDS, ("KVSaturated", "PoolMatchesPlan"))
    st["replicas"], st["readyReplicas"] = replica_counts(live)
    message = (
        "the spec is infeasible (see the Feasible condition): the running Deployment keeps its "
        f"last feasible configuration at {st['replicas']} replicas and is not scaled"
    )
    if condition_changed(body, "ScalingLimited", "True", "Infeasible"):
        out.events.append(Event("Warning", "ScalingStopped", message))
    set_status_condition(body, st, "ScalingLimited", "True", "Infeasible", message, now)
    set_status_condition(body, st, "Ready", *infeasible_ready(live), now)
    return out


def _with_message(d: Decision, message: str) -> Decision:
    # decide()'s limited_message ("scaling holds while ...") stays the condition's lead-in.
    return replace(d, message=message + f"; holding {d.replicas}")


def _conditions(
    body: dict[str, Any],
    st: dict[str, Any],
    d: Decision,
    auto: bool,
    current: int,
    now: float,
    out: Outcome,
    scale_failed: str | None = None,
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
        eta = _eta_words(f.min_eta_seconds, f.forecast_pending)
        msg = (
            f"mean occupancy {f.mean_occupancy or 0:.0%}, max {f.max_occupancy or 0:.0%}, "
            f"soonest saturation {eta}, {f.waiting} waiting, {f.reporting}/{f.ready} pods report"
        )
        set_status_condition(body, st, "KVSaturated", "False", "WithinCapacity", msg, now)

    if scale_failed is not None:
        reason, msg = "ScaleFailed", scale_failed
    elif d.limited:
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
