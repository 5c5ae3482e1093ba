"""The scaling decision: pure, deterministic, and free of Kubernetes.

It acts on time-to-saturation rather than a fixed percentage. The rules, in order:

1. Bounds first: replicas outside [min, max] (the spec changed) go to the nearest bound.
2. No fresh sample from any ready pod: hold (fail static) and say why. Absent metrics never
   move replicas in either direction.
3. Scale out when a ready pod's saturation ETA is inside the lookahead, the mean occupancy is
   above `scale_out_occupancy`, or pods are preempting. The step comes from the KV math: the
   replicas that bring the projected demand (used blocks + waiting requests + growth over the
   lookahead) to `target_occupancy`, at least one more than are ready.
4. Pods that exist but are not ready yet (loading weights) count as capacity on the way, so
   a scale-out already in flight is not repeated while they load.
5. Scale in only when every ready pod reports, nothing is starting, and the projected
   occupancy after removal stays below `target - hysteresis` for the whole down-stabilization
   window; then go to the highest replica count recommended during that window.
6. Step sizes are capped (max pods per step), and a scale-up within the up-stabilization
   window of the previous one is deferred.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

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


@dataclass(frozen=True, slots=True)
class Policy:
    """The spec's scaling policy plus the planned pod capacity."""

    min_replicas: int
    max_replicas: int
    blocks_per_pod: int  # the planned pool, used when a pod does not report its capacity
    blocks_per_sequence: float  # what one waiting request will claim
    target_occupancy: float = 0.7
    scale_out_occupancy: float = 0.85
    scale_in_hysteresis: float = 0.1
    lookahead_seconds: float = 180.0
    scale_up_stabilization_seconds: float = 0.0
    scale_down_stabilization_seconds: float = 300.0
    max_scale_up_pods: int = 8
    max_scale_down_pods: int = 2
    metrics_max_age_seconds: float = 60.0
    startup_grace_seconds: float = 900.0

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
    """Since when scale-in has been recommended, and the highest count recommended since."""

    since: float
    replicas: int


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
    notes: tuple[str, ...] = field(default=())


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
    """Blocks per second the pod's KV use is growing (0 when it is not)."""
    if sample.growth_blocks_per_second is not None:
        return max(0.0, sample.growth_blocks_per_second)
    if sample.eta_seconds is None or sample.eta_seconds <= 0:
        return 0.0
    free = max(0.0, _capacity(sample, policy) - _used(sample, policy))
    return free / sample.eta_seconds


