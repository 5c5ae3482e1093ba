"""The scaling decision: pure, deterministic, and free of Kubernetes.

It acts on time-to-saturation rather than a fixed percentage. The rules, in order:

1. Bounds first: replicas outside [min, max] (the spec changed) go to the nearest bound.
2. No fresh sample from any ready pod: hold (fail static) and say why. Absent metrics never
   move replicas in either direction.
3. Scale out when a ready pod's saturation ETA is inside the lookahead, the mean occupancy is
   above `scale_out_occupancy`, or pods are preempting. The step comes from the KV math: the
   replicas that bring the projected demand (used blocks + waiting requests + growth over the
   lookahead) to `target_occupancy`. The growth projected is the sidecars' 30 s slope only as
   far as the deployment's total demand over the last `growth_window_seconds` of decisions
   confirms it: arrivals are bursty, and a burst extrapolated over minutes is not a trend.
   The step is taken only when that projection, over the whole deployment, crosses
   `scale_out_occupancy`; otherwise the trigger came from one unevenly loaded pod or a short
   burst, which more pods would not fix: hold and say so.
4. Pods that exist but are not ready yet (loading weights) count as capacity on the way, so
   a scale-out already in flight is not repeated while they load. A pod that became ready
   less than `warmup_seconds` ago fills from the backlog, and after a scale-in the remaining
   pods take over the removed pods' load; for `warmup_seconds` those slopes are redistribution,
   not demand growth, so they are left out (used blocks still count, and so do the occupancy
   and preemption triggers).
5. Scale in only when every ready pod reports, nothing is starting, and the occupancy after
   removal stays below `target - hysteresis` (and would not fill within the lookahead at the
   current growth) for the whole down-stabilization window, and no scale-up happened within
   it; then go to the highest count recommended during the window (HPA's sliding window).
6. Pods being removed still hold KV and their load moves to the others: their used blocks and
   (negative) growth count, so the pods left behind filling up is not mistaken for growth.
7. Step sizes are capped (max pods per step), and a scale-up within the up-stabilization
   window of the previous one is deferred; scale-in steps are `warmup_seconds` apart so each
   redistribution settles before the next.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from headroom.contract.forecast import least_squares_slope

Action = Literal["scale-out", "scale-in", "hold"]
MetricsState = Literal["ok", "partial", "missing"]


@dataclass(frozen=True, slots=True)
class PodSample:
    """One pod's KV state as its sidecar (or Prometheus) reports it."""

    occupancy: float
    sampled_at: float  # unix seconds
    eta_seconds: float | None = None  # None: not growing
    waiting: int = 0
    running: int = 0
    preemption_rate: float = 0.0  # preemptions per second over the last minute
    hit_ratio: float | None = None
    used_blocks: int | None = None
    capacity_blocks: int | None = None
    growth_blocks_per_second: float | None = None
    engine_up: bool = True


@dataclass(frozen=True, slots=True)
class PodView:
    """A pod of the deployment: readiness from Kubernetes, sample from metrics (if any)."""

    name: str
    ready: bool
    created_at: float
    terminating: bool = False
    sample: PodSample | None = None
    ready_since: float | None = None  # when it last became ready (None: long ago / unknown)


@dataclass(frozen=True, slots=True)
class Policy:
    """The spec's scaling policy plus the planned pod capacity. No defaults: the CRD model
    (models.ScalingSpec) holds them, and `scaling.policy_for` is the one place that builds it."""

    min_replicas: int
    max_replicas: int
    blocks_per_pod: int  # the planned pool, used when a pod does not report its capacity
    blocks_per_sequence: float  # what one waiting request will claim
    target_occupancy: float
    scale_out_occupancy: float
    scale_in_hysteresis: float
    lookahead_seconds: float
    scale_up_stabilization_seconds: float
    scale_down_stabilization_seconds: float
    max_scale_up_pods: int
    max_scale_down_pods: int
    metrics_max_age_seconds: float
    startup_grace_seconds: float
    warmup_seconds: float
    growth_window_seconds: float

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= min {self.min_replicas} <= max {self.max_replicas}")
        if not 0 < self.target_occupancy < self.scale_out_occupancy <= 1:
            raise ValueError("need 0 < target_occupancy < scale_out_occupancy <= 1")
        if not 0 <= self.scale_in_hysteresis < self.target_occupancy:
            raise ValueError("need 0 <= scale_in_hysteresis < target_occupancy")
        if self.blocks_per_pod < 1 or self.blocks_per_sequence <= 0:
            raise ValueError("a pod must hold at least one block and a sequence some blocks")


