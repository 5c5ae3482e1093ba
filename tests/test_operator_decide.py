"""decide(): table-driven cases, then multi-tick traps other autoscalers fell into."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from dataclasses import replace
from statistics import NormalDist

import pytest

import headroom.operator.scaling.decide as decide_module
from headroom.contract.admission import DEFAULT_WATERMARK
from headroom.contract.demand import CounterSample, DemandRates
from headroom.operator.crd.models import InferenceDeploymentSpec, ScalingSpec
from headroom.operator.reconcile.sizing import size
from headroom.operator.scaling.decide import (
    MAX_PODS,
    Decision,
    Inputs,
    Memory,
    PodSample,
    PodView,
    Policy,
    ScaleInWindow,
    decide,
    pod_start_seconds,
)
from headroom.operator.scaling.loop import decision_record, policy_for

NOW = 10_000.0
POLICY = Policy(
    min_replicas=1,
    max_replicas=10,
    blocks_per_pod=1000,
    blocks_per_sequence=100,
    target_occupancy=0.7,
    scale_out_occupancy=0.85,
    scale_in_hysteresis=0.1,
    scale_up_stabilization_seconds=0,
    scale_down_stabilization_seconds=300,
    max_scale_up_pods=8,
    max_scale_down_pods=2,
    metrics_max_age_seconds=60,
    startup_grace_seconds=900,
    warmup_seconds=90,
    growth_window_seconds=180,
    interval_seconds=15,
    pod_start_seconds=120,
    forecast_quantile=0.95,
    usable_occupancy=1.0,
)


def pod(
    name: str,
    occ: float | None,
    *,
    arrivals: float | None = None,
    ready: bool = True,
    waiting: int = 0,
    preempt: float = 0.0,
    ago: float = 2.0,
    up: bool = True,
    age: float = 3600.0,
    terminating: bool = False,
    running: int = 10,
) -> PodView:
    """A pod at `occ` of 1,000 blocks; with `arrivals` (requests/s) it also reports demand
    counters: its used blocks held by requests that leave at 1/s (block-seconds per request =
    used blocks), so its demand is used x arrivals."""
    sample = None
    if occ is not None:
        used = round(occ * 1000)
        demand = None if arrivals is None else DemandRates(arrivals, 1.0, float(used), 60.0)
        sample = PodSample(
            occupancy=occ,
            sampled_at=NOW - ago,
            waiting=waiting,
            running=running,
            preemption_rate=preempt,
            used_blocks=used,
            capacity_blocks=1000,
            engine_up=up,
            demand=demand,
        )
    return PodView(
        name=name, ready=ready, created_at=NOW - age, terminating=terminating, sample=sample
    )


def history(blocks: float, seconds: float = 300.0) -> Memory:
    """A memory whose demand series sat flat at `blocks` for `seconds` (a settled deployment)."""
    points = tuple((NOW - dt, blocks) for dt in range(int(seconds), 0, -15))
    return Memory(demand=points, held=points)


def run(current: int, pods: list[PodView], **kw: object) -> Decision:
    policy = kw.pop("policy", POLICY)
    assert isinstance(policy, Policy)
    return decide(
        Inputs(now=NOW, current_replicas=current, pods=tuple(pods), policy=policy, **kw)  # type: ignore[arg-type]
    )


CASES = [
    # (id, current, pods, memory, expected replicas, expected reason)
    # 1,500 blocks on 3 pods: mean at 50 %, the upper band inside the pools; removing one would
    # put the mean over 60 %.
    ("steady-within-target", 3, [pod(f"p{i}", 0.5, arrivals=1.0) for i in range(3)],
     history(1500), 3, "WithinTarget"),
    # Occupancy is only 40 %, but twice as many requests arrive as leave: the 1,600 blocks of
    # demand need ceil(1600 / 700) = 3 pods before occupancy shows it.
    ("demand-ahead-of-occupancy", 2, [pod("a", 0.4, arrivals=2.0), pod("b", 0.4, arrivals=2.0)],
     Memory(), 3, "DemandForecast"),
    # No demand counters (an older engine) and 90 % > 85 %: the KV in use alone buys pods.
    ("high-occupancy-without-counters", 2, [pod("a", 0.9), pod("b", 0.9)], Memory(), 3,
     "HighOccupancy"),
    # Preempting with 4 waiting requests: 1,600 used + 4 x 100 blocks.
    ("preempting", 2, [pod("a", 0.8, preempt=0.5, waiting=2), pod("b", 0.8, waiting=2)],
     Memory(), 3, "Preempting"),
    # 2 of 4 ready and full, 2 loading: the 4 asked for already cover the demand.
    ("capacity-on-the-way", 4,
     [pod("a", 0.95, arrivals=1.0), pod("b", 0.95, arrivals=1.0),
      pod("c", None, ready=False, age=60), pod("d", None, ready=False, age=60)],
     history(1900), 4, "WithinTarget"),
    ("no-metrics-at-all", 3, [pod(f"p{i}", None) for i in range(3)], Memory(), 3,
     "MetricsUnavailable"),
    ("stale-metrics", 3, [pod(f"p{i}", 0.99, ago=120) for i in range(3)], Memory(), 3,
     "MetricsUnavailable"),
    ("engine-down", 2, [pod("a", 0.99, up=False), pod("b", 0.99, up=False)], Memory(), 2,
     "MetricsUnavailable"),
    ("nothing-ready-yet", 2, [pod("a", None, ready=False), pod("b", None, ready=False)],
     Memory(), 2, "WaitingForPods"),
    ("above-max-after-spec-change", 12, [pod(f"p{i}", 0.5) for i in range(12)], Memory(), 10,
     "SpecBounds"),
    ("at-max-and-saturated", 10, [pod(f"p{i}", 1.0, preempt=1.0) for i in range(10)], Memory(),
     10, "AtMaxReplicas"),
    # A new deployment (no history) idles: it keeps the plan's count until it has measured
    # for as long as the forecast looks ahead.
    ("new-deployment-keeps-the-plan", 4, [pod(f"p{i}", 0.1, arrivals=1.0) for i in range(4)],
     Memory(), 4, "Learning"),
    # A settled one idles: the scale-in window opens.
    ("idle-opens-the-window", 4, [pod(f"p{i}", 0.1, arrivals=1.0) for i in range(4)],
     history(400), 4, "Stabilizing"),
    # Pods being removed still hold KV: 1,500 + 1,000 draining blocks need the 3 pods kept.
    ("draining-pods-count", 3,
     [pod(f"p{i}", 0.5, arrivals=1.0) for i in range(3)]
     + [pod("x", 0.5, arrivals=0.0, terminating=True), pod("y", 0.5, terminating=True,
        arrivals=0.0)], history(1500), 3, "WithinTarget"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("current", "pods", "memory", "want", "reason"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_decide_table(
    current: int, pods: list[PodView], memory: Memory, want: int, reason: str
) -> None:
    d = run(current, pods, memory=memory)
    assert (d.replicas, d.reason) == (want, reason), d.message
    assert d.action == (
        "hold" if want == current else "scale-out" if want > current else "scale-in"
    )


def test_every_decision_says_why_with_the_numbers() -> None:
    d = run(2, [pod("a", 0.4, arrivals=2.0), pod("b", 0.4, arrivals=2.0)])
    f = d.figures
    assert f.demand_blocks == pytest.approx(1600) and f.present_blocks == pytest.approx(800)
    assert f.arrival_rate == pytest.approx(4.0)
    assert f.forecast is not None and f.needed_replicas == 3
    # The horizon: the spec's pod start (none seen yet) + the period + half the rate window.
    assert f.forecast.horizon == pytest.approx(120 + 15 + 30)
    for text in ("demand 1,600 blocks", "4.00 req/s", "block-s per request", "at 165 s",
                 "needs 3 pods at 70%", "2 -> 3"):  # fmt: skip
        assert text in d.message, d.message


def test_at_max_reports_limit_and_saturation() -> None:
    d = run(10, [pod(f"p{i}", 1.0, preempt=1.0) for i in range(10)])
    assert d.limited == "AtMaxReplicas"
    assert d.saturated and "preemptions/s" in d.saturated_message
    d = run(8, [pod(f"p{i}", 0.99, arrivals=1.5, waiting=5) for i in range(8)])
    assert d.replicas == 10 and d.limited == "AtMaxReplicas"
    assert "maxReplicas is 10" in d.limited_message


def test_missing_metrics_say_so_and_hold() -> None:
    d = run(3, [pod(f"p{i}", None) for i in range(3)])
    assert d.metrics == "missing" and d.limited == "MetricsUnavailable"
    assert "no fresh KV metrics" in d.message
    assert d.memory.scale_in is None


def test_step_is_rate_limited() -> None:
    policy = replace(POLICY, max_replicas=40, max_scale_up_pods=4)
    d = run(2, [pod("a", 0.9, arrivals=8.0), pod("b", 0.9, arrivals=8.0)], policy=policy)
    assert d.replicas == 6 and d.limited == "RateLimited"


def test_scale_up_stabilization_defers() -> None:
    policy = replace(POLICY, scale_up_stabilization_seconds=60)
    pods = [pod("a", 0.9), pod("b", 0.9)]
    d = run(2, pods, policy=policy, memory=Memory(last_up=NOW - 10))
    assert (d.replicas, d.reason, d.limited) == (2, "Stabilizing", "RateLimited")
    d = run(2, pods, policy=policy, memory=Memory(last_up=NOW - 61))
    assert d.replicas == 3


def test_partial_metrics_scale_out_but_never_in() -> None:
    hot = run(3, [pod("a", 0.95, arrivals=3.0), pod("b", None), pod("c", None)])
    assert hot.action == "scale-out" and hot.metrics == "partial"
    window = ScaleInWindow(since=NOW - 1000, history=((NOW - 15, 1),))  # the last tick's
    cold = run(4, [pod("a", 0.05), pod("b", None), pod("c", None), pod("d", 0.05)],
               memory=replace(history(100), scale_in=window))  # fmt: skip
    assert cold.replicas == 4 and cold.metrics == "partial"
    assert "but some ready pods do not report" in cold.message, cold.message


def test_a_mix_of_pods_with_and_without_counters_falls_back_to_the_kv_in_use() -> None:
    d = run(2, [pod("a", 0.4, arrivals=2.0), pod("b", 0.4)])
    assert d.figures.demand_blocks == pytest.approx(800) and d.figures.arrival_rate is None


def test_a_new_pod_without_counters_holds_the_measured_demand_not_the_backlog() -> None:
    # Demand measured at 1,200 blocks until the last decision; now a new pod reports no
    # counters yet while 16 requests (800 blocks) wait at the door for the pods on the way.
    # The series holds 1,200 rather than take in the backlog; past the hold, KV in use it is.
    pods = [pod("a", 0.5, arrivals=1.0, waiting=8), pod("b", 0.5, arrivals=1.0, waiting=8),
            pod("c", 0.05, running=1)]  # fmt: skip
    measured = replace(history(1200), lifetimes=((NOW - 15, 1200.0, 1.0),))
    held = run(3, pods, memory=measured)
    assert held.figures.demand_blocks == pytest.approx(1200)
    assert held.figures.present_blocks == pytest.approx(1850)
    assert held.replicas == 3 and held.reason == "WithinTarget"
    assert "measured 15 s ago, held while a pod that has just started" in held.message
    stale = NOW - decide_module.DEMAND_GAP_HOLD_SECONDS - 15
    late = run(3, pods, memory=replace(measured, lifetimes=((stale, 1200.0, 1.0),)))
    assert late.figures.demand_blocks == pytest.approx(1850)
    assert "no demand counters" in late.message and "held" not in late.message


def test_policy_rejects_inconsistent_bounds() -> None:
    with pytest.raises(ValueError, match="min"):
        replace(POLICY, min_replicas=5, max_replicas=3)
    with pytest.raises(ValueError, match="target_occupancy"):
        replace(POLICY, target_occupancy=0.9, scale_out_occupancy=0.85)
    with pytest.raises(ValueError, match="hysteresis"):
        replace(POLICY, scale_in_hysteresis=0.8)
    with pytest.raises(ValueError, match="forecast_quantile"):
        replace(POLICY, forecast_quantile=0.3)
    with pytest.raises(ValueError, match="usable_occupancy"):
        replace(POLICY, usable_occupancy=0.0)
    # A target above what the engine admits to is allowed (the CRD allows it): capped there.
    high = replace(POLICY, target_occupancy=0.97, scale_out_occupancy=0.99, usable_occupancy=0.95)
    assert run(2, [pod("a", 0.5), pod("b", 0.5)], policy=high).replicas >= 2


def test_scale_in_goes_to_highest_recommendation_in_window() -> None:
    pods = [pod(f"p{i}", 0.1, arrivals=1.0) for i in range(6)]
    window = ScaleInWindow(since=NOW - 400, history=((NOW - 290, 4), (NOW - 100, 2), (NOW - 15, 2)))
    d = run(6, pods, memory=replace(history(600), scale_in=window))
    assert (d.replicas, d.reason, d.action) == (4, "LowDemand", "scale-in")


def test_scale_in_waits_for_the_window_after_any_change() -> None:
    pods = [pod(f"p{i}", 0.1, arrivals=1.0) for i in range(6)]
    window = ScaleInWindow(since=NOW - 1000, history=((NOW - 15, 1),))  # the last tick's
    mem = replace(history(600), scale_in=window)
    d = run(6, pods, memory=replace(mem, last_up=NOW - 100))
    assert d.replicas == 6 and d.reason == "Stabilizing"
    d = run(6, pods, memory=replace(mem, last_up=NOW - 301))
    assert d.replicas == 4  # two pods per step
    d = run(4, pods[:4], memory=replace(mem, last_down=NOW - 30))
    assert d.replicas == 4 and "scale-in in 60 s" in d.message  # warmupSeconds apart


def test_an_unset_scale_in_window_is_one_provisioning_horizon() -> None:
    # Unset, the window is the time it takes to get a released pod back (pod start + period +
    # half the rates' window: 120 + 15 + 30 s); a window the spec sets is kept as it is.
    pods = [pod(f"p{i}", 0.1, arrivals=1.0) for i in range(6)]
    window = ScaleInWindow(since=NOW - 1000, history=((NOW - 15, 1),))  # the last tick's
    mem = replace(history(600), scale_in=window)
    horizon = replace(POLICY, scale_down_stabilization_seconds=None)
    d = run(6, pods, memory=replace(mem, last_up=NOW - 100), policy=horizon)
    assert d.figures.forecast is not None and d.figures.forecast.horizon == pytest.approx(165)
    assert d.reason == "Stabilizing" and "scale-in in 65 s" in d.message
    d = run(6, pods, memory=replace(mem, last_up=NOW - 200), policy=horizon)
    assert (d.replicas, d.reason) == (4, "LowDemand") and "enough for 165 s" in d.message
    d = run(6, pods, memory=replace(mem, last_up=NOW - 200))
    assert d.replicas == 6 and "scale-in in 100 s" in d.message  # the spec's 300 s


def test_pods_still_starting_that_are_not_needed_are_cancelled_ready_ones_kept() -> None:
    # 100 blocks would fit one pod, but ready pods go only after the window with nothing
    # starting: the starting pods, which have served nothing, are what goes now.
    ready = [pod("a", 0.05), pod("b", 0.05)]
    starting = [pod(f"s{i}", None, ready=False, age=30) for i in range(2)]
    window = ScaleInWindow(since=NOW - 1000, history=((NOW - 15, 1),))  # the last tick's
    d = run(4, ready + starting, memory=replace(history(100), scale_in=window))
    assert (d.replicas, d.action, d.reason) == (2, "scale-in", "StartingNotNeeded"), d.message
    assert "cancelling 2 of the 2 pod(s) still starting" in d.message and "4 -> 2" in d.message
    assert d.memory.last_down == NOW and d.memory.scale_in is None
    # Only those the forecast does not need: 1,500 blocks need a third pod under 60 %.
    hot = [pod("a", 0.75, arrivals=1.0), pod("b", 0.75, arrivals=1.0)]
    d = run(4, hot + starting, memory=history(1500))
    assert (d.replicas, d.reason) == (3, "StartingNotNeeded"), d.message


def test_starting_pods_stay_on_partial_metrics_and_while_learning() -> None:
    starting = [pod("s", None, ready=False, age=30)]
    partial = run(3, [pod("a", 0.05), pod("b", None), *starting], memory=history(100))
    assert (partial.replicas, partial.action) == (3, "hold"), partial.message
    # A new deployment's plan: its pods come up one by one while nothing is measured yet.
    new = run(3, [pod("a", 0.05), pod("b", 0.05), *starting], memory=Memory())
    assert (new.replicas, new.reason) == (3, "Learning"), new.message


@pytest.mark.parametrize("hysteresis", [0.95, 0.96])
def test_a_hysteresis_leaving_nothing_under_the_engines_watermark_turns_scale_in_off(
    hysteresis: float,
) -> None:
    # The CRD accepts scaleInHysteresis < targetOccupancy; with the headroom engine's usable
    # 95 %, these left 0 (a division by zero) or less (scale-in below the load, then back).
    p = replace(POLICY, target_occupancy=0.97, scale_out_occupancy=0.99,
                scale_in_hysteresis=hysteresis, usable_occupancy=0.95)  # fmt: skip
    pods = [pod(f"p{i}", 0.3, arrivals=1.0) for i in range(6)]
    d = run(6, pods, memory=history(1800, 600), policy=p)
    assert (d.replicas, d.action) == (6, "hold"), d.message
    assert f"scale-in is off: scaleInHysteresis {hysteresis:.0%}" in d.message


def test_long_requests_leave_room_on_every_pod() -> None:
    # 1,700 blocks fit 2 pools of 1,000 on the total, but then no pod has a free 400-block
    # request's worth: the band must also leave one long request's room on each pod.
    pods = [pod("a", 0.85, arrivals=1.0), pod("b", 0.85, arrivals=1.0)]
    short = run(
        2,
        pods,
        memory=history(1700),
        policy=replace(POLICY, target_occupancy=0.9, scale_out_occupancy=0.95),
    )
    long = run(
        2,
        pods,
        memory=history(1700),
        policy=replace(
            POLICY, target_occupancy=0.9, scale_out_occupancy=0.95, blocks_per_sequence=400
        ),
    )
    assert short.replicas < long.replicas  # fmt: skip


# ----------------------------------------------------------------------------- pod start


def test_the_horizon_is_this_deployments_own_pod_start() -> None:
    started = [
        PodView(f"p{i}", True, NOW - 1000, sample=pod("x", 0.5).sample, ready_since=NOW - 1000 + s)
        for i, s in enumerate((100.0, 200.0, 300.0, 400.0, 500.0, 600.0, 700.0, 800.0, 900.0))
    ]
    loading = [PodView(f"p{i}", False, NOW - 1000) for i in range(9)]
    seen = decide(Inputs(NOW - 990, 9, tuple(loading), POLICY))  # seen loading, 10 s old
    d = run(9, started, memory=seen.memory)
    assert d.figures.pod_start_seconds == 900.0  # the 90th percentile of 9 starts
    assert len(d.memory.pod_starts) == 9
    # Once learned, it is kept; a restarted operator starts from what status kept.
    again = decide(Inputs(NOW + 15, 9, tuple(started), POLICY, d.memory))
    assert again.memory.pod_starts == d.memory.pod_starts
    inp = Inputs(NOW, 2, (), POLICY, Memory(), learned_pod_start_seconds=240.0)
    assert pod_start_seconds(inp, Memory()) == 240.0
    assert pod_start_seconds(replace(inp, learned_pod_start_seconds=None), Memory()) == 120.0


# ----------------------------------------------------------------------------- multi-tick traps


def simulate(
    arrivals_at: list[float],
    current: int,
    *,
    per_request: float = 100.0,
    lifetime: float = 30.0,
    loading_ticks: int = 0,
    tick: float = 15.0,
    noise: float = 0.0,
    seed: int = 0,
    closed_loop: int | None = None,
    policy: Policy = POLICY,
) -> tuple[list[int], list[Decision]]:
    """Feed decide() traffic: requests arrive at `arrivals_at[i]` per second in tick i, hold
    `per_request` blocks for `lifetime` seconds, spread over the ready pods, which report the
    demand counters as sidecars do; new pods are ready `loading_ticks` after asked. With
    `closed_loop`, that many clients each send one request as soon as the last one finished."""
    rng = random.Random(seed)
    t = NOW
    mem = Memory()
    ready_at: list[float] = [t - 3600] * current
    # Each pod's own cumulative counters (arrived, departed, block-seconds).
    counters: dict[str, list[float]] = {}
    in_flight = (closed_loop or arrivals_at[0] * lifetime) if arrivals_at else 0.0
    out, decisions = [], []
    for rate in arrivals_at:
        if closed_loop is not None:
            rate = closed_loop / lifetime
        rate *= 1 + noise * rng.uniform(-1, 1)
        # A steady flow over the tick: in flight relaxes towards rate x lifetime.
        target = rate * lifetime
        before = in_flight
        in_flight += (target - in_flight) * (1 - math.exp(-tick / lifetime))
        ready = [k for k, r in enumerate(sorted(ready_at)) if r <= t]
        starting = len(ready_at) - len(ready)
        share = 1 / max(1, len(ready))
        step = (rate * tick, rate * tick - (in_flight - before),
                (before + in_flight) / 2 * per_request * tick)  # fmt: skip
        for k in ready:
            c = counters.setdefault(f"p{k}", [0.0, 0.0, 0.0])
            for j in range(3):
                c[j] += step[j] * share
        used = in_flight * per_request
        per = used / max(1, len(ready))
        pods = [
            PodView(f"p{k}", True, t - 3600, sample=PodSample(
                occupancy=min(1.0, per / 1000), sampled_at=t - 1,
                running=round(in_flight * share),
                waiting=round(max(0.0, per - 1000) / per_request),
                used_blocks=round(min(per, 1000)), capacity_blocks=1000,
                counters=CounterSample(t, *counters[f"p{k}"])))
            for k in ready
        ] + [PodView(f"s{k}", False, t - 10) for k in range(starting)]  # fmt: skip
        d = decide(Inputs(t, len(ready_at), tuple(pods), policy, mem))
        mem = d.memory
        if d.replicas > len(ready_at):
            ready_at += [t + loading_ticks * tick] * (d.replicas - len(ready_at))
        elif d.replicas < len(ready_at):
            ready_at = sorted(ready_at)[: d.replicas]
        out.append(len(ready_at))
        decisions.append(d)
        t += tick
    return out, decisions


def test_trap_never_scaling_down() -> None:
    # Load drops from 36 to 8 requests in flight (3,600 -> 800 blocks): after the window the
    # deployment shrinks to what keeps 800 blocks under 60 % with room for the band, and stays.
    hist, _ = simulate([1.2] * 20 + [8 / 30] * 80, current=6)
    assert hist[19] == 6
    assert hist[-1] in (2, 3) and hist[-1] == min(hist[40:])


def test_trap_never_scaling_down_when_pods_start_slower_than_the_growth_window() -> None:
    # The CRD's defaults: pods take 180 s to start, so the horizon (180 + 15 + the rates'
    # window / 2) is longer than the 180 s of demand the forecast fits. Scale-in waits until
    # demand has been measured for the horizon, which must come, however short the fit's window.
    slow = replace(POLICY, pod_start_seconds=180)
    hist, decisions = simulate([1.2] * 20 + [8 / 30] * 80, current=6, policy=slow)
    assert hist[-1] in (2, 3), [d.message for d in decisions[-3:]]


def test_trap_scaling_up_during_model_load() -> None:
    # A step to 2,500 blocks on 2 pods; new pods take 8 ticks (2 min) to load. It asks for what
    # the forecast needs and waits for the pods instead of adding more every tick.
    hist, _ = simulate([1.0] * 4 + [2500 / 30 / 100] * 24, current=2, loading_ticks=8)
    assert max(hist) <= 5
    changes = sum(1 for a, b in itertools.pairwise(hist) if a != b)
    assert changes <= 2


def test_trap_flapping_on_noisy_traffic() -> None:
    # Arrivals wobble +-20 % tick to tick around a level: the count settles and stays.
    hist, _ = simulate([1.2] * 80, current=2, noise=0.2, seed=3)
    changes = sum(1 for a, b in itertools.pairwise(hist[20:]) if a != b)
    assert changes <= 1


def test_trap_an_order_on_a_passing_burst_is_cancelled_before_it_serves() -> None:
    # Thirty seconds of twice the arrivals on pods that take 2 minutes to load: most of what it
    # ordered goes before it serves (the growth window's mean still holds the burst for a while,
    # so one pod stays).
    burst = [1.0] * 20 + [2.0] * 2 + [1.0] * 30
    hist, decisions = simulate(burst, current=5, loading_ticks=8)
    ordered = next(i for i, d in enumerate(decisions) if d.action == "scale-out")
    cancelled = next(i for i, d in enumerate(decisions) if d.reason == "StartingNotNeeded")
    assert hist[ordered] >= 8 and cancelled - ordered < 8, hist
    assert max(hist[ordered + 8 :]) <= 6, hist


def test_trap_ordering_and_cancelling_on_noise() -> None:
    # Arrivals wobble +-20 % around a level while pods take 2 minutes to load: orders that
    # could be cancelled must not come and go every tick.
    hist, _ = simulate([1.2] * 80, current=2, noise=0.2, seed=3, loading_ticks=8)
    changes = sum(1 for a, b in itertools.pairwise(hist[20:]) if a != b)
    assert changes <= 2, hist


def test_trap_a_closed_loop_is_not_a_ramp() -> None:
    # 24 clients that each send the next request when the last finishes (make demo's ramp):
    # demand is what 24 requests hold, so the count stays near what the plan says for 24.
    hist, decisions = simulate([0.0] * 40, current=1, closed_loop=24, per_request=100.0)
    planned = math.ceil(24 * 100 / 700)
    assert max(hist) <= 1.5 * planned, [d.message for d in decisions if d.action != "hold"]


def test_trap_a_ramp_scales_out_before_the_pools_fill() -> None:
    # Arrivals ramp from 0.3 to 3 per second over 5 minutes; pods take 2 minutes to load.
    ramp = [0.3 + 2.7 * min(1.0, i / 20) for i in range(40)]
    _, decisions = simulate([0.3] * 12 + ramp, current=1, loading_ticks=8, per_request=30)
    first_out = next(i for i, d in enumerate(decisions) if d.action == "scale-out")
    # The first scale-out comes from the demand signal while occupancy is still low.
    assert decisions[first_out].figures.mean_occupancy is not None
    assert decisions[first_out].figures.mean_occupancy < POLICY.scale_out_occupancy
    assert decisions[first_out].reason == "DemandForecast"


def test_trap_scaling_on_absent_metrics() -> None:
    for current in (1, 5, 10):
        d = run(current, [pod(f"p{i}", None) for i in range(current)])
        assert d.replicas == current and d.action == "hold"
        d = run(current, [pod(f"p{i}", 0.0, ago=600) for i in range(current)])
        assert d.replicas == current and d.action == "hold"


def test_trap_saturation_during_scale_to_max() -> None:
    hist, _ = simulate([20.0] * 10, current=2, loading_ticks=1)
    assert max(hist) == 10 and hist[-1] == 10
    d = run(10, [pod(f"p{i}", 1.0, preempt=2.0, waiting=50) for i in range(10)])
    assert d.replicas == 10 and d.saturated and d.limited == "AtMaxReplicas"


# ----------------------------------------------------------------------------- from the spec

# Policy fields that come from the plan or the runtime, not from ScalingSpec.
_NOT_FROM_THE_SPEC = {"blocks_per_pod", "blocks_per_sequence", "usable_occupancy"}


def test_every_scaling_default_reaches_decide_unchanged() -> None:
    """A CR that sets nothing under `scaling` is decided with exactly ScalingSpec's defaults:
    Policy has none of its own, and policy_for maps every field."""
    spec = InferenceDeploymentSpec.model_validate(
        {
            "model": {"preset": "llama-3.1-8b"},
            "gpu": {"type": "h100-80gb"},
            "traffic": {"peakConcurrency": 64, "contextTokens": 4096},
        }
    )
    sizing = size(spec)
    policy = policy_for(spec, sizing)
    seen: list[Policy] = []
    inp = Inputs(now=NOW, current_replicas=spec.scaling.min_replicas, pods=(), policy=policy)
    with pytest.MonkeyPatch.context() as mp:
        real = decide_module._rule_bounds

        def spy(inp: Inputs, base: Decision) -> Decision | None:
            seen.append(inp.policy)
            return real(inp, base)

        mp.setattr(decide_module, "_rule_bounds", spy)
        decide(inp)
    assert seen == [policy]
    defaults = ScalingSpec()
    for f in dataclasses.fields(Policy):
        assert f.default is dataclasses.MISSING, f"Policy.{f.name} has a default of its own"
        if f.name in _NOT_FROM_THE_SPEC:
            continue
        assert f.name in ScalingSpec.model_fields, f"Policy.{f.name} has no ScalingSpec field"
        assert getattr(policy, f.name) == getattr(defaults, f.name), f.name
    assert policy.blocks_per_pod == sizing.plan.kv_blocks_per_pod
    # The headroom engine stops admitting at its watermark; vLLM fills its pool.
    assert policy.usable_occupancy == 1 - DEFAULT_WATERMARK
    vllm = InferenceDeploymentSpec.model_validate(
        {
            "model": {"preset": "llama-3.1-8b", "path": "meta-llama/Llama-3.1-8B-Instruct"},
            "gpu": {"type": "h100-80gb"},
            "engine": {"runtime": "vllm"},
            "traffic": {"peakConcurrency": 64, "contextTokens": 4096},
        }
    )
    assert policy_for(vllm, size(vllm)).usable_occupancy == 1.0


def test_only_a_pod_seen_starting_teaches_the_pod_start() -> None:
    # A restarted operator sees pods already ready. One whose container restarted an hour ago
    # became Ready then, three days after it was created: that is no start.
    old = [
        PodView(f"p{i}", True, NOW - 3 * 86400, sample=pod("x", 0.3).sample,
                ready_since=NOW - 3 * 86400 + 150)
        for i in range(3)
    ] + [PodView("p3", True, NOW - 3 * 86400, sample=pod("x", 0.3).sample,
                 ready_since=NOW - 3600)]  # fmt: skip
    d = run(4, old)
    assert d.memory.pod_starts == () and d.figures.pod_start_seconds == POLICY.pod_start_seconds
    # Seen ready, then flipping Ready: still no start learned.
    flipped = decide(Inputs(NOW + 15, 4, (*old[:3], replace(old[3], ready=False)), POLICY,
                            d.memory))  # fmt: skip
    back = decide(Inputs(NOW + 30, 4, (*old[:3], replace(old[3], ready_since=NOW + 30)), POLICY,
                         flipped.memory))  # fmt: skip
    assert back.memory.pod_starts == ()
    # A pod asked for while the operator watches: its start is learned when it is ready.
    new = PodView("p4", False, NOW + 30)
    asked = decide(Inputs(NOW + 45, 5, (*old, new), POLICY, back.memory))
    ready = replace(new, ready=True, ready_since=NOW + 230, sample=pod("x", 0.3).sample)
    learned = decide(Inputs(NOW + 240, 5, (*old, ready), POLICY, asked.memory))
    assert learned.memory.pod_starts == (("p4", 200.0),)
    assert pod_start_seconds(Inputs(NOW + 240, 5, (), POLICY), learned.memory) == 200.0


def test_a_pod_that_served_and_went_unready_is_not_cancelled_as_starting() -> None:
    pods = [pod(f"p{i}", 0.05, arrivals=0.1) for i in range(5)]
    mem = history(600)
    seen = decide(Inputs(NOW - 15, 5, tuple(pods), POLICY, mem))
    assert "p4" in seen.memory.seen_ready
    blip = [*pods[:4], replace(pods[4], ready=False, sample=None)]
    d = run(5, blip, memory=replace(seen.memory, demand=mem.demand, held=mem.held))
    assert d.replicas == 5 and d.reason == "Hold", d.message
    assert "1 pod(s) that served are not ready" in d.message
    # A restarted operator has not seen it ready, but its sidecar reports KV in use.
    holding = [*pods[:4], replace(pods[4], ready=False)]
    assert run(5, holding, memory=mem).reason == "Hold"
    # The same pod never seen ready: a pod on its way, which the forecast no longer needs.
    fresh = run(5, blip, memory=replace(mem, seen_starting=frozenset({"p4"})))
    assert (fresh.replicas, fresh.reason) == (4, "StartingNotNeeded")


def test_an_old_pod_a_restarted_operator_first_sees_not_ready_is_no_start_and_not_cancelled() -> (
    None
):
    # The operator starts (empty memory) while a pod created three days ago is out of readiness
    # for a moment (a probe timeout): not a pod starting. When it is Ready again, creation to
    # Ready (three days) used to be learned as the pod start, and the horizon with it; and
    # before that, it was cancelled as a pod "which has served nothing", skipping the window.
    days = NOW - 3 * 86400
    pods = [replace(pod(f"p{i}", 0.2, arrivals=1.0), created_at=days) for i in range(2)]
    dipped = PodView("p2", False, days)
    first = run(3, [*pods, dipped], memory=history(600))
    assert (first.replicas, first.reason) == (3, "Hold"), first.message
    assert "1 pod(s) that served are not ready" in first.message
    assert "p2" not in first.memory.seen_starting
    back = replace(pod("p2", 0.2, arrivals=1.0), created_at=days, ready_since=NOW + 10)
    again = decide(Inputs(NOW + 15, 3, (*pods, back), POLICY, first.memory))
    assert again.memory.pod_starts == ()
    assert again.figures.pod_start_seconds == POLICY.pod_start_seconds
    # A young pod the restarted operator sees not ready is starting: cancelled when not needed,
    # and its start learned when it is ready.
    young = PodView("p2", False, NOW - 60)
    cancelled = run(3, [*pods, young], memory=history(600))
    assert (cancelled.replicas, cancelled.reason) == (2, "StartingNotNeeded"), cancelled.message
    # A pod this operator saw starting stays so past the grace (a slow or stuck start).
    slow = PodView("p2", False, NOW - 2 * POLICY.startup_grace_seconds)
    mem = replace(history(600), seen_starting=frozenset({"p2"}))
    assert run(3, [*pods, slow], memory=mem).reason == "StartingNotNeeded"


def test_departures_counted_near_zero_do_not_make_the_demand_infinite() -> None:
    # Rates a pod may report (each within usable()'s bounds), but a block-second per departure
    # of 1e12 / 1e-300 is infinite: math.ceil raised in the decision at every tick.
    # of 2,000 / 1e-300 is infinite: math.ceil raised in the decision at every tick. (Rates no
    # pod could do, such as 1e12 block-seconds a second from a pool of 1,000, give no rate.)
    odd = DemandRates(arrivals=1000.0, departures=1e-300, block_seconds=2000.0, window_seconds=60.0)
    hot = pod("a", 0.5, arrivals=1.0, running=6000)
    assert hot.sample is not None
    broken = replace(hot, sample=replace(hot.sample, demand=odd))
    d = run(2, [broken, pod("b", 0.5, arrivals=1.0)])
    assert d.replicas == POLICY.max_replicas and "inf" not in d.message, d.message


def test_scale_in_stays_under_the_scale_out_line() -> None:
    # Usable share 1.0 and hysteresis 0.1 would keep pods at 90 % of their KV in use, over a
    # scale-out line of 85 %: the next decision would buy the pod back, and again.
    policy = replace(POLICY, target_occupancy=0.7, scale_out_occupancy=0.85,
                     scale_in_hysteresis=0.1, usable_occupancy=1.0)  # fmt: skip
    pods = [pod(f"p{i}", 0.74, arrivals=0.1) for i in range(6)]
    window = ScaleInWindow(since=NOW - 1000, history=((NOW - 15, 1),))
    d = run(6, pods, memory=replace(history(600), scale_in=window), policy=policy)
    if d.replicas < 6:
        after = 6 * 740 / d.replicas / 1000
        assert after <= policy.scale_out_occupancy - policy.scale_in_hysteresis + 1e-9, after
    again = run(d.replicas, pods[: d.replicas], memory=d.memory, policy=policy)
    assert again.action != "scale-out", again.message


def test_a_scale_in_window_with_a_gap_in_its_decisions_starts_again() -> None:
    pods = [pod(f"p{i}", 0.1, arrivals=1.0) for i in range(6)]
    stale = ScaleInWindow(since=NOW - 1800, history=((NOW - 1800, 3),))
    d = run(6, pods, memory=replace(history(600), scale_in=stale))
    assert d.reason == "Stabilizing" and d.memory.scale_in is not None
    assert d.memory.scale_in.since == NOW


def test_needed_replicas_beyond_int64_are_recorded_at_the_cap() -> None:
    # Window rates a pod may report (each within usable()'s bounds), but departures of 1e-134
    # req/s: block-seconds per departure hit their cap, and the demand needed ~1e27 pods,
    # which status (int64) refused, whole, at every tick.
    s = PodSample(occupancy=0.0, sampled_at=NOW, used_blocks=0, capacity_blocks=1,
                  running=10**12, demand=DemandRates(1e10, 1e-134, 2.0, 60.0))  # fmt: skip
    d = decide(Inputs(NOW, 1, (PodView("p0", True, NOW, sample=s),), POLICY))
    assert d.figures.needed_replicas == MAX_PODS
    rec = decision_record(d, 1, NOW, True)
    assert rec["inputs"]["neededReplicas"] == MAX_PODS
    assert d.replicas == 1 + POLICY.max_scale_up_pods


@pytest.mark.parametrize("target", [1e-310, 1e-20])
def test_a_near_zero_target_occupancy_asks_for_the_most_pods_without_raising(
    target: float,
) -> None:
    # The CRD takes any target above 0: 1e-310 made the pods needed infinite and math.ceil
    # raised at every tick (scaling stopped for good); 1e-20 needed 1e21 pods, past int64.
    base = {"model": {"preset": "llama-3.1-8b"}, "gpu": {"type": "h100-80gb"},
            "traffic": {"peakConcurrency": 8, "contextTokens": 1024},
            "scaling": {"targetOccupancy": target, "scaleInHysteresis": 0,
                        "maxReplicas": 3}}  # fmt: skip
    spec = InferenceDeploymentSpec.model_validate(base)
    policy = policy_for(spec, size(spec))
    busy = PodSample(occupancy=0.5, sampled_at=NOW, waiting=300, running=10)
    d = decide(Inputs(NOW, 1, (PodView("p0", True, NOW - 3600, sample=busy),), policy))
    assert d.replicas == 3 and d.figures.needed_replicas == MAX_PODS
    assert "inf" not in d.message and "nan" not in d.message
    assert decision_record(d, 1, NOW, True)["inputs"]["neededReplicas"] == MAX_PODS


# ----------------------------------------------------------------------------- boundaries


def test_policy_accepts_the_edges_of_its_ranges_and_rejects_past_them() -> None:
    """Each range Policy checks, at its edge: the CRD's values there must construct."""
    for ok in ({"min_replicas": 1, "max_replicas": 1}, {"scale_out_occupancy": 1.0},
               {"blocks_per_pod": 1, "blocks_per_sequence": 1}, {"scale_in_hysteresis": 0.0},
               {"forecast_quantile": 0.5}, {"usable_occupancy": 1.0}):  # fmt: skip
        replace(POLICY, **ok)  # type: ignore[arg-type]
    for bad in ({"min_replicas": 0}, {"target_occupancy": 0.0}, {"scale_out_occupancy": 1.01},
                {"blocks_per_pod": 0}, {"blocks_per_sequence": 0}, {"scale_in_hysteresis": -0.1},
                {"forecast_quantile": 1.0}, {"usable_occupancy": 1.01}):  # fmt: skip
        with pytest.raises(ValueError):
            replace(POLICY, **bad)  # type: ignore[arg-type]


