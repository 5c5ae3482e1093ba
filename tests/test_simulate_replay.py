"""Replaying traffic through the simulated deployment, and `headroom simulate`'s sweep over it:
what a run costs, when the KV cache turns work away, and which setting is picked."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

import headroom.operator.scaling.decide as decide_module
from headroom.operator.crd.models import InferenceDeploymentSpec
from headroom.operator.reconcile.sizing import Sizing, parse
from headroom.operator.scaling.decide import Policy
from headroom.operator.simulate.replay import (
    DT,
    HeadroomPolicy,
    Result,
    demand_curve,
    in_flight,
    opening_replicas,
    policy_at,
    replay,
    shape_for,
)
from headroom.operator.simulate.sweep import Setting, cheapest_serving, realize, sweep
from headroom.operator.simulate.synthetic import synthetic
from headroom.operator.simulate.trace import Trace
from headroom.operator.simulate.world import PodShape, World


class Fixed:
    """A deployment nobody scales: always `n` pods."""

    def __init__(self, n: int) -> None:
        self.n = n

    def observe(self, world: World, now: float) -> None:
        pass

    def __call__(self, world: World, now: float) -> int:
        return self.n


class ThreeFrom30s(Fixed):
    """One pod, then three asked for at the decision at 30 s."""

    def __call__(self, world: World, now: float) -> int:
        return 1 if now < 30.0 else 3


def ending_at(end: float) -> Trace:
    """A light Poisson load over 100 s, and one more request at `end`."""
    head = poisson([(0.2, 100.0)])
    return Trace("end", np.append(head.arrival, end), np.append(head.prompt, 1000),
                 np.append(head.output, 100))  # fmt: skip


def deployment(
    gpu: str = "l4-24gb", max_model_len: int = 8192, hi: int = 16, pod_start: int = 60
) -> tuple[InferenceDeploymentSpec, Sizing]:
    parsed = parse(
        {
            "model": {"preset": "llama-3.1-8b"},
            "gpu": {"type": gpu},
            "engine": {"maxModelLen": max_model_len},
            "traffic": {"peakConcurrency": 64, "contextTokens": 2048},
            "scaling": {"minReplicas": 1, "maxReplicas": hi, "podStartSeconds": pod_start},
        }
    )
    assert parsed.spec is not None and parsed.sizing is not None, parsed.error
    return parsed.spec, parsed.sizing


def poisson(rates: list[tuple[float, float]], seed: int = 1, prompt: int = 1000) -> Trace:
    """Poisson arrivals at `rate` for `seconds`, one (rate, seconds) after the other; outputs of
    100-300 tokens (5-15 s of decode)."""
    rng = np.random.default_rng(seed)
    times, t0 = [], 0.0
    for rate, seconds in rates:
        n = rng.poisson(rate * seconds)
        times.append(t0 + np.sort(rng.uniform(0, seconds, n)))
        t0 += seconds
    t = np.concatenate(times)
    return Trace("poisson", t - t[0], np.full(len(t), prompt), rng.integers(100, 301, len(t)))


def test_a_light_load_on_fixed_pods_costs_their_gpu_time_and_is_never_kv_limited() -> None:
    spec, sizing = deployment("h100-80gb")
    trace = poisson([(2.0, 900.0)])
    r = replay(trace, shape_for(spec, sizing), Fixed(2), start_replicas=2)
    assert r.gpu_hours == pytest.approx(2 * trace.arrival[-1] / 3600, abs=2 * DT / 3600)
    assert r.limited_seconds == 0 and r.preemptions == 0 and r.rejected == 0
    assert r.peak_replicas == 2 and r.actions == 0


def test_one_small_pod_under_a_heavy_load_turns_work_away() -> None:
    spec, sizing = deployment("l4-24gb")
    shape = shape_for(spec, sizing)
    trace = poisson([(6.0, 900.0)])  # about 6 x 10 s x 1,100 tokens: 2.5 L4 pools
    r = replay(trace, shape, Fixed(1), start_replicas=1)
    assert r.queued_seconds > 600 and r.limited_seconds >= r.queued_seconds


def test_requests_longer_than_the_max_model_length_are_refused_at_the_door() -> None:
    spec, sizing = deployment("h100-80gb", max_model_len=2048)
    base = poisson([(1.0, 1200.0)])
    prompt = np.where(np.arange(len(base)) % 10 == 0, 3000, 1000)
    trace = Trace("long", base.arrival, prompt, base.output)
    late = int(((prompt == 3000) & (trace.arrival >= 600)).sum())
    r = replay(trace, shape_for(spec, sizing), Fixed(1), start_replicas=1)
    # The warm-up replays the first 600 s before the clock starts and grades none of its
    # refusals; at least every long request after it is counted.
    assert r.rejected >= late > 0
    # Graded, every one is counted: in the first step and on the last step's boundary too.
    at = np.array([0.0, 1.0, 5.0, 10.0])
    edges = Trace("edges", at, np.full(4, 3000), np.full(4, 10))
    assert replay(edges, shape_for(spec, sizing), Fixed(1), 1, warmup=0.0).rejected == 4


def test_scaling_in_cancels_the_newest_starting_pod_first_and_it_costs_only_its_seconds() -> None:
    spec, sizing = deployment("h100-80gb", pod_start=120)
    world = World.start(shape_for(spec, sizing), 1, 0.0)
    world.scale_to(2, 0.0)
    world.scale_to(3, 60.0)
    world.scale_to(2, 75.0)  # as a ReplicaSet does: the pod furthest from serving goes
    assert [(p.name, p.draining) for p in world.pods] == [
        ("pod-0", False), ("pod-2", False), ("pod-3", True)
    ]  # fmt: skip
    world.account(False, DT)
    world.step(77.5, DT)  # a pod that never served holds nothing: it is gone at once
    world.account(False, DT)
    assert [p.name for p in world.pods] == ["pod-0", "pod-2"] and world.replicas() == 2
    assert world.counters.gpu_seconds == (3 + 2) * DT
    assert (world.counters.started, world.counters.cancelled) == (2, 1)
    world.scale_to(1, 200.0)  # a pod that has served drains: not a cancelled start
    assert (world.counters.started, world.counters.cancelled) == (2, 1)


def test_headroom_scales_out_through_a_fourfold_step_and_back_in_after_it() -> None:
    spec, sizing = deployment("l4-24gb")
    shape = shape_for(spec, sizing)
    trace = poisson([(1.0, 900.0), (4.0, 900.0), (1.0, 1800.0)])
    start = opening_replicas(trace, shape)
    sizes: list[int] = []
    r = replay(
        trace,
        shape,
        HeadroomPolicy(policy_at(spec, 0.9, sizing)),
        start,
        on_tick=lambda now, world: sizes.append(world.replicas()),
    )
    assert r.peak_replicas > start and max(sizes) > start
    assert sizes[-1] < max(sizes)  # the quiet half hour after the step gives pods back
    assert r.actions >= 2


def result(limited: float, gpu_hours: float) -> Result:
    return Result(limited, 0.0, limited, 0, gpu_hours, 1, 2, 0, 2, 0)


def setting(q: float, limited: list[float], gpu_hours: float) -> Setting:
    spec, sizing = deployment()
    n = len(limited)
    return Setting(
        q,
        policy_at(spec, q, sizing),
        tuple(range(1, n + 1)),
        tuple(result(s, gpu_hours) for s in limited),
        (0,) * n,
    )


def test_a_setting_serves_at_30_median_and_120_worst_seconds_and_not_past_them() -> None:
    assert setting(0.8, [0, 30, 120], 1.0).serves
    assert not setting(0.8, [0, 31, 31], 1.0).serves
    assert not setting(0.8, [0, 0, 121], 1.0).serves


def test_the_pick_is_the_cheapest_setting_that_serves_or_none() -> None:
    cheap_miss = setting(0.6, [40, 50, 60], 1.0)
    dear = setting(0.95, [0, 0, 0], 3.0)
    mid = setting(0.8, [10, 20, 100], 2.0)
    assert cheapest_serving([cheap_miss, mid, dear]) is mid
    assert cheapest_serving([cheap_miss]) is None


def test_the_sweep_replays_every_quantile_on_the_same_seeded_realizations() -> None:
    spec, sizing = deployment("l4-24gb", max_model_len=2048)
    base = poisson([(1.0, 300.0), (3.0, 300.0)], prompt=1000)
    long = np.where(np.arange(len(base)) % 50 == 0, 2500, 1000)
    trace = Trace("short", base.arrival, long, base.output)
    runs = realize(trace, shape_for(spec, sizing), (1, 2), rate=1.0)
    settings = sweep(runs, spec, sizing, (0.6, 0.95))
    assert [s.quantile for s in settings] == [0.6, 0.95]
    assert all(s.seeds == (1, 2) and len(s.results) == 2 for s in settings)
    assert [s.policy.forecast_quantile for s in settings] == [0.6, 0.95]
    # Every seed is one realization of the same requests: the same ones are refused.
    assert settings[0].refused == settings[1].refused == ((long == 2500).sum(),) * 2


def test_a_flash_crowd_buys_no_pods_for_the_backlog_its_own_scale_out_leaves() -> None:
    # 6x within a minute: requests wait at the door while pods start, and each new pod has no
    # demand counters for its first decision. Holding the last measured demand over those
    # gaps (instead of the KV in use, which carries that backlog) serves exactly as well for
    # fewer GPU-hours; the same replay with the hold off is the reference. (Since pods still
    # starting are cancelled once not needed, the backlog's extra pods cost less: 3.6 % more
    # GPU-hours and 3 more pods at the peak on seed 1, down from over 5 %.)
    spec, sizing = deployment("h100-80gb", pod_start=120)
    shape = shape_for(spec, sizing)
    trace = synthetic("flash-crowd", 1)
    start = opening_replicas(trace, shape)

    def run() -> Result:
        return replay(trace, shape, HeadroomPolicy(policy_at(spec, 0.8, sizing)), start)

    held = run()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decide_module, "DEMAND_GAP_HOLD_SECONDS", -1.0)
        switched = run()
    assert held.limited_seconds <= switched.limited_seconds
    assert held.gpu_hours < 0.98 * switched.gpu_hours
    assert held.peak_replicas < switched.peak_replicas


def _defaults_against(kind: str, **changes: Any) -> tuple[Policy, Result, Result]:
    """Seed 1 of a synthetic trace on one H100 pod per replica (120 s start) at q 0.95: the
    spec's default policy, its replay, and the replay of the same policy with `changes`."""
    spec, sizing = deployment("h100-80gb", pod_start=120)
    shape = shape_for(spec, sizing)
    trace = synthetic(kind, 1)
    start = opening_replicas(trace, shape)
    policy = policy_at(spec, 0.95, sizing)
    new = replay(trace, shape, HeadroomPolicy(policy), start)
    old = replay(trace, shape, HeadroomPolicy(replace(policy, **changes)), start)
    return policy, new, old