@dataclass(frozen=True, slots=True)
class ScaleInWindow:
    """Since when scale-in has been possible, and the recommendations inside the window."""

    since: float
    history: tuple[tuple[float, int], ...]  # (time, replicas recommended), oldest first

    @property
    def replicas(self) -> int:
        """The highest count recommended inside the window: the safe scale-in target."""
        return max(r for _, r in self.history)


@dataclass(frozen=True, slots=True)
class Inputs:
    """Everything one decision looks at."""

    now: float
    current_replicas: int  # what the Deployment asks for
    pods: tuple[PodView, ...]
    policy: Policy
    last_scale_up_at: float | None = None
    last_scale_down_at: float | None = None
    scale_in: ScaleInWindow | None = None
    recent: tuple[tuple[float, float], ...] = ()  # earlier decisions' (time, present demand)


@dataclass(frozen=True, slots=True)
class Figures:
    """The numbers behind a decision (for status, events and logs)."""

    ready: int
    starting: int
    reporting: int
    mean_occupancy: float | None = None
    max_occupancy: float | None = None
    min_eta_seconds: float | None = None
    waiting: int = 0
    preemption_rate: float = 0.0
    hit_ratio: float | None = None
    demand_blocks: float | None = None
    projected_occupancy: float | None = None  # demand over current replicas' capacity
    growth_blocks_per_second: float | None = None  # the sidecars' slope, before confirmation
    present_blocks: float | None = None  # used (incl. draining) + waiting requests' blocks
    stuck: int = 0  # pods not ready after the startup grace


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do, why, and what stood in the way."""

    replicas: int
    action: Action
    reason: str  # CamelCase, used as the Event reason
    message: str
    figures: Figures
    metrics: MetricsState
    limited: str | None = None  # CamelCase reason when bounds, rate or metrics held it back
    limited_message: str = ""
    saturated: bool = False
    saturated_message: str = ""
    scale_in: ScaleInWindow | None = None
    recent: tuple[tuple[float, float], ...] = field(default=())  # feed back as Inputs.recent


def _fresh(pod: PodView, now: float, max_age: float) -> bool:
    s = pod.sample
    return s is not None and s.engine_up and now - s.sampled_at <= max_age


def _capacity(sample: PodSample, policy: Policy) -> int:
    return sample.capacity_blocks or policy.blocks_per_pod


def _used(sample: PodSample, policy: Policy) -> float:
    if sample.used_blocks is not None:
        return float(sample.used_blocks)
    return sample.occupancy * _capacity(sample, policy)


def _growth(sample: PodSample, policy: Policy) -> float:
    """Net blocks per second the pod's KV use changes by (negative while it drains)."""
    if sample.growth_blocks_per_second is not None:
        return sample.growth_blocks_per_second
    if sample.eta_seconds is None or sample.eta_seconds <= 0:
        return 0.0
    free = max(0.0, _capacity(sample, policy) - _used(sample, policy))
    return free / sample.eta_seconds


def clamp(n: int, lo: int, hi: int) -> int:
    """n within [lo, hi]: the replica bounds, for decide() and for reconcile's first count."""
    return max(lo, min(hi, n))


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


@dataclass(frozen=True, slots=True)
class _Pods:
    """The pods as one decision sees them (rules 4 and 6 decide what counts)."""

    ready: int
    on_the_way: int  # asked for but not ready: loading, scheduling or not yet created
    stuck: int  # not ready after the startup grace
    samples: list[PodSample]  # fresh samples of ready pods
    settled: list[PodSample]  # of those, pods whose growth is demand (rule 4)
    draining: list[PodSample]  # fresh samples of pods being removed (rule 6)
    redistributing: bool  # within warmup_seconds of a scale-in
    metrics: MetricsState


@dataclass(frozen=True, slots=True)
class _Demand:
    """The deployment's KV demand in blocks, from the pods that report."""

    capacity: float  # blocks per pod
    present: float  # used (incl. draining) + waiting requests' blocks
    measured: float  # the sidecars' growth, blocks per second, before confirmation
    growth: float  # confirmed growth, blocks per second, >= 0
    demand: float  # present + growth over the lookahead
    mean_occupancy: float
    min_eta: float | None
    preempt: float
    waiting: int  # requests queued at the reporting pods
    recent: tuple[tuple[float, float], ...]  # the demand history, this decision's included