def test_the_pod_start_is_the_90th_percentile_of_the_last_20_starts() -> None:
    """Of 20 starts the 18th shortest (not the longest), and only the newest 20 are kept."""
    starts = tuple((f"p{i}", float(s)) for i, s in enumerate(range(100, 2100, 100)))
    inp = Inputs(NOW, 2, (), POLICY)
    assert pod_start_seconds(inp, Memory(pod_starts=starts)) == 1800.0
    # A 21st start (the shortest) pushes out the oldest (100 s): 200..2,000 s and 50 s.
    mem = Memory(pod_starts=starts, seen_starting=frozenset({"new"}))
    new = PodView("new", True, NOW - 100, sample=pod("x", 0.3).sample, ready_since=NOW - 50)
    d = decide(Inputs(NOW, 1, (new,), POLICY, mem))
    assert len(d.memory.pod_starts) == 20 and d.memory.pod_starts[0] == ("p1", 200.0)
    assert d.memory.pod_starts[-1] == ("new", 50.0)


def test_missing_metrics_report_no_figures_beyond_the_pod_counts() -> None:
    """A decision on no fresh sample measures nothing: every figure but the counts is unset."""
    d = run(3, [pod(f"p{i}", None) for i in range(3)])
    assert dataclasses.asdict(d.figures) == {
        "ready": 3, "starting": 0, "reporting": 0, "mean_occupancy": None,
        "max_occupancy": None, "min_eta_seconds": None, "forecast_pending": 0, "waiting": 0,
        "preemption_rate": 0.0, "hit_ratio": None, "present_blocks": None,
        "demand_blocks": None, "arrival_rate": None, "block_seconds_per_request": None,
        "forecast": None, "pod_start_seconds": None, "needed_replicas": None,
        "projected_occupancy": None, "stuck": 0,
    }  # fmt: skip
    assert not d.saturated and d.saturated_message == ""


