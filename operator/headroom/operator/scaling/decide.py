"""The scaling decision: pure, deterministic, and free of Kubernetes.

It sizes the deployment for the KV demand forecast at the moment a pod asked for now would
start serving, not for the occupancy of the moment. The rules, in order:

1. Bounds first: replicas outside [min, max] (the spec changed) go to the nearest bound.
2. No fresh sample from any ready pod: hold (fail static) and say why. Absent metrics never
   move replicas in either direction.
3. Demand, measured. Present KV: used blocks (of draining pods too: they still hold it) plus
   what the waiting requests will claim. Demand: Little's law over every pod's counters,
   pooled: arrival rate x block-seconds per departed request (`headroom.contract.demand`). The
   arrival rate is taken between two decisions from each pod's cumulative counters (the
   sidecar's window rate for a pod seen for the first time); block-seconds per request is
   averaged over `PER_REQUEST_WINDOW_SECONDS`. Demand equals present usage when traffic is
   steady and leads it when traffic changes. Pods without demand counters (an older engine,
   a server that exports none) fall back to present usage. A pod that has just started has
   none for a decision or two: over such a gap the series holds its last measured point (up
   to `DEMAND_GAP_HOLD_SECONDS`), since present usage then carries the backlog at the door.
   Silent ready pods are assumed to carry the reporting pods' average.
4. Forecast over the provisioning horizon: the pod start time learned from this deployment's
   own pods (creation to ready, their 90th percentile; the spec's `podStartSeconds` until one
   has been seen), plus the decision period, plus half the span the rates are averaged over.
   The demand series of the last `growth_window_seconds` is fitted by least squares; a slope
   within two standard errors of zero is not projected, and none is before half that window
   has been measured (pods filling from empty are not a ramp). The band above the forecast is
   its prediction interval at `forecast_quantile`, from the series' own scatter and the
   scatter of the KV in use, never less than the Poisson noise of the requests in flight.
5. Scale out to the pods that keep the forecast's mean at `target_occupancy` and its upper band
   within the usable pools (the engine stops admitting at its watermark), less room on each
   pod for one long request: a pod asked for now serves at the horizon, so the horizon's
   demand is what it must hold. When present occupancy is over `scale_out_occupancy` (the
   demand signals lag or are missing), the KV in use alone is enough to scale out. Pods asked
   for but not ready count as capacity on the way (they are in the Deployment's replicas), so
   a scale-out in flight is not repeated. Steps are capped (`max_scale_up_pods`); a scale-up
   within the up-stabilization window of the previous one is deferred.
6. Scale in with the same forecast: only when every ready pod reports, the demand history
   already spans the horizon (a new deployment starts from the plan, and stays there until it
   has measured what to do instead), and the forecast and the KV in use fit fewer pods with
   `scale_in_hysteresis` to spare. Pods asked for but not ready that this leaves unneeded are
   cancelled at once: they cost a GPU each and have served nothing, so an order placed on a
   burst that has since passed costs the seconds until the next decisions show it, not a pod
   start plus a window (the ReplicaSet removes pods that are not ready first). Ready pods go
   only when nothing is starting and the fit has held for the whole down-stabilization window;
   then go to the highest count recommended during it (HPA's sliding window), at most
   `max_scale_down_pods` per step and `warmup_seconds` apart. The window is one horizon
   unless the spec sets it: a released pod can be back within it, so the margin that keeps a
   deployment from releasing pods on a dip it will need back is the level one (hysteresis),
   not time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from headroom.contract.demand import (
    CounterSample,
    DemandForecast,
    DemandRates,
    forecast_demand,
    pooled,
)
from headroom.operator.bounds import clamp

Action = Literal["scale-out", "scale-in", "hold"]
MetricsState = Literal["ok", "partial", "missing"]

# Pod start times remembered (creation to ready), newest last.
POD_STARTS_KEPT = 20
# Block-seconds per request is a property of the request mix, not of the load: averaged this
# long it is steady, so the demand's noise is the arrival rate's alone.
PER_REQUEST_WINDOW_SECONDS = 600.0
# A pod that has just started has no demand counters for a decision or two. Present KV could
# stand in, but it carries the door's backlog, which is largest exactly while pods are short:
# the series would jump, the jump be fitted as a trend, and each scale-out feed the next. The
# series holds its last measured point instead, for at most this long.
DEMAND_GAP_HOLD_SECONDS = 120.0
# The most KV one request can hold over its life: 10^12 blocks (more than any pool) for a day.
MAX_BLOCK_SECONDS_PER_REQUEST = 1e12 * 86400.0
# Two readings of a pod's counters less than this apart are one reading seen twice: Prometheus
# answers with a target's last scrape until the next (a 60 s scrape is seen by four 15 s
# decisions), and the source times it again at each query. A rate over the milliseconds
# between two such answers is 0, not a measurement.
MIN_TICK_SPAN_SECONDS = 1.0
# A span between two decisions' readings longer than this, or than two decision intervals
# (decisions stopped for a while, or a reading dated in the future), is no tick: the source's
# window rate stands in, and an hour's average does not stretch the forecast's horizon by half
# an hour.
MAX_TICK_SPAN_SECONDS = 600.0
# The most an older reading may lag the last and still be an HA Prometheus pair's other
# replica (its scrape a phase behind; the README's longest scrape interval is 60 s).
MAX_HA_LAG_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class PodSample:
    """One pod's KV state as its sidecar (or Prometheus) reports it."""

    occupancy: float
    sampled_at: float  # unix seconds
    eta_seconds: float | None = None  # None: not growing, or no forecast yet (forecast_ready)
    waiting: int = 0
    running: int = 0
    preemption_rate: float = 0.0  # preemptions per second over the last minute
    hit_ratio: float | None = None
    used_blocks: int | None = None
    capacity_blocks: int | None = None
    growth_blocks_per_second: float | None = None
    engine_up: bool = True
    demand: DemandRates | None = None  # the demand counters' rates over the sidecar's window
    counters: CounterSample | None = None  # the demand counters themselves (cumulative)
    # False while the source has no saturation forecast for the pod (its first polls after a
    # start or an engine restart): then a None eta_seconds says nothing about growth.
    forecast_ready: bool = True


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
    (crd.models.ScalingSpec) holds them, and `scaling.loop.policy_for` is the one place that
    builds it."""

    min_replicas: int
    max_replicas: int
    blocks_per_pod: int  # the planned pool, used when a pod does not report its capacity
    blocks_per_sequence: float  # what one waiting request will claim (until measured)
    target_occupancy: float
    scale_out_occupancy: float
    scale_in_hysteresis: float
    scale_up_stabilization_seconds: float
    # None: one provisioning horizon, the time it takes to get a released pod back
    scale_down_stabilization_seconds: float | None
    max_scale_up_pods: int
    max_scale_down_pods: int
    metrics_max_age_seconds: float
    startup_grace_seconds: float
    warmup_seconds: float
    growth_window_seconds: float
    interval_seconds: float
    pod_start_seconds: float  # the horizon's pod start until the deployment's own are seen
    forecast_quantile: float
    usable_occupancy: float  # the share of a pool the engine fills before it stops admitting

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= min {self.min_replicas} <= max {self.max_replicas}")
        if not 0 < self.target_occupancy < self.scale_out_occupancy <= 1:
            raise ValueError("need 0 < target_occupancy < scale_out_occupancy <= 1")
        if not 0 <= self.scale_in_hysteresis < self.target_occupancy:
            raise ValueError("need 0 <= scale_in_hysteresis < target_occupancy")
        if self.blocks_per_pod < 1 or self.blocks_per_sequence <= 0:
            raise ValueError("a pod must hold at least one block and a sequence some blocks")
        if not 0.5 <= self.forecast_quantile < 1:
            raise ValueError("need 0.5 <= forecast_quantile < 1")
        if not 0 < self.usable_occupancy <= 1:
            raise ValueError("need 0 < usable_occupancy <= 1")


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
class Memory:
    """What one decision hands the next: the scaling loop keeps it and nothing else does.

    After an operator restart it starts empty, except for what status keeps (the last changes
    and the learned pod start time, given back through `Inputs`)."""

    demand: tuple[tuple[float, float], ...] = ()  # (time, deployment demand in blocks)
    # When `demand` began: it keeps only the growth window, and scale-in waits until demand has
    # been measured for the whole horizon, which may be longer.
    demand_since: float | None = None
    held: tuple[tuple[float, float], ...] = ()  # (time, KV in use incl. waiting requests')
    # (time, block-seconds/s, departures/s) of the whole deployment, for block-s per request
    lifetimes: tuple[tuple[float, float, float], ...] = ()
    pod_starts: tuple[tuple[str, float], ...] = ()  # (pod, seconds from creation to ready)
    # Pods (still present) this memory has seen ready, and seen not ready before ever seeing
    # them ready. Only the latter's first Ready is a start: a pod already ready when the
    # operator started may have flipped Ready since (a container restart), and its Ready time
    # minus its creation would be days, not a start. One that was seen ready and is not ready
    # now has served: it is not a pod on its way, to be cancelled as one that served nothing.
    seen_ready: frozenset[str] = frozenset()
    seen_starting: frozenset[str] = frozenset()
    counters: tuple[tuple[str, CounterSample], ...] = ()  # each pod's last demand counters
    rates: tuple[tuple[str, DemandRates], ...] = ()  # the rates each pod's last decision used
    scale_in: ScaleInWindow | None = None
    last_up: float | None = None
    last_down: float | None = None


@dataclass(frozen=True, slots=True)
class Inputs:
    """Everything one decision looks at."""

    now: float
    current_replicas: int  # what the Deployment asks for
    pods: tuple[PodView, ...]
    policy: Policy
    memory: Memory = Memory()
    learned_pod_start_seconds: float | None = None  # from status, until `memory` has its own


@dataclass(frozen=True, slots=True)
class DecisionFigures:
    """The numbers behind a decision (for status, events and logs)."""

    ready: int
    starting: int
    reporting: int
    mean_occupancy: float | None = None
    max_occupancy: float | None = None
    min_eta_seconds: float | None = None
    forecast_pending: int = 0  # reporting pods with no saturation forecast yet
    waiting: int = 0
    preemption_rate: float = 0.0
    hit_ratio: float | None = None
    present_blocks: float | None = None  # used (incl. draining) + waiting requests' blocks
    demand_blocks: float | None = None  # Little's law now (present when not measurable)
    arrival_rate: float | None = None  # requests per second, the deployment's
    block_seconds_per_request: float | None = None
    forecast: DemandForecast | None = None
    pod_start_seconds: float | None = None  # learned (or the spec's until learned)
    needed_replicas: int | None = None  # what the forecast (or present KV) needs at target
    projected_occupancy: float | None = None  # the forecast's upper band over current pods
    stuck: int = 0  # pods not ready after the startup grace


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do, why, and what stood in the way."""

    replicas: int
    action: Action
    reason: str  # CamelCase, used as the Event reason
    message: str
    figures: DecisionFigures
    metrics: MetricsState
    limited: str | None = None  # CamelCase reason when bounds, rate or metrics held it back
    limited_message: str = ""
    saturated: bool = False
    saturated_message: str = ""
    memory: Memory = field(default_factory=Memory)  # hand to the next decision's Inputs