def _clamp(n: int, policy: Policy) -> int:
    return max(policy.min_replicas, min(policy.max_replicas, n))


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def decide(inp: Inputs) -> Decision:
    """Decide the replica count for one InferenceDeployment."""
    p, now, current = inp.policy, inp.now, inp.current_replicas
    live = [pod for pod in inp.pods if not pod.terminating]
    ready = [pod for pod in live if pod.ready]
    not_ready = [pod for pod in live if not pod.ready]
    stuck = sum(1 for pod in not_ready if now - pod.created_at > p.startup_grace_seconds)
    # Pods the Deployment asks for but that are not ready: loading, scheduling or not yet created.
    on_the_way = max(0, current - len(ready))
    fresh = [pod for pod in ready if _fresh(pod, now, p.metrics_max_age_seconds)]
    samples = [pod.sample for pod in fresh if pod.sample is not None]
    metrics: MetricsState = (
        "missing" if not samples else "partial" if len(samples) < len(ready) else "ok"
    )

    figures = Figures(ready=len(ready), starting=on_the_way, reporting=len(samples), stuck=stuck)
    base = Decision(
        replicas=current,
        action="hold",
        reason="Hold",
        message="",
        figures=figures,
        metrics=metrics,
        scale_in=inp.scale_in,
    )

    bounded = _clamp(current, p)
    if bounded != current:
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

    if not samples:
        if not ready:
            return replace(
                base,
                reason="WaitingForPods",
                message=f"0/{current} pods ready; {on_the_way} on the way, nothing to measure yet",
                scale_in=None,
            )
        return replace(
            base,
            reason="MetricsUnavailable",
            message=f"no fresh KV metrics from any of {len(ready)} ready pods "
            f"(older than {p.metrics_max_age_seconds:.0f} s or absent); holding {current}",
            limited="MetricsUnavailable",
            limited_message="scaling holds while KV metrics are missing or stale",
            scale_in=None,
        )

    # Demand, measured on the reporting pods and extrapolated to the silent ready ones.
    capacity = sum(_capacity(s, p) for s in samples) / len(samples)
    used = sum(_used(s, p) for s in samples)
    growth = sum(_growth(s, p) for s in samples)
    waiting = sum(s.waiting for s in samples)
    scale_up = len(ready) / len(samples)
    used_all = used * scale_up
    growth_all = growth * scale_up
    demand = used_all + waiting * p.blocks_per_sequence + growth_all * p.lookahead_seconds
    occupancies = [s.occupancy for s in samples]
    mean_occ = sum(occupancies) / len(occupancies)
    max_occ = max(occupancies)
    etas = [s.eta_seconds for s in samples if s.eta_seconds is not None]
    min_eta = min(etas) if etas else None
    preempt = sum(s.preemption_rate for s in samples)
    hits = [s.hit_ratio for s in samples if s.hit_ratio is not None]
    figures = replace(
        figures,
        mean_occupancy=mean_occ,
        max_occupancy=max_occ,
        min_eta_seconds=min_eta,
        waiting=waiting,
        preemption_rate=preempt,
        hit_ratio=sum(hits) / len(hits) if hits else None,
        demand_blocks=demand,
        projected_occupancy=demand / (current * capacity),
    )
    saturated = max_occ >= 1.0 or preempt > 0
    sat_msg = (
        f"KV cache full or preempting: max occupancy {max_occ:.0%}, "
        f"{preempt:.2f} preemptions/s, {waiting} waiting"
        if saturated
        else ""
    )
    base = replace(base, figures=figures, saturated=saturated, saturated_message=sat_msg)

    eta_hit = min_eta is not None and min_eta < p.lookahead_seconds
    occ_hit = mean_occ > p.scale_out_occupancy
    if eta_hit or occ_hit or preempt > 0:
        if preempt > 0:
            reason = "Preempting"
            why = f"{preempt:.2f} preemptions/s"
        elif eta_hit:
            assert min_eta is not None
            reason = "SaturationSoon"
            why = f"a pod saturates in {min_eta:.0f} s (lookahead {p.lookahead_seconds:.0f} s)"
        else:
            reason = "HighOccupancy"
            why = f"mean occupancy {mean_occ:.0%} > {p.scale_out_occupancy:.0%}"
        need = math.ceil(demand / (capacity * p.target_occupancy))
        wanted = max(need, len(ready) + 1)
        if wanted <= current:
            return replace(
                base,
                reason="CapacityPending",
                message=f"{why}; {on_the_way} pod(s) already on the way cover the projected "
                f"demand ({demand:.0f} blocks needs {need} at {p.target_occupancy:.0%})",
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
            f"{why}; demand {demand:.0f} blocks needs {need} pods at "
            f"{p.target_occupancy:.0%} (ready {len(ready)}, starting {on_the_way})"
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

    # Scale in: the replicas whose capacity keeps the projection below target - hysteresis.
    floor = p.target_occupancy - p.scale_in_hysteresis
    recommend = _clamp(math.ceil(demand / (capacity * floor)), p)
    if recommend >= current:
        return replace(
            base,
            reason="WithinTarget",
            message=f"occupancy {mean_occ:.0%}, projected {_pct(figures.projected_occupancy)} "
            f"on {current} pods; removing one would exceed {floor:.0%}",
            scale_in=None,
        )
    if metrics != "ok" or on_the_way > 0:
        why = "some ready pods do not report" if metrics != "ok" else "pods are still starting"
        return replace(
            base,
            reason="Hold",
            message=f"scale-in to {recommend} possible but {why}; holding {current}",
            scale_in=None,
        )
    window = inp.scale_in
    window = (
        ScaleInWindow(since=now, replicas=recommend)
        if window is None
        else ScaleInWindow(since=window.since, replicas=max(window.replicas, recommend))
    )
    last_change = max(
        (t for t in (inp.last_scale_up_at, inp.last_scale_down_at) if t is not None),
        default=None,
    )
    waited = now - window.since
    since_change = math.inf if last_change is None else now - last_change
    hold_for = p.scale_down_stabilization_seconds - min(waited, since_change)
    if hold_for > 0:
        return replace(
            base,
            reason="Stabilizing",
            message=f"projected occupancy would stay below {floor:.0%} on {window.replicas} "
            f"pods; scale-in in {hold_for:.0f} s unless load returns",
            scale_in=window,
        )
    target = max(window.replicas, current - p.max_scale_down_pods)
    return replace(
        base,
        replicas=target,
        action="scale-in",
        reason="LowOccupancy",
        message=f"demand {demand:.0f} blocks stayed below {floor:.0%} of {window.replicas} "
        f"pods for {p.scale_down_stabilization_seconds:.0f} s; {current} -> {target}",
        scale_in=None,
    )
