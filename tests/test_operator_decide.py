"""decide(): table-driven cases, then multi-tick traps other autoscalers fell into."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import replace

import pytest

import headroom.operator.scaling.decide as decide_module
from headroom.operator.crd.models import InferenceDeploymentSpec, ScalingSpec
from headroom.operator.reconcile.sizing import size
from headroom.operator.scaling.decide import (
    Decision,
    Inputs,
    PodSample,
    PodView,
    Policy,
    ScaleInWindow,
    decide,
)
from headroom.operator.scaling.loop import policy_for

NOW = 10_000.0
POLICY = Policy(
    min_replicas=1,
    max_replicas=10,
    blocks_per_pod=1000,
    blocks_per_sequence=100,
    target_occupancy=0.7,
    scale_out_occupancy=0.85,
    scale_in_hysteresis=0.1,
    lookahead_seconds=120,
    scale_up_stabilization_seconds=0,
    scale_down_stabilization_seconds=300,
    max_scale_up_pods=8,
    max_scale_down_pods=2,
    metrics_max_age_seconds=60,
    startup_grace_seconds=900,
    warmup_seconds=90,
    growth_window_seconds=90,
)


def pod(
    name: str,
    occ: float | None,
    *,
    eta: float | None = None,
    ready: bool = True,
    waiting: int = 0,
    preempt: float = 0.0,
    ago: float = 2.0,
    up: bool = True,
    age: float = 3600.0,
    terminating: bool = False,
) -> PodView:
    sample = None
    if occ is not None:
        sample = PodSample(
            occupancy=occ,
            sampled_at=NOW - ago,
            eta_seconds=eta,
            waiting=waiting,
            preemption_rate=preempt,
            used_blocks=round(occ * 1000),
            capacity_blocks=1000,
            engine_up=up,
        )
    return PodView(
        name=name, ready=ready, created_at=NOW - age, terminating=terminating, sample=sample
    )


def run(current: int, pods: list[PodView], **kw: object) -> Decision:
    policy = kw.pop("policy", POLICY)
    assert isinstance(policy, Policy)
    return decide(
        Inputs(now=NOW, current_replicas=current, pods=tuple(pods), policy=policy, **kw)  # type: ignore[arg-type]
    )


CASES = [
    # (id, current, pods, expected replicas, expected reason)
    ("steady-within-target", 3, [pod(f"p{i}", 0.5) for i in range(3)], 3, "WithinTarget"),
    # ETA 60 s < lookahead 120 s: growth 400/60 blocks/s per pod; demand at the horizon is
    # 1200 + 2*6.67*120 = 2800 blocks -> 4 pods at 70 %, not +1.
    ("eta-inside-lookahead", 2, [pod("a", 0.6, eta=60), pod("b", 0.6, eta=60)], 4,
     "SaturationSoon"),
    ("eta-outside-lookahead", 2, [pod("a", 0.6, eta=600), pod("b", 0.6, eta=600)], 2,
     "WithinTarget"),
    # Mean 90 % > 85 %: 1800 blocks need ceil(1800/700) = 3 pods.
    ("high-mean-occupancy", 2, [pod("a", 0.9), pod("b", 0.9)], 3, "HighOccupancy"),
    # Preemptions: 1600 used + 4 waiting x 100 blocks = 2000 -> 3 pods.
    ("preempting", 2, [pod("a", 0.8, preempt=0.5, waiting=2), pod("b", 0.8, waiting=2)], 3,
     "Preempting"),
    # One hot pod: its ETA fires, and the deployment's projection (800 + 10 blocks/s x 120 s =
    # 2,000 blocks) crosses 85 % of 2 pods, so the KV math sizes 3.
    ("hot-pod-and-the-total-agree", 2, [pod("a", 0.7, eta=30), pod("b", 0.1)], 3,
     "SaturationSoon"),
    # A hot pod the total does not confirm (700 + 480 blocks < 1,700): more pods would not help.
    ("hot-pod-alone-is-imbalance", 2, [pod("a", 0.6, eta=100), pod("b", 0.1)], 2,
     "LoadImbalance"),
    # Model load: 2 of 4 ready and saturating, 2 loading; the 4 cover the projected demand.
    ("capacity-on-the-way", 4,
     [pod("a", 0.95, eta=30), pod("b", 0.95, eta=30), pod("c", None, ready=False, age=60),
      pod("d", None, ready=False, age=60)], 4, "CapacityPending"),
    # ...but when demand outgrows even the pods on the way, scale further.
    ("demand-beyond-pods-on-the-way", 3,
     [pod("a", 0.99, eta=5, waiting=20), pod("b", 0.99, eta=5, waiting=20),
      pod("c", None, ready=False, age=60)], 10, "SaturationSoon"),
    ("no-metrics-at-all", 3, [pod(f"p{i}", None) for i in range(3)], 3, "MetricsUnavailable"),
    ("stale-metrics", 3, [pod(f"p{i}", 0.99, eta=5, ago=120) for i in range(3)], 3,
     "MetricsUnavailable"),
    ("engine-down", 2, [pod("a", 0.99, up=False), pod("b", 0.99, up=False)], 2,
     "MetricsUnavailable"),
    ("nothing-ready-yet", 2, [pod("a", None, ready=False), pod("b", None, ready=False)], 2,
     "WaitingForPods"),
    ("above-max-after-spec-change", 12, [pod(f"p{i}", 0.5) for i in range(12)], 10,
     "SpecBounds"),
    ("below-min-after-spec-change", 1, [pod("a", 0.5)], 2, "SpecBounds"),
    ("at-max-and-saturated", 10, [pod(f"p{i}", 1.0, preempt=1.0) for i in range(10)], 10,
     "AtMaxReplicas"),
    ("capped-at-max", 8, [pod(f"p{i}", 0.99, eta=10, waiting=5) for i in range(8)], 10,
     "SaturationSoon"),
    ("low-load-starts-window", 4, [pod(f"p{i}", 0.2) for i in range(4)], 4, "Stabilizing"),
    ("terminating-pods-ignored", 2,
     [pod("a", 0.5), pod("b", 0.5), pod("old", 0.99, eta=1, terminating=True)], 2,
     "WithinTarget"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("current", "pods", "want", "reason"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_decide_table(current: int, pods: list[PodView], want: int, reason: str) -> None:
    policy = replace(POLICY, min_replicas=2) if reason == "SpecBounds" and current == 1 else POLICY
    d = run(current, pods, policy=policy)
    assert (d.replicas, d.reason) == (want, reason), d.message
    assert d.action == (
        "hold" if want == current else "scale-out" if want > current else "scale-in"
    )


def test_at_max_reports_limit_and_saturation() -> None:
    d = run(10, [pod(f"p{i}", 1.0, preempt=1.0) for i in range(10)])
    assert d.limited == "AtMaxReplicas"
    assert d.saturated and "preemptions/s" in d.saturated_message
    d = run(8, [pod(f"p{i}", 0.99, eta=10, waiting=5) for i in range(8)])
    assert d.replicas == 10 and d.limited == "AtMaxReplicas"
    assert "maxReplicas is 10" in d.limited_message


def test_missing_metrics_say_so_and_hold() -> None:
    d = run(3, [pod(f"p{i}", None) for i in range(3)])
    assert d.metrics == "missing" and d.limited == "MetricsUnavailable"
    assert "no fresh KV metrics" in d.message
    assert d.scale_in is None


def test_step_is_rate_limited() -> None:
    policy = replace(POLICY, max_replicas=40, max_scale_up_pods=4)
    d = run(
        2, [pod("a", 0.99, eta=5, waiting=30), pod("b", 0.99, eta=5, waiting=30)], policy=policy
    )
    assert d.replicas == 6 and d.limited == "RateLimited"


def test_scale_up_stabilization_defers() -> None:
    policy = replace(POLICY, scale_up_stabilization_seconds=60)
    pods = [pod("a", 0.9), pod("b", 0.9)]
    d = run(2, pods, policy=policy, last_scale_up_at=NOW - 10)
    assert (d.replicas, d.reason, d.limited) == (2, "Stabilizing", "RateLimited")
    d = run(2, pods, policy=policy, last_scale_up_at=NOW - 61)
    assert d.replicas == 3


def test_partial_metrics_scale_out_but_never_in() -> None:
    hot = run(3, [pod("a", 0.95, eta=20), pod("b", None), pod("c", None)])
    assert hot.action == "scale-out" and hot.metrics == "partial"
    window = ScaleInWindow(since=NOW - 1000, history=((NOW - 1000, 1),))
    cold = run(4, [pod("a", 0.05), pod("b", None), pod("c", None), pod("d", 0.05)], scale_in=window)
    assert cold.replicas == 4 and cold.metrics == "partial"


def test_policy_rejects_inconsistent_bounds() -> None:
    with pytest.raises(ValueError, match="min"):
        replace(POLICY, min_replicas=5, max_replicas=3)
    with pytest.raises(ValueError, match="target_occupancy"):
        replace(POLICY, target_occupancy=0.9, scale_out_occupancy=0.85)
    with pytest.raises(ValueError, match="hysteresis"):
        replace(POLICY, scale_in_hysteresis=0.8)


# ----------------------------------------------------------------------------- multi-tick traps


def simulate(
    demand_at: list[float],
    current: int,
    *,
    loading_ticks: int = 0,
    tick: float = 15.0,
    noise: float = 0.0,
) -> list[int]:
    """Feed decide() a demand trace (blocks), with new pods ready `loading_ticks` after asked."""
    t = NOW
    window: ScaleInWindow | None = None
    recent: tuple[tuple[float, float], ...] = ()
    last_up = last_down = None
    ready_at: list[float] = [t - 3600] * current
    history = []
    for i, demand in enumerate(demand_at):
        ready = [r for r in ready_at if r <= t]
        starting = len(ready_at) - len(ready)
        per = demand / max(1, len(ready)) / 1000
        jitter = noise if i % 2 else -noise
        occ = min(1.0, per + jitter)
        # What does not fit queues: waiting requests of blocks_per_sequence (100) blocks each.
        waiting = round(max(0.0, per - 1.0) * 1000 / 100)
        pods = [
            PodView(f"p{k}", True, t - 3600, sample=PodSample(
                occupancy=occ, sampled_at=t - 1, waiting=waiting,
                used_blocks=round(1000 * occ), capacity_blocks=1000))
            for k in range(len(ready))
        ] + [PodView(f"s{k}", False, t - 10) for k in range(starting)]  # fmt: skip
        d = decide(
            Inputs(
                now=t,
                current_replicas=len(ready_at),
                pods=tuple(pods),
                policy=POLICY,
                last_scale_up_at=last_up,
                last_scale_down_at=last_down,
                scale_in=window,
                recent=recent,
            )
        )
        window, recent = d.scale_in, d.recent
        if d.replicas > len(ready_at):
            ready_at += [t + loading_ticks * tick] * (d.replicas - len(ready_at))
            last_up = t
        elif d.replicas < len(ready_at):
            ready_at = sorted(ready_at)[: d.replicas]
            last_down = t
        history.append(len(ready_at))
        t += tick
    return history


def test_trap_never_scaling_down() -> None:
    # Load drops from 3,600 to 800 blocks: after the 300 s window the deployment shrinks to the
    # smallest size that stays under 60 %, and stays there.
    hist = simulate([3600.0] * 5 + [800.0] * 80, current=6)
    assert hist[4] == 6
    assert hist[5:25].count(6) == 20  # nothing before the window has passed
    assert hist[-1] == 2
    assert min(hist) == 2


def test_trap_scaling_up_during_model_load() -> None:
    # A step to 2,500 blocks on 2 pods; new pods take 8 ticks (2 min) to load. It asks once for
    # what the KV math needs and waits for the pods instead of adding more every tick.
    hist = simulate([1000.0] * 2 + [2500.0] * 20, current=2, loading_ticks=8)
    assert hist[2] == 4  # ceil(2500 / 700)
    assert set(hist[2:]) == {4}


def test_trap_flapping_at_threshold() -> None:
    # Occupancy wobbles +-2 % around the 85 % scale-out threshold: one scale-out, then quiet.
    hist = simulate([1700.0] * 60, current=2, noise=0.02)
    changes = sum(1 for a, b in itertools.pairwise(hist) if a != b)
    assert hist[-1] == 3
    assert changes <= 1


def test_trap_scaling_on_absent_metrics() -> None:
    # Sidecars stop answering during a spike: no direction is taken on absent data.
    for current in (1, 5, 10):
        d = run(current, [pod(f"p{i}", None) for i in range(current)])
        assert d.replicas == current and d.action == "hold"
        d = run(current, [pod(f"p{i}", 0.0, ago=600) for i in range(current)])
        assert d.replicas == current and d.action == "hold"


def test_trap_saturation_during_scale_to_max() -> None:
    # Demand far beyond max: it climbs to max, never past, and keeps reporting saturation.
    hist = simulate([30_000.0] * 10, current=2, loading_ticks=1)
    assert max(hist) == 10 and hist[-1] == 10
    d = run(10, [pod(f"p{i}", 1.0, preempt=2.0, waiting=50) for i in range(10)])
    assert d.replicas == 10 and d.saturated and d.limited == "AtMaxReplicas"


def test_scale_in_goes_to_highest_recommendation_in_window() -> None:
    # The window remembers the highest count recommended; a brief lull does not undercut it.
    pods = [pod(f"p{i}", 0.1) for i in range(6)]
    window = ScaleInWindow(since=NOW - 400, history=((NOW - 290, 4), (NOW - 100, 2)))
    d = run(6, pods, scale_in=window)
    assert d.replicas == 4 and d.action == "scale-in"


def test_scale_in_waits_for_window_after_any_change() -> None:
    pods = [pod(f"p{i}", 0.1) for i in range(6)]
    window = ScaleInWindow(since=NOW - 1000, history=((NOW - 1000, 1),))
    d = run(6, pods, scale_in=window, last_scale_up_at=NOW - 100)
    assert d.replicas == 6 and d.reason == "Stabilizing"
    d = run(6, pods, scale_in=window, last_scale_up_at=NOW - 301)
    assert d.replicas == 4  # two pods per step


def test_scale_in_blocked_while_pods_start() -> None:
    pods = [pod("a", 0.05), pod("b", 0.05), pod("c", None, ready=False)]
    d = run(3, pods, scale_in=ScaleInWindow(since=NOW - 1000, history=((NOW - 1000, 1),)))
    assert d.replicas == 3 and d.action == "hold"


def test_growth_is_projected_only_when_the_total_confirms_it() -> None:
    pods = [pod("a", 0.6, eta=40), pod("b", 0.6, eta=40)]  # the sidecars' 30 s slope: +20/s
    burst = run(2, pods)
    assert burst.replicas > 2  # with no history the sidecars' slope is taken at its word
    flat = tuple((NOW - dt, 1200.0) for dt in (75, 60, 45, 30, 15))
    held = run(2, pods, recent=flat)
    assert held.replicas == 2 and held.reason == "LoadImbalance"  # the total has not moved
    rising = tuple((NOW - dt, 1200.0 - 20 * dt) for dt in (75, 60, 45, 30, 15))
    confirmed = run(2, pods, recent=rising)
    assert confirmed.replicas == burst.replicas
    assert confirmed.recent[-1] == (NOW, 1200.0) and len(confirmed.recent) == 6


def test_new_pods_filling_from_the_backlog_are_not_growth() -> None:
    fresh = PodView("new", True, NOW - 200, sample=PodSample(
        occupancy=0.5, sampled_at=NOW - 1, eta_seconds=20, used_blocks=500,
        capacity_blocks=1000, growth_blocks_per_second=25.0), ready_since=NOW - 20)  # fmt: skip
    d = run(2, [pod("old", 0.5), fresh])
    assert d.action == "hold" and d.figures.min_eta_seconds is None
    settled = replace(fresh, ready_since=NOW - 200)
    assert run(2, [pod("old", 0.5), settled]).action == "scale-out"


def test_after_a_scale_in_the_survivors_filling_up_is_not_growth() -> None:
    pods = [pod("a", 0.6, eta=40), pod("b", 0.6, eta=40)]
    d = run(2, pods, last_scale_down_at=NOW - 30)
    assert d.action == "hold" and d.figures.min_eta_seconds is None
    assert run(2, pods, last_scale_down_at=NOW - 200).action == "scale-out"


def test_draining_pods_still_count_as_demand() -> None:
    ready = [pod("a", 0.3), pod("b", 0.3), pod("c", 0.3)]
    assert run(3, ready, scale_in=ScaleInWindow(NOW - 1000, ((NOW - 1000, 2),))).replicas == 2
    draining = [pod("x", 0.5, terminating=True), pod("y", 0.5, terminating=True)]
    d = run(3, ready + draining, scale_in=ScaleInWindow(NOW - 1000, ((NOW - 1000, 2),)))
    assert d.replicas == 3 and d.figures.present_blocks == 1900


# The one Policy field whose CRD name differs; every other field is named as in ScalingSpec.
_SPEC_NAME = {"lookahead_seconds": "saturation_lookahead_seconds"}
_FROM_THE_PLAN = {"blocks_per_pod", "blocks_per_sequence"}


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
        if f.name in _FROM_THE_PLAN:
            continue
        name = _SPEC_NAME.get(f.name, f.name)
        assert name in ScalingSpec.model_fields, f"Policy.{f.name} has no ScalingSpec field"
        assert getattr(policy, f.name) == getattr(defaults, name), f.name
        assert f.default is dataclasses.MISSING, f"Policy.{f.name} has a default of its own"
    assert policy.blocks_per_pod == sizing.plan.kv_blocks_per_pod
    assert policy.scale_in_hysteresis == ScalingSpec.model_fields["scale_in_hysteresis"].default