def test_a_sample_without_a_running_count_charges_waiting_requests_the_planned_blocks() -> None:
    """No running requests reported: a waiting one claims `blocks_per_sequence`, not the pod's
    used blocks per request; from one running request on, the measured share."""
    s = PodSample(occupancy=0.5, sampled_at=NOW, waiting=2, used_blocks=500, capacity_blocks=1000)
    d = decide(Inputs(NOW, 1, (PodView("p0", True, NOW - 3600, sample=s),), POLICY))
    assert d.figures.present_blocks == pytest.approx(500 + 2 * 100)
    one = replace(s, running=1)
    d = decide(Inputs(NOW, 1, (PodView("p0", True, NOW - 3600, sample=one),), POLICY))
    assert d.figures.present_blocks == pytest.approx(500 + 2 * 500)


def test_the_scale_in_window_goes_to_its_highest_recommendation_not_its_lowest() -> None:
    """HPA's sliding window: the most pods recommended inside it, whatever the step allows."""
    window = ScaleInWindow(since=NOW - 400, history=((NOW - 290, 4), (NOW - 15, 1)))
    assert window.replicas == 4
    pods = [pod(f"p{i}", 0.1, arrivals=1.0) for i in range(6)]
    wide = replace(POLICY, max_scale_down_pods=5)
    d = run(6, pods, memory=replace(history(600), scale_in=window), policy=wide)
    assert (d.replicas, d.reason) == (4, "LowDemand"), d.message