def decide(inp: Inputs) -> Decision:
    """Decide the replica count for one InferenceDeployment: the rules of the module docstring,
    in order, the first that decides wins."""
    pods = _pods(inp)
    base = Decision(
        replicas=inp.current_replicas,
        action="hold",
        reason="Hold",
        message="",
        figures=Figures(
            ready=pods.ready,
            starting=pods.on_the_way,
            reporting=len(pods.samples),
            stuck=pods.stuck,
        ),
        metrics=pods.metrics,
        scale_in=inp.scale_in,
    )
    decided = _rule_bounds(inp, base) or _rule_no_metrics(inp, pods, base)
    if decided is not None:
        return decided
    d = _measure(inp, pods)
    base = _with_figures(inp, pods, d, base)
    return _rule_scale_out(inp, pods, d, base) or _rule_scale_in(inp, pods, d, base)


def _pods(inp: Inputs) -> _Pods:
    """Rules 4 and 6: which pods count as ready, starting, settled and draining."""
    p, now = inp.policy, inp.now
    live = [pod for pod in inp.pods if not pod.terminating]
    ready = [pod for pod in live if pod.ready]
    fresh = [pod for pod in ready if _fresh(pod, now, p.metrics_max_age_seconds)]
    samples = [pod.sample for pod in fresh if pod.sample is not None]
    draining = [
        pod.sample
        for pod in inp.pods
        if pod.terminating
        and pod.sample is not None
        and _fresh(pod, now, p.metrics_max_age_seconds)
    ]
    redistributing = (
        inp.last_scale_down_at is not None and now - inp.last_scale_down_at < p.warmup_seconds
    )
    settled = [
        pod.sample
        for pod in fresh
        if pod.sample is not None
        and not redistributing
        and (pod.ready_since is None or now - pod.ready_since >= p.warmup_seconds)
    ]
    metrics: MetricsState = (
        "missing" if not samples else "partial" if len(samples) < len(ready) else "ok"
    )
    return _Pods(
        ready=len(ready),
        on_the_way=max(0, inp.current_replicas - len(ready)),
        stuck=sum(
            1 for pod in live if not pod.ready and now - pod.created_at > p.startup_grace_seconds
        ),
        samples=samples,
        settled=settled,
        draining=draining,
        redistributing=redistributing,
        metrics=metrics,
    )


def _rule_bounds(inp: Inputs, base: Decision) -> Decision | None:
    """Rule 1: replicas outside [min, max] go to the nearest bound."""
    p, current = inp.policy, inp.current_replicas
    bounded = clamp(current, p.min_replicas, p.max_replicas)
    if bounded == current:
        return None
    word = "minReplicas" if bounded > current else "maxReplicas"
    return replace(
        base,
        replicas=bounded,
        action="scale-out" if bounded > current else "scale-in",
        reason="SpecBounds",
        message=f"{current} replicas is outside [{p.min_replicas}, {p.max_replicas}]; "
        f"moving to {word} {bounded}",
        scale_in=None,
    )


def _rule_no_metrics(inp: Inputs, pods: _Pods, base: Decision) -> Decision | None:
    """Rule 2: no fresh sample from any ready pod: hold (fail static) and say why."""
    if pods.samples:
        return None
    p, current = inp.policy, inp.current_replicas
    if not pods.ready:
        return replace(
            base,
            reason="WaitingForPods",
            message=f"0/{current} pods ready; {pods.on_the_way} on the way, nothing to measure yet",
            scale_in=None,
        )
    return replace(
        base,
        reason="MetricsUnavailable",
        message=f"no fresh KV metrics from any of {pods.ready} ready pods "
        f"(older than {p.metrics_max_age_seconds:.0f} s or absent); holding {current}",
        limited="MetricsUnavailable",
        limited_message="scaling holds while KV metrics are missing or stale",
        scale_in=None,
    )