def test_a_launch_spike_releases_its_pods_after_one_horizon_not_hpas_300_s() -> None:
    # The defaults scale in once fewer pods have been enough for one provisioning horizon, with
    # a 0.10 level margin; HPA's 300 s with a 0.05 margin is the reference. On the 4x launch
    # the surge's pods go sooner, for no more KV-limited seconds (0.9 % fewer GPU-hours on
    # seed 1, 1.3 % with the 0.15 margin, since pods still starting are cancelled once not
    # needed, in both).
    policy, new, old = _defaults_against(
        "spike", scale_in_hysteresis=0.05, scale_down_stabilization_seconds=300.0
    )
    assert policy.scale_down_stabilization_seconds is None
    assert new.limited_seconds <= old.limited_seconds
    assert new.gpu_hours < 0.995 * old.gpu_hours


@pytest.mark.parametrize("kind", ["diurnal", "flash-crowd"])
def test_the_default_scale_in_margin_buys_no_pods_the_band_already_holds(kind: str) -> None:
    # At the default forecastQuantile the band holds the demand's noise; the 0.15 margin of
    # earlier releases kept pods on top of it (the bench: up to 5 % more GPU-hours for a worst
    # seed at most 3 s better). Seed 1 of each: the same KV-limited seconds, about 3 % fewer
    # GPU-hours.
    policy, new, old = _defaults_against(kind, scale_in_hysteresis=0.15)
    assert policy.scale_in_hysteresis == 0.10  # the CRD's default
    assert new.limited_seconds <= old.limited_seconds
    assert new.gpu_hours < 0.985 * old.gpu_hours