def test_the_measured_demand_is_held_over_a_gap_of_at_most_120_s() -> None:
    """DEMAND_GAP_HOLD_SECONDS: a gap of exactly 120 s still holds the last measured demand,
    one a second longer takes the KV in use."""
    pods = [pod("a", 0.5, arrivals=1.0, waiting=8), pod("b", 0.5, arrivals=1.0, waiting=8),
            pod("c", 0.05, running=1)]  # fmt: skip
    for gap, demand in ((120.0, 1200.0), (121.0, 1850.0)):
        mem = replace(history(1200), lifetimes=((NOW - gap, 1200.0, 1.0),))
        assert run(3, pods, memory=mem).figures.demand_blocks == pytest.approx(demand), gap


def counted(now: float, counters: CounterSample, mem: Memory, policy: Policy = POLICY) -> Decision:
    """One pod (500 of 1,000 blocks, 10 running) whose window rate is 2 req/s x 250 block-s
    per request and whose cumulative counters read `counters`."""
    s = PodSample(occupancy=0.5, sampled_at=now, running=10, used_blocks=500,
                  capacity_blocks=1000, demand=DemandRates(2.0, 2.0, 500.0, 60.0),
                  counters=counters)  # fmt: skip
    return decide(Inputs(now, 1, (PodView("p0", True, 0.0, sample=s),), policy, mem))