def decide(inp: Inputs) -> Decision:
    """Decide the replica count for one InferenceDeployment: the rules of the module docstring,
    in order, the first that decides wins."""
    pods = _pods(inp)
    memory = _observe_pods(inp)
    base = Decision(
        replicas=inp.current_replicas,
        action="hold",
        reason="Hold",
        message="",
        figures=DecisionFigures(
            ready=pods.ready,
            starting=pods.on_the_way,
            reporting=len(pods.samples),
            stuck=pods.stuck,
        ),
        metrics=pods.metrics,
        memory=memory,
    )
    decided = _rule_bounds(inp, base) or _rule_no_metrics(inp, pods, base)
    if decided is not None:
        return decided
    d = _measure(inp, pods, base.memory)
    base = _with_figures(inp, pods, d, base)
    return _rule_scale_out(inp, pods, d, base) or _rule_scale_in(inp, pods, d, base)


def _fresh(pod: PodView, now: float, max_age: float) -> bool:
    s = pod.sample
    return s is not None and s.engine_up and now - s.sampled_at <= max_age


def _capacity(sample: PodSample, policy: Policy) -> int:
    return sample.capacity_blocks or policy.blocks_per_pod


def _used(sample: PodSample, policy: Policy) -> float:
    if sample.used_blocks is not None:
        return float(sample.used_blocks)
    return sample.occupancy * _capacity(sample, policy)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