def test_the_replay_decides_every_interval_the_spec_sets() -> None:
    spec, sizing = deployment("h100-80gb")
    shape = shape_for(spec, sizing)
    trace = poisson([(1.0, 300.0)])
    ticks: list[float] = []

    class Counting(Fixed):
        def __call__(self, world: World, now: float) -> int:
            ticks.append(now)
            return self.n

    replay(trace, shape, Counting(1), 1, interval=60.0)
    assert set(np.diff(ticks)) == {60.0}
    ticks.clear()
    replay(trace, shape, Counting(1), 1)  # the bench's 15 s
    assert set(np.diff(ticks)) == {15.0}
    ticks.clear()
    replay(trace, shape, Counting(1), 1, interval=1.0)  # under a step: every step
    assert set(np.diff(ticks)) == {DT}


def test_a_replay_opens_within_the_specs_replica_bounds() -> None:
    spec, sizing = deployment("h100-80gb")
    shape = shape_for(spec, sizing)
    trace = poisson([(0.2, 300.0)])
    assert opening_replicas(trace, shape) == 1
    (run,) = realize(trace, shape, (1,), rate=1.0, bounds=(2, 5))
    assert run.start == 2
    (free,) = realize(trace, shape, (1,), rate=1.0)
    assert free.start == 1