def _measure(inp: Inputs, pods: _Pods) -> _Demand:
    """Demand, measured on the reporting pods and extrapolated to the silent ready ones, with
    the growth the deployment's total confirms (rule 3) and draining pods' load (rule 6)."""
    p, now = inp.policy, inp.now
    samples, settled, draining = pods.samples, pods.settled, pods.draining
    capacity = sum(_capacity(s, p) for s in samples) / len(samples)
    used = sum(_used(s, p) for s in samples)
    # Net growth of the settled pods, extrapolated to all ready pods: per-pod noise cancels,
    # and a deployment whose pods fill and drain in turn is not growing.
    growth = sum(_growth(s, p) for s in settled) / len(settled) if settled else 0.0
    waiting = sum(s.waiting for s in samples)
    used_all = used * pods.ready / len(samples) + sum(_used(s, p) for s in draining)
    measured = growth * pods.ready + sum(_growth(s, p) for s in draining)
    present = used_all + waiting * p.blocks_per_sequence
    # The sidecars fit 30 s; projected over a lookahead of minutes that slope mostly carries
    # arrival noise. Only growth that also shows in the deployment's total demand over the
    # last `growth_window_seconds` of decisions is projected.
    recent = tuple(r for r in inp.recent if r[0] >= now - p.growth_window_seconds and r[0] < now)
    recent += ((now, present),)
    observed = least_squares_slope(recent)
    confirmed = measured if observed is None else min(measured, observed)
    growth_all = max(0.0, confirmed)
    etas = [s.eta_seconds for s in settled if s.eta_seconds is not None]
    return _Demand(
        capacity=capacity,
        present=present,
        measured=measured,
        growth=growth_all,
        demand=present + growth_all * p.lookahead_seconds,
        mean_occupancy=sum(s.occupancy for s in samples) / len(samples),
        min_eta=min(etas) if etas else None,
        preempt=sum(s.preemption_rate for s in samples),
        waiting=waiting,
        recent=recent,
    )


def _with_figures(inp: Inputs, pods: _Pods, d: _Demand, base: Decision) -> Decision:
    """The measured figures, saturation and the demand history on the base decision."""
    samples = pods.samples
    max_occ = max(s.occupancy for s in samples)
    hits = [s.hit_ratio for s in samples if s.hit_ratio is not None]
    figures = replace(
        base.figures,
        mean_occupancy=d.mean_occupancy,
        max_occupancy=max_occ,
        min_eta_seconds=d.min_eta,
        waiting=d.waiting,
        preemption_rate=d.preempt,
        hit_ratio=sum(hits) / len(hits) if hits else None,
        demand_blocks=d.demand,
        projected_occupancy=d.demand / (inp.current_replicas * d.capacity),
        growth_blocks_per_second=d.measured,
        present_blocks=d.present,
    )
    saturated = max_occ >= 1.0 or d.preempt > 0
    sat_msg = (
        f"KV cache full or preempting: max occupancy {max_occ:.0%}, "
        f"{d.preempt:.2f} preemptions/s, {d.waiting} waiting"
        if saturated
        else ""
    )
    return replace(
        base, figures=figures, saturated=saturated, saturated_message=sat_msg, recent=d.recent
    )


def _rule_scale_out(inp: Inputs, pods: _Pods, d: _Demand, base: Decision) -> Decision | None:
    """Rule 3 (with 4's capacity on the way and 7's step caps): scale out on a near
    saturation ETA, high occupancy or preemption, when the deployment's projection confirms."""
    p, now, current = inp.policy, inp.now, inp.current_replicas
    eta_hit = d.min_eta is not None and d.min_eta < p.lookahead_seconds
    occ_hit = d.mean_occupancy > p.scale_out_occupancy
    if not (eta_hit or occ_hit or d.preempt > 0):
        return None
    if d.preempt > 0:
        reason, why = "Preempting", f"{d.preempt:.2f} preemptions/s"
    elif eta_hit:
        assert d.min_eta is not None
        reason = "SaturationSoon"
        why = f"a pod saturates in {d.min_eta:.0f} s (lookahead {p.lookahead_seconds:.0f} s)"
    else:
        reason = "HighOccupancy"
        why = f"mean occupancy {d.mean_occupancy:.0%} > {p.scale_out_occupancy:.0%}"
    need = math.ceil(d.demand / (d.capacity * p.target_occupancy))
    # Act when the whole deployment's projection crosses the scale-out line: a trigger that
    # the total does not confirm is one pod (or one burst) running ahead of the rest.
    wanted = need if d.demand > current * d.capacity * p.scale_out_occupancy else current
    if wanted <= current:
        if pods.on_the_way > 0:
            return replace(
                base,
                reason="CapacityPending",
                message=f"{why}; {pods.on_the_way} pod(s) already on the way cover the "
                f"projected demand ({d.demand:.0f} blocks needs {need} at "
                f"{p.target_occupancy:.0%})",
                scale_in=None,
            )
        return replace(
            base,
            reason="LoadImbalance",
            message=f"{why}, but the deployment's projected demand ({d.demand:.0f} blocks, "
            f"{_pct(base.figures.projected_occupancy)} of {current} pods) stays under "
            f"{p.scale_out_occupancy:.0%}: one pod or a burst runs ahead, not the whole",
            scale_in=None,
        )
    if (
        inp.last_scale_up_at is not None
        and now - inp.last_scale_up_at < p.scale_up_stabilization_seconds
    ):
        return replace(
            base,
            reason="Stabilizing",
            message=f"{why}; the last scale-up was {now - inp.last_scale_up_at:.0f} s ago "
            f"(scaleUpStabilizationSeconds {p.scale_up_stabilization_seconds:.0f})",
            limited="RateLimited",
            limited_message="scale-up deferred by the up-stabilization window",
            scale_in=None,
        )
    target = min(wanted, current + p.max_scale_up_pods)
    limited, limited_msg = None, ""
    if target < wanted:
        limited = "RateLimited"
        limited_msg = f"wanted {wanted}, capped at +{p.max_scale_up_pods} per step"
    if target > p.max_replicas:
        target = p.max_replicas
        limited = "AtMaxReplicas"
        limited_msg = f"wanted {wanted} replicas, maxReplicas is {p.max_replicas}"
    message = (
        f"{why}; demand {d.demand:.0f} blocks needs {need} pods at "
        f"{p.target_occupancy:.0%} (ready {pods.ready}, starting {pods.on_the_way})"
    )
    if target <= current:
        return replace(
            base,
            reason="AtMaxReplicas",
            message=message + f"; already at maxReplicas {p.max_replicas}",
            limited=limited,
            limited_message=limited_msg,
            scale_in=None,
        )
    return replace(
        base,
        replicas=target,
        action="scale-out",
        reason=reason,
        message=message + f"; {current} -> {target}",
        limited=limited,
        limited_message=limited_msg,
        scale_in=None,
    )