def test_readings_one_second_apart_are_a_tick_and_closer_ones_one_reading() -> None:
    """MIN_TICK_SPAN_SECONDS: counters read 1 s after the last are rated over that second;
    read 0.5 s after, they are the same scrape again and repeat the pod's last rate."""
    base = CounterSample(NOW, arrived=1e6, departed=1e6, block_seconds=5e8)
    first = counted(NOW, base, Memory())
    assert first.figures.arrival_rate == pytest.approx(2.0)  # the window rate, seen first
    for span, rate in ((1.0, 3.0), (0.5, 2.0)):
        read = CounterSample(NOW + span, 1e6 + 3 * span, 1e6 + 3 * span, 5e8 + 500 * span)
        d = counted(NOW + 15, read, first.memory)
        assert d.figures.arrival_rate == pytest.approx(rate), span


def test_a_reading_older_than_the_last_by_over_60_s_is_no_ha_pairs_scrape() -> None:
    """MAX_HA_LAG_SECONDS, with stale samples allowed an hour: 59 s older repeats the last
    rate (an HA pair's other replica), 60.5 s older gives no rate and is the new baseline."""
    lenient = replace(POLICY, metrics_max_age_seconds=3600)
    base = CounterSample(NOW, arrived=1e6, departed=1e6, block_seconds=5e8)
    first = counted(NOW, base, Memory(), lenient)
    for lag, rate in ((59.0, 2.0), (60.5, None)):
        read = CounterSample(NOW - lag, 1e6 - 2 * lag, 1e6 - 2 * lag, 5e8 - 500 * lag)
        d = counted(NOW + 15, read, first.memory, lenient)
        assert d.figures.arrival_rate == (None if rate is None else pytest.approx(rate)), lag
        assert dict(d.memory.counters)["p0"] == (base if rate is not None else read)