def _drain(world: World, dt: float, steps: int = 2000) -> int:
    """Steps until every sequence has finished."""
    for k in range(steps):
        world.step(k * dt, dt)
        if not len(world.seqs) and not world.pending and not world.queue:
            return k
    raise AssertionError("never drained")


def _engine_steps(prompts: tuple[int, ...], output: int, blocks: int) -> tuple[int, int]:
    """(last step, preemptions) of the engine's own scheduler on the same sequences, one token
    a step and no watermark."""
    from headroom.engine.config import EngineConfig
    from headroom.engine.scheduler import Scheduler
    from headroom.engine.sequence import Sequence

    cfg = EngineConfig(block_size=16, max_num_seqs=8, enable_prefix_caching=False, watermark=0.0)
    sched = Scheduler(cfg.sized(blocks, 10_000))
    for i, p in enumerate(prompts):
        sched.add(Sequence(f"r{i}", [1000 * i + j for j in range(p)], output))
    for step in range(5000):
        out = sched.schedule()
        if out.is_empty:
            return step - 1, sched.preemptions_total
        sched.update(out, {e.seq.seq_id: 7 for e in out.scheduled if e.sample})
    raise AssertionError("the engine never drained")


def test_a_preempted_sequence_keeps_its_output_and_waits_a_step_as_in_the_engine() -> None:
    # Three sequences outgrow a 30-block pool: the newest is preempted once, keeps the 142
    # tokens it generated (recomputed on readmission) and finishes when the engine's does.
    # Re-queued with its prompt alone, it regenerated everything and was preempted twice.
    shape = PodShape(capacity_blocks=30, block_size=16, max_num_seqs=8, watermark_blocks=0,
                     max_model_len=10_000, decode_tps=1.0, prefill_tps=1e9,
                     pod_start=0)  # fmt: skip
    world = World.start(shape, 1, 0.0)
    for p in (16, 17, 18):
        world.arrive(p, 200, 0.0)
    last = _drain(world, 1.0)
    engine_last, engine_preemptions = _engine_steps((16, 17, 18), 200, 30)
    assert world.counters.preemptions == engine_preemptions == 1
    assert abs(last - engine_last) <= 2, (last, engine_last)


def test_the_door_queue_goes_to_a_pod_that_takes_it_and_is_reported_whole() -> None:
    # Two pods with a batch cap of 2: one holds a long sequence and has a free slot, the other
    # is full. A short request goes to the free slot rather than waiting behind the full pod.
    shape = PodShape(capacity_blocks=100, block_size=16, max_num_seqs=2, watermark_blocks=5,
                     max_model_len=100_000, decode_tps=20.0, prefill_tps=1e9,
                     pod_start=0)  # fmt: skip
    world = World.start(shape, 2, 0.0)
    for prompt in (800, 16, 16):
        world.arrive(prompt, 2000, 0.0)
    world.step(0.0, 2.5)
    world.arrive(16, 100, 2.5)
    world.step(2.5, 2.5)
    assert not world.queue and sorted(p.seqs for p in world.pods) == [2, 2]
    # Three requests waiting over two ready pods: both report, and the three are all counted.
    for _ in range(3):
        world.arrive(16, 100, 5.0)
    world.step(5.0, 2.5)
    assert sum(p.waiting for p in world.pods) == len(world.queue) == 3