@dataclass(frozen=True, slots=True)
class _Pods:
    """The pods as one decision sees them."""

    ready: int
    on_the_way: int  # asked for but not ready: loading, scheduling or not yet created
    dipped: int  # of those, pods seen ready before: they have served and may hold requests
    stuck: int  # not ready after the startup grace
    samples: list[PodSample]  # fresh samples of ready pods
    draining: list[PodSample]  # fresh samples of pods being removed
    metrics: MetricsState
    names: tuple[str, ...]  # of samples + draining, in that order


def _pods(inp: Inputs) -> _Pods:
    """Which pods count as ready, starting and draining, and whose samples are fresh."""
    p, now = inp.policy, inp.now
    live = [pod for pod in inp.pods if not pod.terminating]
    ready = [pod for pod in live if pod.ready]
    fresh = [pod for pod in ready if _fresh(pod, now, p.metrics_max_age_seconds)]
    leaving = [
        pod for pod in inp.pods if pod.terminating and _fresh(pod, now, p.metrics_max_age_seconds)
    ]
    samples = [pod.sample for pod in fresh if pod.sample is not None]
    draining = [pod.sample for pod in leaving if pod.sample is not None]
    dipped = sum(1 for pod in live if not pod.ready and _has_served(pod, inp))
    # A pod that served and dropped out of readiness (a probe timeout, an engine restart) is a
    # ready pod that does not report, as far as its KV goes.
    metrics: MetricsState = (
        "missing" if not samples
        else "partial" if len(samples) < len(ready) or dipped
        else "ok"
    )  # fmt: skip
    return _Pods(
        ready=len(ready),
        on_the_way=max(0, inp.current_replicas - len(ready)),
        dipped=dipped,
        stuck=sum(1 for pod in live if not pod.ready and _past_grace(pod, inp)),
        samples=samples,
        draining=draining,
        metrics=metrics,
        names=tuple(pod.name for pod in (*fresh, *leaving)),
    )