def test_block_seconds_per_request_average_the_last_600_s_of_decisions() -> None:
    """PER_REQUEST_WINDOW_SECONDS: a deployment's block-seconds and departures of 599 s ago
    count, those of 600 s ago or more (a long request mix since gone) do not."""
    pods = [pod("a", 0.5, arrivals=1.0)]  # 500 block-s per second, 1 departure per second
    mem = Memory(lifetimes=((NOW - 601, 1e6, 1.0), (NOW - 600, 1e6, 1.0), (NOW - 599, 300.0, 1.0)))
    d = run(1, pods, memory=mem)
    assert d.figures.block_seconds_per_request == pytest.approx((300 + 500) / 2)
    assert [t for t, _, _ in d.memory.lifetimes] == [NOW - 599, NOW]


def test_block_seconds_per_request_are_capped_at_a_day_of_10_to_the_12_blocks() -> None:
    """MAX_BLOCK_SECONDS_PER_REQUEST: departures counted near zero make the ratio infinite,
    recorded at the cap; a request mix that is merely long (2,000 blocks for 28 h) is not cut."""
    for departures, want in ((1e-300, 1e12 * 86400), (1e-5, 2e8)):
        odd = DemandRates(arrivals=1e-5, departures=departures, block_seconds=2000.0,
                          window_seconds=60.0)  # fmt: skip
        s = PodSample(occupancy=1.0, sampled_at=NOW, running=10, used_blocks=1000,
                      capacity_blocks=1000, demand=odd)  # fmt: skip
        d = decide(Inputs(NOW, 1, (PodView("p0", True, NOW - 3600, sample=s),), POLICY))
        assert d.figures.block_seconds_per_request == pytest.approx(want), departures