def test_a_request_holds_its_prompt_through_prefill_then_grows_in_the_oracles_curve() -> None:
    # 400 prompt tokens prefill for 4 s (one whole step), 100 output tokens decode for 5 s (two
    # steps, 50 tokens each): arriving in step 2, it is held three steps. One at 0 s decodes
    # at once; one of exactly the max model length is held, one token more is refused.
    shape = PodShape(capacity_blocks=100, block_size=16, max_num_seqs=8, watermark_blocks=0,
                     max_model_len=1000, decode_tps=20.0, prefill_tps=100.0)  # fmt: skip
    trace = Trace(
        "four",
        np.array([0.0, 6.0, 7.0, 12.6]),
        np.array([1, 400, 900, 984]) * np.array([160, 1, 1, 1]),
        np.array([100, 100, 101, 16]),
    )
    blocks, seqs = in_flight(trace, shape, 7)
    assert blocks.tolist() == [10, 14, 25, 25, 29, 62, 62]
    assert seqs.tolist() == [1, 1, 1, 1, 1, 1, 1]
    # From t0 = 2.5 every step is one earlier, the first request's first step before it.
    assert demand_curve(trace, shape, 3, t0=DT).tolist() == [14, 25, 25]


def test_the_opening_pods_hold_the_warmups_second_half_at_the_start_target() -> None:
    # Every step of the warm-up holds `n` requests of 10 blocks each for exactly that step
    # (instant decode): the mean held is 10 * n blocks, over pools of 100 at 0.7.
    shape = PodShape(capacity_blocks=100, block_size=16, max_num_seqs=64, watermark_blocks=0,
                     max_model_len=1000, decode_tps=1e9, prefill_tps=1e9)  # fmt: skip

    def steady(first: int, second: int) -> Trace:
        per_step = [first] * 120 + [second] * 120 + [1] * 10
        t = np.repeat(np.arange(len(per_step)) * DT, per_step)
        return Trace("steady", t, np.full(len(t), 160), np.full(len(t), 1))

    assert opening_replicas(steady(7, 7), shape) == 1  # 70 blocks: exactly 0.7 of one pool
    assert opening_replicas(steady(8, 8), shape) == 2
    assert opening_replicas(steady(30, 7), shape) == 1  # the first half is not counted
    assert opening_replicas(steady(0, 0), shape) == 1


def test_a_replay_charges_each_gpu_for_every_graded_step_and_nothing_for_the_warmup() -> None:
    spec, sizing = deployment("h100-80gb")
    shape = replace(shape_for(spec, sizing), gpus=2)
    trace = poisson([(0.5, 300.0)])
    trace = Trace("end", np.append(trace.arrival, 301.0), np.append(trace.prompt, 1000),
                  np.append(trace.output, 100))  # fmt: skip
    r = replay(trace, shape, Fixed(3), start_replicas=3)
    # 301 s ends in the step from 300 s: 121 steps of 2.5 s, 3 pods of 2 GPUs.
    assert r.gpu_hours == pytest.approx(3 * 2 * 121 * DT / 3600)
    assert r.limited_seconds == 0 and r.pod_starts == 0 and r.cancelled_starts == 0


def test_the_warmup_observes_every_tick_before_zero_and_the_clock_decides_from_zero() -> None:
    spec, sizing = deployment("h100-80gb")
    calls: list[tuple[str, float, bool]] = []

    class Watching(Fixed):
        def observe(self, world: World, now: float) -> None:
            calls.append(("observe", now, world.counting))

        def __call__(self, world: World, now: float) -> int:
            calls.append(("decide", now, world.counting))
            return self.n

    replay(poisson([(1.0, 120.0)]), shape_for(spec, sizing), Watching(1), 1, warmup=60.0)
    observed = [(t, counting) for kind, t, counting in calls if kind == "observe"]
    decided = [t for kind, t, _ in calls if kind == "decide"]
    assert observed == [(-60.0, False), (-45.0, False), (-30.0, False), (-15.0, False)]
    assert decided[0] == 0.0 and all(c for kind, _, c in calls if kind == "decide")


