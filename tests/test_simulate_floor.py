"""The clairvoyant floor: exact on small schedules, and below what real policies pay."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headroom.operator.simulate.floor import clairvoyant_floor, floor_pod_seconds, pods_needed
from headroom.operator.simulate.replay import (
    DT,
    HeadroomPolicy,
    opening_replicas,
    policy_at,
    replay,
    shape_for,
)
from headroom.operator.simulate.trace import Trace
from headroom.operator.simulate.world import PodShape
from tests.test_simulate_replay import Fixed, ThreeFrom30s, deployment, ending_at, poisson


def brute_force(
    need: list[int], start: int, lo: int, hi: int, start_steps: int, allowed: int
) -> float:
    """Every schedule of ready pods, priced as the floor prices one."""
    best = math.inf
    for pods in itertools.product(range(lo, hi + 1), repeat=len(need)):
        if sum(p < k for p, k in zip(pods, need, strict=True)) > allowed:
            continue
        added = sum(max(0, b - a) for a, b in zip((start, *pods), pods, strict=False))
        best = min(best, sum(pods) * DT + added * start_steps * DT)
    return best


@settings(max_examples=150, deadline=None)
@given(
    need=st.lists(st.integers(0, 3), min_size=1, max_size=6),
    start=st.integers(0, 3),
    lo=st.integers(0, 1),
    start_steps=st.integers(0, 3),
    allowed=st.integers(0, 2),
)
def test_the_program_finds_the_cheapest_schedule_of_every_one(
    need: list[int], start: int, lo: int, start_steps: int, allowed: int
) -> None:
    got = floor_pod_seconds(np.array(need), start, lo, 3, start_steps, allowed)
    assert got == pytest.approx(brute_force(need, start, lo, 3, start_steps, allowed))


def test_a_surge_shorter_than_the_seconds_allowed_is_left_short_and_a_longer_one_is_paid() -> None:
    need = np.array([1] * 20 + [2] * 3 + [1] * 20)
    assert floor_pod_seconds(need, 1, 1, 4, 48, 3) == pytest.approx(43 * DT)
    # Two allowed: a second pod, asked for 48 steps early, serves the surge's last step.
    assert floor_pod_seconds(need, 1, 1, 4, 48, 2) == pytest.approx((43 + 48 + 1) * DT)


def test_more_than_max_replicas_can_hold_has_no_floor_unless_allowed() -> None:
    need = np.array([1, 5, 5, 1])
    assert floor_pod_seconds(need, 1, 1, 4, 0, 1) == math.inf
    assert floor_pod_seconds(need, 1, 1, 4, 0, 2) == pytest.approx(4 * DT)


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="bad bounds"):
        floor_pod_seconds(np.array([1]), 1, 3, 2, 0, 0)


def test_pods_needed_counts_blocks_at_full_pools_and_sequences_at_the_batch_cap() -> None:
    spec, sizing = deployment("h100-80gb")
    shape = shape_for(spec, sizing)
    # 300 one-token requests at once: a sliver of KV, but more sequences than one batch holds.
    crowd = Trace("crowd", np.zeros(300), np.full(300, 16), np.full(300, 200))
    assert pods_needed(crowd, shape, 4).tolist() == [2, 2, 2, 2]
    # Fewer sequences than one batch, but prompts of 250 blocks each: just over one pool.
    n = shape.capacity_blocks // 250 + 1
    big = Trace("big", np.zeros(n), np.full(n, 250 * 16), np.full(n, 100))
    assert n < shape.max_num_seqs and pods_needed(big, shape, 2).tolist() == [2, 2]


@pytest.mark.parametrize("quantile", [0.5, 0.95])
def test_no_policy_replayed_costs_less_than_the_floor_for_the_seconds_it_lost(
    quantile: float,
) -> None:
    spec, sizing = deployment("l4-24gb")
    shape = shape_for(spec, sizing)
    trace = poisson([(1.0, 900.0), (4.0, 900.0), (1.0, 1800.0)])
    start = opening_replicas(trace, shape)
    lo, hi = spec.scaling.min_replicas, spec.scaling.max_replicas
    for policy in (HeadroomPolicy(policy_at(spec, quantile, sizing)), Fixed(4)):
        r = replay(trace, shape, policy, start)
        floor = clairvoyant_floor(trace, shape, start, lo, hi, r.limited_seconds)
        assert 0 < floor <= r.gpu_hours
    # With nothing allowed short, the floor still pays for the step's extra pods.
    assert clairvoyant_floor(trace, shape, start, lo, hi, 0.0) > 1.0 * trace.arrival[-1] / 3600


def test_the_floor_is_priced_per_gpu_in_hours_with_the_pod_start_paid_in_whole_steps() -> None:
    # One pool's worth held on each of 20 steps, two pools' on step 10 (each request holds its
    # 10 blocks for the one step it arrives in). A second pod for that step costs its step and
    # the 10 steps of its 25 s start; one step allowed short, it is not bought.
    shape = PodShape(capacity_blocks=10, block_size=16, max_num_seqs=64, watermark_blocks=0,
                     max_model_len=1000, gpus=2, decode_tps=1e9, prefill_tps=1e9,
                     pod_start=25.0)  # fmt: skip
    t = np.sort(np.append(np.arange(20) * DT + 0.5, 10 * DT + 1.0))
    trace = Trace("step", t, np.full(len(t), 160), np.full(len(t), 1))
    assert pods_needed(trace, shape, 20).tolist() == [1] * 10 + [2] + [1] * 9
    hours = 2 / 3600  # pod-seconds to GPU-hours
    assert clairvoyant_floor(trace, shape, 1, 1, 4, 0.0) == pytest.approx(
        (20 + 1 + 10) * DT * hours
    )
    assert clairvoyant_floor(trace, shape, 1, 1, 4, DT) == pytest.approx(20 * DT * hours)
    assert clairvoyant_floor(trace, shape, 1, 1, 4, DT - 0.1) == clairvoyant_floor(
        trace, shape, 1, 1, 4, 0.0
    )
    # Starting from three ready pods, the floor gives two back at once, for nothing.
    assert clairvoyant_floor(trace, shape, 3, 1, 4, DT) == pytest.approx(20 * DT * hours)


def test_a_schedule_a_replay_runs_is_paid_as_the_floor_prices_it() -> None:
    """A replay pays a pod from the step it is asked for, as the floor does: the same schedule
    costs the same pod-seconds in both, so no policy can come in under the floor by a step per
    pod it starts."""
    spec, sizing = deployment("h100-80gb", pod_start=60)
    shape = shape_for(spec, sizing)
    r = replay(ending_at(150.0), shape, ThreeFrom30s(1), 1, warmup=0.0)
    steps = round(150.0 / DT) + 1  # through the step of the last arrival
    ready = round((30.0 + 60.0) / DT)  # asked for at 30 s, serving 60 s later
    need = np.array([1] * ready + [3] * (steps - ready))
    start_steps = round(shape.pod_start / DT)
    assert r.gpu_hours * 3600 == pytest.approx(floor_pod_seconds(need, 1, 1, 3, start_steps, 0))