def test_a_sample_exactly_the_max_age_old_is_fresh() -> None:
    """metricsMaxAgeSeconds is the oldest a sample may be: 60 s old counts, 60.5 s does not."""
    assert run(2, [pod("a", 0.9, ago=60.0), pod("b", 0.9, ago=60.0)]).reason == "HighOccupancy"
    stale = run(2, [pod("a", 0.9, ago=60.5), pod("b", 0.9, ago=60.5)])
    assert stale.reason == "MetricsUnavailable"


@pytest.mark.parametrize(
    ("running", "used", "occupancy", "served"),
    [(0, 0, 0.0, False), (0, None, 0.0, False), (1, 0, 0.0, True), (0, 1, 0.0, True),
     (0, None, 0.001, True)],
)  # fmt: skip
def test_a_young_unready_pod_has_served_when_its_engine_holds_any_request_or_block(
    running: int, used: int | None, occupancy: float, served: bool
) -> None:
    """A restarted operator tells a dipped pod from a starting one by its engine: any running
    request, used block or occupancy has served (hold); an empty engine is starting (cancel)."""
    pods = [replace(pod(f"p{i}", 0.05, arrivals=0.1), created_at=NOW - 86400) for i in range(2)]
    s = PodSample(occupancy=occupancy, sampled_at=NOW, running=running, used_blocks=used)
    young = PodView("p2", False, NOW - 60, sample=s)
    d = run(3, [*pods, young], memory=history(600))
    want = (3, "Hold") if served else (2, "StartingNotNeeded")
    assert (d.replicas, d.reason) == want, d.message


def test_only_pods_not_ready_past_the_startup_grace_are_stuck() -> None:
    """figures.stuck: a ready pod however old is not stuck, nor a young one still loading."""
    pods = [pod("old", 0.5, age=86400), pod("young", None, ready=False, age=60),
            pod("late", None, ready=False, age=POLICY.startup_grace_seconds + 1)]  # fmt: skip
    assert run(3, pods).figures.stuck == 1


def test_silent_ready_pods_carry_the_reporting_pods_average_kv_and_requests() -> None:
    """1 of 3 ready pods reports 500 blocks held by 10 requests: the deployment holds 1,500
    blocks in 30 requests, 50 blocks each, which the forecast's Poisson band is made of; and
    the arrivals of a pod that counts stand for the silent ones' too."""
    d = run(3, [pod("a", 0.5, running=10), pod("b", None), pod("c", None)])
    assert d.figures.present_blocks == pytest.approx(1500)
    fc = d.figures.forecast
    assert fc is not None and fc.mean == pytest.approx(1500)
    assert fc.band == pytest.approx(NormalDist().inv_cdf(0.95) * math.sqrt(1500 * 50))
    # No rates, so no averaging span: the horizon is the pod start and the period alone.
    assert fc.horizon == pytest.approx(120 + 15)
    # Their arrivals too: 2 req/s on the one that counts, 4 on the deployment.
    d = run(2, [pod("a", 0.4, arrivals=2.0), pod("b", None)])
    assert d.figures.arrival_rate == pytest.approx(4.0)
    assert d.figures.demand_blocks == pytest.approx(4.0 * 400)


def test_silent_ready_pods_carry_the_reporting_pods_average_queue_too() -> None:
    """1 of 4 ready pods reports 500 blocks held by 10 requests and 20 waiting: the silent
    three are taken to queue as many, so the present demand is what four reporting pods
    give (6,000 blocks), not a quarter of the backlog (3,000). Status shows the 20 reported."""
    pods = [pod(f"p{i}", 0.5, waiting=20) for i in range(4)]
    every = run(4, pods)
    one = run(4, [pods[0], *(pod(f"p{i}", None) for i in range(1, 4))])
    assert every.figures.present_blocks == pytest.approx(6000)
    assert one.figures.present_blocks == pytest.approx(6000)
    assert one.figures.waiting == 20 and every.figures.waiting == 80