def test_a_scale_out_is_paid_from_the_step_it_is_asked_in_and_counted_once() -> None:
    """A pod is paid from the moment it is asked for, as the clairvoyant floor prices it; the
    last arrival, on a step's boundary, is replayed (its step graded)."""
    spec, sizing = deployment("h100-80gb", pod_start=60)
    r = replay(ending_at(100.0), shape_for(spec, sizing), ThreeFrom30s(1), 1, warmup=0.0)
    # Steps 0..40 graded (the last arrival is at 100 s); asked for at 30 s, step 12: two more
    # pods paid from that step to the end.
    assert r.gpu_hours == pytest.approx((41 + 2 * (41 - 12)) * DT / 3600)
    assert (r.pod_starts, r.cancelled_starts, r.peak_replicas, r.actions) == (2, 0, 3, 1)


def test_a_policy_at_a_service_level_clamps_the_quantile_and_sets_its_lines_from_the_target() -> (
    None
):
    spec, sizing = deployment("h100-80gb")
    low, mid, high = (policy_at(spec, q, sizing) for q in (0.1, 0.8, 1.0))
    assert (low.forecast_quantile, mid.forecast_quantile, high.forecast_quantile) == (
        0.5, 0.8, 0.999
    )  # fmt: skip
    # The engine's pools fill to 0.95 (its watermark): the target is that, never above it.
    assert (mid.target_occupancy, mid.scale_out_occupancy) == (0.95, pytest.approx(0.975))
    parsed = parse(
        {
            "model": {"preset": "llama-3.1-8b", "path": "meta-llama/Llama-3.1-8B"},
            "gpu": {"type": "h100-80gb"},
            "engine": {"runtime": "vllm"},
            "traffic": {"peakConcurrency": 64, "contextTokens": 2048},
        }
    )
    assert parsed.spec is not None and parsed.sizing is not None, parsed.error
    vllm = policy_at(parsed.spec, 0.8, parsed.sizing)
    assert vllm.usable_occupancy == 1.0 and vllm.target_occupancy == 0.95


def test_the_simulated_pod_is_the_planned_pool_with_the_engines_watermark_and_the_specs_start() -> (
    None
):
    spec, sizing = deployment("h100-80gb", pod_start=90)
    shape = shape_for(spec, sizing)
    cap = sizing.plan.kv_blocks_per_pod
    assert (shape.capacity_blocks, shape.block_size) == (cap, sizing.plan.block_size)
    assert shape.watermark_blocks == int(0.05 * cap) > 0
    assert (shape.gpus, shape.pod_start) == (sizing.plan.gpus_per_pod, 90.0)
    assert shape.max_num_seqs == spec.engine.max_num_seqs
    assert shape.max_model_len == sizing.max_model_len
    assert shape_for(spec) == shape  # sized from the spec when no sizing is given


def test_an_empty_trace_replays_only_the_warmup_and_grades_nothing() -> None:
    spec, sizing = deployment("h100-80gb")
    empty = Trace("empty", np.zeros(0), np.zeros(0, dtype=int), np.zeros(0, dtype=int))
    r = replay(empty, shape_for(spec, sizing), Fixed(2), 2)
    assert (r.gpu_hours, r.limited_seconds, r.actions, r.peak_replicas) == (0.0, 0.0, 0, 2)


def test_each_request_arrives_in_the_step_its_time_falls_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec, sizing = deployment("h100-80gb")
    seen: list[float] = []
    arrive = World.arrive

    def spy(world: World, prompt: int, output: int, now: float) -> None:
        seen.append(now)
        arrive(world, prompt, output, now)

    monkeypatch.setattr(World, "arrive", spy)
    t = np.array([0.0, 2.5, 3.0, 6.0])
    trace = Trace("steps", t, np.full(4, 100), np.full(4, 10))
    replay(trace, shape_for(spec, sizing), Fixed(1), 1, warmup=5.0)
    # The warm-up replays the opening 5 s at -5 s first; a time on a boundary opens its step.
    assert seen == [-5.0, -2.5, -2.5, 0.0, 2.5, 2.5, 5.0]