def _past_grace(pod: PodView, inp: Inputs) -> bool:
    """Whether the pod is older than the startup grace: stuck if not ready, and past the age
    at which a pod first seen not ready can be taken for one starting."""
    return inp.now - pod.created_at > inp.policy.startup_grace_seconds


def _has_served(pod: PodView, inp: Inputs) -> bool:
    """Whether a pod may have been ready: seen so by this memory, holding requests or KV now, or
    older than the startup grace and never seen starting (a restarted operator cannot tell a
    pod that served from one stuck since birth; holding both loses only time)."""
    s, memory = pod.sample, inp.memory
    return (
        pod.name in memory.seen_ready
        or (s is not None and (s.running > 0 or (s.used_blocks or 0) > 0 or s.occupancy > 0))
        or (pod.name not in memory.seen_starting and _past_grace(pod, inp))
    )


def _observe_pods(inp: Inputs) -> Memory:
    """Record which pods are seen ready and starting, and the start time (creation to ready) of
    every pod seen starting that is now ready for the first time."""
    mem = inp.memory
    known = {name for name, _ in mem.pod_starts}
    live = [pod for pod in inp.pods if not pod.terminating]
    new = tuple(
        (pod.name, pod.ready_since - pod.created_at)
        for pod in live
        if pod.ready
        and pod.name in mem.seen_starting
        and pod.name not in known
        and pod.ready_since is not None
        and pod.ready_since >= pod.created_at
    )
    present = {pod.name for pod in inp.pods}
    seen_ready = (mem.seen_ready | {pod.name for pod in live if pod.ready}) & present
    # Starting: not ready and young. An older pod first seen not ready (by an operator that
    # has just started) may have served for days and dropped out of readiness: its creation to
    # its next ready is no start time, and it has not "served nothing".
    starting = {pod.name for pod in live if not pod.ready and not _past_grace(pod, inp)}
    seen_starting = ((mem.seen_starting | starting) - seen_ready) & present
    return replace(
        mem,
        pod_starts=(mem.pod_starts + new)[-POD_STARTS_KEPT:],
        seen_ready=frozenset(seen_ready),
        seen_starting=frozenset(seen_starting),
    )


def pod_start_seconds(inp: Inputs, memory: Memory) -> float:
    """The pod start time the horizon uses: the 90th percentile of the starts this operator
    has seen, else the one kept in status, else the spec's."""
    starts = sorted(s for _, s in memory.pod_starts)
    if starts:
        return starts[min(len(starts) - 1, math.ceil(0.9 * len(starts)) - 1)]
    if inp.learned_pod_start_seconds is not None:
        return inp.learned_pod_start_seconds
    return inp.policy.pod_start_seconds


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
        memory=_moved(base.memory, inp.now, bounded - current),
    )


def _rule_no_metrics(inp: Inputs, pods: _Pods, base: Decision) -> Decision | None:
    """Rule 2: no fresh sample from any ready pod: hold (fail static) and say why."""
    if pods.samples:
        return None
    p, current = inp.policy, inp.current_replicas
    quiet = replace(base.memory, scale_in=None)
    if not pods.ready:
        return replace(
            base,
            reason="WaitingForPods",
            message=f"0/{current} pods ready; {pods.on_the_way} on the way, nothing to measure yet",
            memory=quiet,
        )
    return replace(
        base,
        reason="MetricsUnavailable",
        message=f"no fresh KV metrics from any of {pods.ready} ready pods "
        f"(older than {p.metrics_max_age_seconds:.0f} s or absent); holding {current}",
        limited="MetricsUnavailable",
        limited_message="scaling holds while KV metrics are missing or stale",
        memory=quiet,
    )


@dataclass(frozen=True, slots=True)
class _Demand:
    """The deployment's KV, measured and forecast."""

    capacity: float  # blocks per pod
    present: float  # used (incl. draining) + waiting requests' blocks
    demand: float  # Little's law, or present when the pods report no demand counters
    rates: DemandRates | None
    held_for: float | None  # seconds the last measured demand has been held over a gap
    per_departure: float | None  # block-seconds per departed request, over the long window
    per_request: float  # blocks a running request holds (for the Poisson band, waiting ones)
    forecast: DemandForecast
    mean_occupancy: float
    min_eta: float | None
    preempt: float
    waiting: int
    memory: Memory