def _rule_scale_in(inp: Inputs, pods: _Pods, d: _Demand, base: Decision) -> Decision:
    """Rule 5 (with 7's step cap and spacing): scale in only when every ready pod reports,
    nothing is starting, and the lower count held for the whole down-stabilization window."""
    p, now, current = inp.policy, inp.now, inp.current_replicas
    # The fewest replicas that keep today's demand below target - hysteresis and that the
    # current growth would still not fill within the lookahead. (Adding a noisy 30 s slope
    # times the whole lookahead to the target test would veto nearly every scale-in.)
    floor = p.target_occupancy - p.scale_in_hysteresis
    recommend = math.ceil(d.present / (d.capacity * floor))
    if d.growth > 0:
        recommend = max(recommend, math.ceil(d.demand / d.capacity))
    recommend = clamp(recommend, p.min_replicas, p.max_replicas)
    if recommend >= current:
        return replace(
            base,
            reason="WithinTarget",
            message=f"occupancy {d.mean_occupancy:.0%}, projected "
            f"{_pct(base.figures.projected_occupancy)} on {current} pods; removing one would "
            f"exceed {floor:.0%}",
            scale_in=None,
        )
    if pods.metrics != "ok" or pods.on_the_way > 0:
        why = "some ready pods do not report" if pods.metrics != "ok" else "pods are still starting"
        return replace(
            base,
            reason="Hold",
            message=f"scale-in to {recommend} possible but {why}; holding {current}",
            scale_in=None,
        )
    span = p.scale_down_stabilization_seconds
    prior = inp.scale_in
    history = (prior.history if prior else ()) + ((now, recommend),)
    window = ScaleInWindow(
        since=prior.since if prior else now,
        history=tuple(h for h in history if h[0] >= now - span),
    )
    since_up = math.inf if inp.last_scale_up_at is None else now - inp.last_scale_up_at
    hold_for = span - min(now - window.since, since_up)
    if pods.redistributing:
        hold_for = max(hold_for, p.warmup_seconds - (now - (inp.last_scale_down_at or now)))
    if hold_for > 0 or window.replicas >= current:
        wait = f"scale-in in {hold_for:.0f} s" if hold_for > 0 else "waiting for the window"
        return replace(
            base,
            reason="Stabilizing",
            message=f"occupancy would stay below {floor:.0%} on {window.replicas} pods; {wait} "
            f"unless load returns",
            scale_in=window,
        )
    target = max(window.replicas, current - p.max_scale_down_pods)
    return replace(
        base,
        replicas=target,
        action="scale-in",
        reason="LowOccupancy",
        message=f"demand {d.present:.0f} blocks stayed below {floor:.0%} of {window.replicas} "
        f"pods for {span:.0f} s; {current} -> {target}",
        scale_in=window,
    )