def test_a_draining_pods_queue_is_demand_as_its_kv_is() -> None:
    """A pod being removed still holds 500 blocks and 10 requests queue on it: both count."""
    d = run(2, [pod("a", 0.5), pod("x", 0.5, waiting=10, terminating=True)])
    assert d.figures.present_blocks == pytest.approx(1000 + 10 * 50)


def test_the_demand_and_kv_series_keep_exactly_the_growth_window() -> None:
    """growth_window_seconds (180): points from 180 s ago on are kept and fitted, older ones
    go; the KV-in-use series, whose scatter widens the band, alike."""
    # A point at `now` itself (a decision repeated at the same instant) is this decision's.
    times = (NOW - 195, NOW - 180, NOW - 15, NOW)
    mem = Memory(demand=tuple((t, 700.0) for t in times), held=tuple((t, 700.0) for t in times))
    d = run(1, [pod("a", 0.5)], memory=mem)
    assert [t for t, _ in d.memory.demand] == [NOW - 180, NOW - 15, NOW]
    assert [t for t, _ in d.memory.held] == [NOW - 180, NOW - 15, NOW]
    assert d.memory.held[-1] == (NOW, pytest.approx(500)) == d.memory.demand[-1]


@pytest.mark.parametrize(("start", "projected"), [(90, True), (75, False)])
def test_a_trend_is_projected_once_half_the_growth_window_is_measured(
    start: int, projected: bool
) -> None:
    """KV in use rising 100 blocks every 15 s: its slope is fitted from 90 s of history (half
    of 180) on, and before that only the level counts (pods filling from empty)."""
    ramp = tuple((NOW - dt, 1000.0 - 100 * dt / 15) for dt in range(start, 0, -15))
    d = run(2, [pod("a", 0.5), pod("b", 0.5)], memory=Memory(demand=ramp, held=ramp))
    fc = d.figures.forecast
    assert fc is not None
    assert fc.slope == (pytest.approx(100 / 15) if projected else 0.0), d.message


def test_the_nearest_saturation_eta_is_the_smallest_of_the_pods() -> None:
    """figures.min_eta_seconds: the pod that fills first, not the last."""
    s = PodSample(occupancy=0.5, sampled_at=NOW, used_blocks=500, capacity_blocks=1000)
    pods = [PodView(f"p{e}", True, 0.0, sample=replace(s, eta_seconds=e)) for e in (300, 100)]
    assert run(2, pods).figures.min_eta_seconds == 100


def test_a_memory_without_its_start_has_measured_since_its_first_demand_point() -> None:
    """Memory.demand_since unset (a memory that predates it): scale-in waits until the demand
    series' first point is a horizon old, even a point the growth window (180 s) drops: pods
    that start in 180 s make the horizon 180 + 15 + 30 = 225 s."""
    pods = [pod(f"p{i}", 0.1, arrivals=1.0) for i in range(4)]
    slow = replace(POLICY, pod_start_seconds=180)
    assert run(4, pods, memory=history(400, 230), policy=slow).reason == "Stabilizing"
    assert run(4, pods, memory=history(400, 215), policy=slow).reason == "Learning"


@pytest.mark.parametrize(
    ("arrivals", "block_seconds", "possible"),
    [(16.0, 500.0, True), (16.01, 500.0, False), (1.0, 2000.0, True), (1.0, 2000.5, False)],
)
def test_a_window_rate_past_what_one_pod_could_do_is_no_rate(
    arrivals: float, block_seconds: float, possible: bool
) -> None:
    """_possible's edges, for a pod of 1,000 blocks with 10 running and 10 waiting: at most
    twice its pool in block-seconds a second, and over 50 s at most 10 x (50 departed + 20 in
    flight) + 100 = 800 arrivals."""
    rate = DemandRates(arrivals, 1.0, block_seconds, 50.0)
    s = PodSample(occupancy=0.5, sampled_at=NOW, running=10, waiting=10, used_blocks=500,
                  capacity_blocks=1000, demand=rate)  # fmt: skip
    d = decide(Inputs(NOW, 1, (PodView("p0", True, NOW - 3600, sample=s),), POLICY))
    assert (d.figures.arrival_rate is not None) == possible


@pytest.mark.parametrize(
    ("interval", "span", "per_second", "rate"),
    [(15, 600, 3.0, 3.0), (15, 700, 3.0, 2.0), (400, 800, 3.0, 3.0), (400, 1000, 3.0, 2.0),
     (15, 700, 0.0, 2.0)],
)  # fmt: skip
def test_a_tick_spans_at_most_600_s_or_two_decision_intervals(
    interval: float, span: float, per_second: float, rate: float
) -> None:
    """MAX_TICK_SPAN_SECONDS: counters read up to 600 s (or two intervals, if longer) after
    the last are rated over that span (3 req/s); read later, the window rate (2) stands in,
    also where the counters stood still."""
    policy = replace(POLICY, interval_seconds=interval)
    first = counted(NOW, CounterSample(NOW, 1e6, 1e6, 5e8), Memory(), policy)
    n = per_second * span
    read = CounterSample(NOW + span, 1e6 + n, 1e6 + n, 5e8 + 500 * span * (per_second > 0))
    d = counted(NOW + span, read, first.memory, policy)
    assert d.figures.arrival_rate == pytest.approx(rate)


def test_one_full_pod_saturates_the_deployment() -> None:
    """saturated and figures.max_occupancy follow the fullest pod, not the emptiest; any
    preemption at all saturates too, and the projection is the band over today's pods."""
    d = run(2, [pod("a", 0.5), pod("b", 1.0)])
    assert d.saturated and d.figures.max_occupancy == 1.0 and d.figures.mean_occupancy == 0.75
    assert "max occupancy 100%" in d.saturated_message
    d = run(2, [pod("a", 0.5, preempt=0.5), pod("b", 0.5)])
    assert d.saturated and "0.50 preemptions/s" in d.saturated_message
    assert not run(2, [pod("a", 0.5), pod("b", 0.99)]).saturated
    fc = d.figures.forecast
    assert fc is not None and d.figures.projected_occupancy == pytest.approx(fc.upper / 2000)


@pytest.mark.parametrize(("ago", "since"), [(30.0, NOW - 1000), (31.0, NOW)])
def test_a_scale_in_window_survives_one_missed_decision_not_more(ago: float, since: float) -> None:
    """The window's evidence holds if its last recommendation is at most two intervals (30 s)
    old; older, the window starts again now."""
    pods = [pod(f"p{i}", 0.1, arrivals=1.0) for i in range(6)]
    window = ScaleInWindow(since=NOW - 1000, history=((NOW - ago, 6),))
    d = run(6, pods, memory=replace(history(600), scale_in=window))
    assert d.memory.scale_in is not None and d.memory.scale_in.since == since


@pytest.mark.parametrize(
    ("stabilization", "last_up", "deferred"),
    [(1, NOW - 0.5, True), (1, NOW - 1, False), (0, NOW + 10, False)],
)
def test_the_up_stabilization_window_defers_only_inside_it(
    stabilization: float, last_up: float, deferred: bool
) -> None:
    """A scale-up within scaleUpStabilizationSeconds of the last is deferred, however short the
    window; with none (0), a last scale-up dated ahead (a clock stepped back) defers nothing."""
    policy = replace(POLICY, scale_up_stabilization_seconds=stabilization)
    d = run(2, [pod("a", 0.9), pod("b", 0.9)], policy=policy, memory=Memory(last_up=last_up))
    assert (d.reason == "Stabilizing") == deferred and (d.replicas == 2) == deferred, d.message