def _measure(inp: Inputs, pods: _Pods, mem: Memory) -> _Demand:
    """Rules 3 and 4: present KV, demand and its forecast at the horizon, and the memory the
    next decision needs (demand and KV-in-use series, block-seconds per request, counters)."""
    p, now = inp.policy, inp.now
    samples, draining = pods.samples, pods.draining
    scale = pods.ready / len(samples)  # silent ready pods carry the reporting pods' average
    capacity = sum(_capacity(s, p) for s in samples) / len(samples)
    used = sum(_used(s, p) for s in samples) * scale + sum(_used(s, p) for s in draining)
    running = sum(s.running for s in samples) * scale + sum(s.running for s in draining)
    per_request = used / running if running >= 1 else p.blocks_per_sequence
    waiting = sum(s.waiting for s in samples)  # as reported: the figure status shows
    # Silent ready pods carry the average queue too, or a partial scrape undersizes a backlog;
    # a draining pod's queue, like its KV, is still demand.
    queued = waiting * scale + sum(s.waiting for s in draining)
    present = used + queued * per_request

    parts, counters, pod_rates = _tick_rates(pods, mem, now, p)
    # Demand counters from every fresh pod, or none: a mix would undercount the silent ones.
    rates = pooled([r for r in parts if r is not None]) if None not in parts else None
    lifetimes = tuple(x for x in mem.lifetimes if x[0] > now - PER_REQUEST_WINDOW_SECONDS)
    if rates is not None:
        lifetimes += ((now, rates.block_seconds, rates.departures),)
    departed = sum(x[2] for x in lifetimes)
    per_departure = (
        # At most a pod's whole pool for a day: a few departures counted near zero (a broken
        # exporter) must not make the demand infinite, which no count of pods can round.
        min(sum(x[1] for x in lifetimes) / departed, MAX_BLOCK_SECONDS_PER_REQUEST)
        if departed > 0
        else None
    )
    demand, held_for = present, None
    if rates is not None and per_departure is not None:
        arrivals = sum(r.arrivals for r in parts[: len(samples)] if r is not None) * scale
        arrivals += sum(r.arrivals for r in parts[len(samples) :] if r is not None)
        demand = arrivals * per_departure
        rates = replace(rates, arrivals=arrivals)
    elif rates is None and mem.demand and mem.lifetimes:
        gap = now - mem.lifetimes[-1][0]
        if gap <= DEMAND_GAP_HOLD_SECONDS:
            demand, held_for = mem.demand[-1][1], gap
    window = rates.window_seconds if rates is not None else 0.0

    history = tuple(h for h in mem.demand if now - p.growth_window_seconds <= h[0] < now)
    history += ((now, demand),)
    start = pod_start_seconds(inp, mem)
    horizon = start + p.interval_seconds + window / 2
    held = tuple(h for h in mem.held if now - p.growth_window_seconds <= h[0] < now)
    held += ((now, present),)
    # A trend needs history: the first minutes of a deployment (pods filling from empty) are
    # not a ramp to project, so until half the growth window is measured only the level counts.
    measured = now - history[0][0] >= p.growth_window_seconds / 2
    fc = forecast_demand(
        history,
        horizon,
        p.forecast_quantile,
        per_request,
        averaging=window,
        held=held,
        significance=2.0 if measured else math.inf,
    )
    assert fc is not None  # history holds at least this decision's point
    etas = [s.eta_seconds for s in samples if s.eta_seconds is not None]
    return _Demand(
        capacity=capacity,
        present=present,
        demand=demand,
        rates=rates,
        held_for=held_for,
        per_request=per_request,
        forecast=fc,
        mean_occupancy=sum(s.occupancy for s in samples) / len(samples),
        min_eta=min(etas) if etas else None,
        preempt=sum(s.preemption_rate for s in samples),
        waiting=waiting,
        per_departure=per_departure,
        memory=replace(
            mem,
            demand=history,
            demand_since=min(history[0][0], _since(mem, now)),
            held=held,
            lifetimes=lifetimes,
            counters=counters,
            rates=pod_rates,
        ),
    )


def _since(mem: Memory, now: float) -> float:
    """When this operator began measuring demand (`now` before its first point)."""
    if mem.demand_since is not None:
        return mem.demand_since
    return mem.demand[0][0] if mem.demand else now


def _possible(rate: DemandRates, sample: PodSample, policy: Policy) -> bool:
    """Whether one pod could have done `rate`, within a wide margin (counters and gauges are
    not read at one instant): its block-seconds per second are its mean KV in use, at most its
    pool, and what arrived has left or is still in it (running or waiting). A broken or hostile
    exporter's jump (a day's counter read as arriving in 15 s) is far outside both."""
    span = rate.window_seconds
    in_flight = sample.running + sample.waiting
    return (
        rate.block_seconds <= 2 * _capacity(sample, policy)
        and rate.arrivals * span <= 10 * (rate.departures * span + in_flight) + 100
    )


def _tick_rates(
    pods: _Pods, mem: Memory, now: float, policy: Policy
) -> tuple[
    list[DemandRates | None],
    tuple[tuple[str, CounterSample], ...],
    tuple[tuple[str, DemandRates], ...],
]:
    """Each reporting pod's demand rates since the last decision, from its cumulative counters
    (independent from one decision to the next, unlike the sidecar's sliding window), with the
    counters and rates the next decision starts from. A pod seen for the first time, or whose
    engine restarted (a new epoch), falls back to its source's window rate. A reading no newer
    than the last one (`MIN_TICK_SPAN_SECONDS`: the same Prometheus scrape seen again, or an
    older one from the other replica of an HA pair) keeps the last one as the baseline and
    repeats the pod's last rate; one more than the longest tick (`MAX_TICK_SPAN_SECONDS`, or
    two decision intervals) newer takes the window rate. Counters that fell within an
    epoch give the pod no rate for this decision and are the new baseline: its sidecar
    restarted while the engine ran, and the counters the sidecar derives (vLLM's and SGLang's
    arrivals, the block-seconds it integrates) started again lower. The window rate is no
    better then (Prometheus reads such a fall as a reset to zero and adds the whole counter),
    and the demand series holds its last point over the gap instead. A reading older than the
    last by more than an HA pair's lag (`MAX_HA_LAG_SECONDS`, or a stale sample's age if less:
    the last was dated ahead) and a rate no pod could do (`_possible`) also give no rate, and
    are the new baseline: one bad answer then costs that pod one or two decisions' rates, not
    minutes of a forecast built on it."""
    last, last_rates = dict(mem.counters), dict(mem.rates)
    longest = max(MAX_TICK_SPAN_SECONDS, 2 * policy.interval_seconds)
    # An HA Prometheus pair's other replica lags by a scrape or so; a reading older than
    # the last by more than that, or than a stale sample's age, is not that: the last one was
    # dated ahead, and must not stay the baseline while real time catches up with it.
    lag = min(policy.metrics_max_age_seconds, MAX_HA_LAG_SECONDS)
    out: list[DemandRates | None] = []
    kept: list[tuple[str, CounterSample]] = []
    used: list[tuple[str, DemandRates]] = []
    for name, s in zip(pods.names, (*pods.samples, *pods.draining), strict=True):
        cur, prev = s.counters, last.get(name)
        rate = s.demand if s.demand is not None and _possible(s.demand, s, policy) else None
        if cur is not None and prev is not None and prev.epoch == cur.epoch:
            span = cur.t - prev.t
            d = (cur.arrived - prev.arrived, cur.departed - prev.departed)
            bs = cur.block_seconds - prev.block_seconds
            if -lag < span < MIN_TICK_SPAN_SECONDS:
                rate, cur = last_rates.get(name), prev
            elif span > longest and min(*d, bs) >= 0:
                pass  # the window rate, as for a pod seen for the first time
            elif span > 0 and min(*d, bs) >= 0:
                rate = DemandRates(d[0] / span, d[1] / span, bs / span, span)
                rate = rate if _possible(rate, s, policy) else None
            else:
                rate = None
        if cur is not None:
            kept.append((name, cur))
        if rate is not None:
            used.append((name, rate))
        out.append(rate)
    return out, tuple(kept), tuple(used)


def _with_figures(inp: Inputs, pods: _Pods, d: _Demand, base: Decision) -> Decision:
    """The measured figures, saturation and the new memory on the base decision."""
    samples = pods.samples
    max_occ = max(s.occupancy for s in samples)
    hits = [s.hit_ratio for s in samples if s.hit_ratio is not None]
    figures = replace(
        base.figures,
        mean_occupancy=d.mean_occupancy,
        max_occupancy=max_occ,
        min_eta_seconds=d.min_eta,
        forecast_pending=sum(not s.forecast_ready for s in samples),
        waiting=d.waiting,
        preemption_rate=d.preempt,
        hit_ratio=sum(hits) / len(hits) if hits else None,
        present_blocks=d.present,
        demand_blocks=d.demand,
        arrival_rate=None if d.rates is None else d.rates.arrivals,
        block_seconds_per_request=d.per_departure,
        forecast=d.forecast,
        pod_start_seconds=pod_start_seconds(inp, d.memory),
        needed_replicas=_need(inp.policy, d, inp.current_replicas)[0],
        projected_occupancy=d.forecast.upper / (inp.current_replicas * d.capacity),
    )
    saturated = max_occ >= 1.0 or d.preempt > 0
    sat_msg = (
        f"KV cache full or preempting: max occupancy {max_occ:.0%}, "
        f"{d.preempt:.2f} preemptions/s, {d.waiting} waiting"
        if saturated
        else ""
    )
    return replace(
        base, figures=figures, saturated=saturated, saturated_message=sat_msg, memory=d.memory
    )


def _moved(memory: Memory, now: float, delta: int) -> Memory:
    """The memory after a change of `delta` replicas at `now`."""
    if delta > 0:
        return replace(memory, last_up=now, scale_in=None)
    if delta < 0:
        return replace(memory, last_down=now)
    return memory


def _demand_words(d: _Demand) -> str:
    fc = d.forecast
    if d.rates is not None and d.per_departure is not None:
        now = (
            f"demand {d.demand:,.0f} blocks ({d.rates.arrivals:.2f} req/s x "
            f"{d.per_departure:,.0f} block-s per request)"
        )
    elif d.held_for is not None:
        now = (
            f"demand {d.demand:,.0f} blocks (measured {d.held_for:.0f} s ago, held while a pod "
            "that has just started reports no demand counters yet)"
        )
    else:
        now = f"KV in use {d.present:,.0f} blocks (no demand counters)"
    return (
        f"{now}, trend {fc.slope:+,.1f} blocks/s; at {fc.horizon:.0f} s: {fc.mean:,.0f} + "
        f"{fc.band:,.0f} (p{fc.quantile * 100:.0f}) = {fc.upper:,.0f} blocks"
    )


# More pods than any count of them means "as many as allowed": a near-zero target occupancy
# (the CRD takes any above 0) made the ratio infinite, and math.ceil raised at every tick; an
# exporter's near-zero departures needed 5e19 pods, past the int64 status keeps.
MAX_PODS = 2**31 - 1


def pods_holding(blocks: float, per_pod: float) -> int:
    """Pods of `per_pod` blocks that hold `blocks`, at most MAX_PODS."""
    ratio = blocks / per_pod
    return MAX_PODS if not ratio < MAX_PODS else math.ceil(ratio)


def _pods_for(d: _Demand, target: float, full: float, large: float) -> int:
    """Pods that keep the forecast's mean at `target` of their pools and its upper band within
    `full` of them, less room for one `large` request on each: a pod admits a request only when
    it alone has the request's blocks free, so a deployment whose free blocks are spread thin
    queues its long prompts while its total looks fine."""
    room = max(d.capacity * full - large, d.capacity * full / 2)
    # A target above what the engine admits to (its watermark) is the watermark.
    return max(
        pods_holding(d.forecast.mean, d.capacity * min(target, full)),
        pods_holding(d.forecast.upper, room),
    )


def _need(p: Policy, d: _Demand, current: int) -> tuple[int, str]:
    """The pods the forecast needs at the horizon (or the present KV, when present occupancy
    is over the scale-out line), and the reason to name."""
    need = _pods_for(d, p.target_occupancy, p.usable_occupancy, p.blocks_per_sequence)
    # Present KV alone buys pods only over the scale-out line: below it, KV that is about to
    # leave (demand falling) would buy pods that arrive after it has gone.
    hot = d.present > current * d.capacity * p.scale_out_occupancy
    by_present = pods_holding(d.present, d.capacity * p.target_occupancy)
    if d.preempt > 0:
        return max(need, by_present if hot else 0), "Preempting"
    if hot and by_present >= need:
        return by_present, "HighOccupancy"
    measured = d.rates is not None or d.held_for is not None
    return need, "DemandForecast" if measured else "KVForecast"


def _rule_scale_out(inp: Inputs, pods: _Pods, d: _Demand, base: Decision) -> Decision | None:
    """Rule 5: scale out to the pods the forecast's upper band (or the present KV) needs."""
    p, now, current = inp.policy, inp.now, inp.current_replicas
    need, reason = _need(p, d, current)
    if need <= current:
        return None
    why = f"{_demand_words(d)} needs {need} pods at {p.target_occupancy:.0%}"
    if (
        p.scale_up_stabilization_seconds > 0
        and inp.memory.last_up is not None
        and now - inp.memory.last_up < p.scale_up_stabilization_seconds
    ):
        return replace(
            base,
            reason="Stabilizing",
            message=f"{why}; the last scale-up was {now - inp.memory.last_up:.0f} s ago "
            f"(scaleUpStabilizationSeconds {p.scale_up_stabilization_seconds:.0f})",
            limited="RateLimited",
            limited_message="scale-up deferred by the up-stabilization window",
            memory=replace(base.memory, scale_in=None),
        )
    target = min(need, current + p.max_scale_up_pods)
    limited, limited_msg = None, ""
    if target < need:
        limited, limited_msg = "RateLimited", f"wanted {need}, capped at +{p.max_scale_up_pods}"
    if target > p.max_replicas:
        target = p.max_replicas
        limited, limited_msg = "AtMaxReplicas", f"wanted {need}, maxReplicas is {p.max_replicas}"
    message = f"{why} (ready {pods.ready}, starting {pods.on_the_way})"
    if target <= current:
        return replace(
            base,
            reason="AtMaxReplicas",
            message=message + f"; already at maxReplicas {p.max_replicas}",
            limited=limited,
            limited_message=limited_msg,
            memory=replace(base.memory, scale_in=None),
        )
    return replace(
        base,
        replicas=target,
        action="scale-out",
        reason=reason,
        message=message + f"; {current} -> {target}",
        limited=limited,
        limited_message=limited_msg,
        memory=_moved(base.memory, now, target - current),
    )


def _cancel_starting(
    inp: Inputs, pods: _Pods, d: _Demand, base: Decision, recommend: int, floor: float
) -> Decision:
    """Rule 6, for pods asked for but not ready: the ones the forecast no longer needs go at
    once, with the level margin and without the window. They have served nothing, so removing
    them drops no request, and a ReplicaSet removes pods that are not ready before ready ones
    (unscheduled, then pending, then loading), so the ready pods stay."""
    current = inp.current_replicas
    target = max(recommend, pods.ready)
    return replace(
        base,
        replicas=target,
        action="scale-in",
        reason="StartingNotNeeded",
        message=f"{_demand_words(d)}: {recommend} pods would stay under {floor:.0%}; "
        f"cancelling {current - target} of the {pods.on_the_way} pod(s) still starting, which "
        f"have served nothing; {current} -> {target}",
        memory=_moved(replace(base.memory, scale_in=None), inp.now, target - current),
    )


def _rule_scale_in(inp: Inputs, pods: _Pods, d: _Demand, base: Decision) -> Decision:
    """Rule 6: scale in on the same forecast, after the down-stabilization window."""
    p, now, current = inp.policy, inp.now, inp.current_replicas
    floor = p.target_occupancy - p.scale_in_hysteresis
    if p.usable_occupancy - p.scale_in_hysteresis <= 0:
        # The CRD checks the hysteresis against targetOccupancy only; the engine's usable share
        # (its watermark) can be lower, and then no count of pods is below the margin.
        return replace(
            base,
            reason="WithinTarget",
            message=f"{_demand_words(d)}: scale-in is off: scaleInHysteresis "
            f"{p.scale_in_hysteresis:.0%} leaves nothing of the {p.usable_occupancy:.0%} of a "
            f"pool the engine fills; holding {current}",
            memory=replace(base.memory, scale_in=None),
        )
    # A pod removed is gone now: the present KV must fit the rest at once, not only the forecast,
    # and under the scale-out line by the margin, or the next decision buys the pod back.
    present_full = min(p.usable_occupancy, p.scale_out_occupancy) - p.scale_in_hysteresis
    keep = max(
        _pods_for(d, floor, p.usable_occupancy - p.scale_in_hysteresis, p.blocks_per_sequence),
        pods_holding(d.present, d.capacity * present_full),
    )
    recommend = clamp(keep, p.min_replicas, p.max_replicas)
    quiet = replace(base.memory, scale_in=None)
    if recommend >= current:
        return replace(
            base,
            reason="WithinTarget",
            message=f"{_demand_words(d)}: fits {current} pods between "
            f"{floor:.0%} and {p.target_occupancy:.0%}",
            memory=quiet,
        )
    history_span = now - _since(d.memory, now)
    learned = history_span >= d.forecast.horizon
    if pods.metrics == "ok" and pods.on_the_way > 0 and learned:
        return _cancel_starting(inp, pods, d, base, recommend, floor)
    if pods.metrics != "ok" or not learned:
        why = (
            f"{pods.dipped} pod(s) that served are not ready" if pods.dipped
            else "some ready pods do not report" if pods.metrics != "ok"
            else f"the demand history ({history_span:.0f} s) does not span the horizon yet "
            f"({d.forecast.horizon:.0f} s): the plan's count holds until it does"
        )  # fmt: skip
        return replace(
            base,
            reason="Hold" if pods.metrics != "ok" else "Learning",
            message=f"scale-in to {recommend} possible but {why}; holding {current}",
            memory=quiet,
        )
    span = p.scale_down_stabilization_seconds
    if span is None:
        # Holding a pod longer than it takes to get it back buys nothing the level margin
        # (`scale_in_hysteresis`) does not: the pods that stay already hold the horizon's band.
        span = d.forecast.horizon
    prior = base.memory.scale_in
    if prior is not None and now - prior.history[-1][0] > 2 * p.interval_seconds:
        # Decisions stopped for a while (API errors, an infeasible spec): the window's evidence
        # has a hole, and the time in it is not time the fit held.
        prior = None
    history = (prior.history if prior else ()) + ((now, recommend),)
    window = ScaleInWindow(
        since=prior.since if prior else now,
        history=tuple(h for h in history if h[0] >= now - span),
    )
    last_up, last_down = base.memory.last_up, base.memory.last_down
    since_up = math.inf if last_up is None else now - last_up
    hold_for = span - min(now - window.since, since_up)
    if last_down is not None:
        hold_for = max(hold_for, p.warmup_seconds - (now - last_down))
    kept = replace(base.memory, scale_in=window)
    if hold_for > 0 or window.replicas >= current:
        wait = f"scale-in in {hold_for:.0f} s" if hold_for > 0 else "waiting for the window"
        return replace(
            base,
            reason="Stabilizing",
            message=f"{_demand_words(d)}: {window.replicas} pods would stay under {floor:.0%}; "
            f"{wait} unless load returns",
            memory=kept,
        )
    target = max(window.replicas, current - p.max_scale_down_pods)
    return replace(
        base,
        replicas=target,
        action="scale-in",
        reason="LowDemand",
        message=f"{_demand_words(d)}: {window.replicas} pods stayed enough for {span:.0f} s; "
        f"{current} -> {target}",
        memory=_moved(kept, now, target - current),
    )
