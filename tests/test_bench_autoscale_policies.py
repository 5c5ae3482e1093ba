"""The baselines the autoscaling bench grades headroom against: Kubernetes' HPA v2 (its replica
formula, tolerance, scale-up limit and scale-down stabilization) and the clairvoyant oracle."""

from __future__ import annotations

import numpy as np

from bench.autoscale.policies import HPA, Oracle, cpu_metric, kv_metric
from headroom.operator.simulate.world import PodShape, World

SHAPE = PodShape(
    capacity_blocks=100, block_size=16, max_num_seqs=170, watermark_blocks=1, max_model_len=4096
)


def _world(blocks: list[int], starting: int = 0, now: float = 0.0) -> World:
    """Ready pods holding `blocks` KV blocks each, plus `starting` pods asked for at `now`."""
    w = World.start(SHAPE, len(blocks), now)
    for p, b in zip(w.pods, blocks, strict=True):
        p.blocks = b
    if starting:
        w.scale_to(len(blocks) + starting, now)
    return w


def _kv_hpa(lo: int = 1, hi: int = 100) -> HPA:
    return HPA(kv_metric, 0.5, lo, hi)


def test_the_metrics_are_kv_occupancy_and_a_cpu_that_runs_from_idle_to_full_at_170_seqs() -> None:
    w = _world([25])
    assert kv_metric(w, w.pods[0]) == 0.25
    p = w.pods[0]
    assert cpu_metric(w, p) == 0.15  # an idle engine still spends host CPU
    p.seqs = 170
    assert abs(cpu_metric(w, p) - 1.0) < 1e-12
    p.seqs = 85
    assert abs(cpu_metric(w, p) - 0.575) < 1e-12


def test_hpa_asks_for_the_ceiling_of_total_usage_over_the_target() -> None:
    # 3 pods at 70 % against 50 %: 2.1 / 0.5 = 4.2 pods, rounded up (Kubernetes' ceil).
    assert _kv_hpa()(_world([70, 70, 70]), 0.0) == 5
    # 20 pods at 44 %: 8.8 / 0.5 = 17.6 -> 18 (a fresh HPA has no window to hold it up).
    assert _kv_hpa()(_world([44] * 20), 0.0) == 18


def test_hpa_does_nothing_within_its_10_percent_tolerance() -> None:
    assert _kv_hpa()(_world([54, 54]), 0.0) == 2  # ratio 1.08: no scale-up
    assert _kv_hpa()(_world([56, 56]), 0.0) == 3  # ratio 1.12: ceil(2.24)
    assert _kv_hpa()(_world([46] * 20), 0.0) == 20  # ratio 0.92: no scale-down
    assert _kv_hpa()(_world([44] * 20), 0.0) == 18  # ratio 0.88


def test_hpa_scale_up_is_limited_to_4_pods_or_100_percent_per_step() -> None:
    assert _kv_hpa()(_world([500]), 0.0) == 5  # wants 10: 1 + max(4, 1)
    assert _kv_hpa()(_world([500] * 10), 0.0) == 20  # wants 100: 10 + max(4, 10)


def test_hpa_counts_starting_pods_at_zero_on_scale_up_and_never_scales_down_for_them() -> None:
    # 2 ready pods want 3 (1.5 / 0.5) while 2 more start: the 4 asked for stay.
    assert _kv_hpa()(_world([75, 75], starting=2), 0.0) == 4
    # 2 ready pods want 6 (3.0 / 0.5): the starting ones do not count as capacity.
    assert _kv_hpa()(_world([150, 150], starting=2), 0.0) == 6
    # No ready pod: nothing to measure, so the replicas stay.
    assert _kv_hpa()(_world([], starting=3), 0.0) == 3


def test_hpa_scale_down_holds_the_highest_recommendation_of_the_last_300_s() -> None:
    hpa, w = _kv_hpa(), _world([50] * 4)
    hpa.observe(w, 0.0)  # recommends 4 during the warm-up
    for p in w.pods:
        p.blocks = 10  # now 4 pods want 1 (0.4 / 0.5)
    assert hpa(w, 285.0) == 4  # the warm-up's 4 is in the window
    assert hpa(w, 300.5) == 1  # more than 300 s old: it has left


def test_hpa_scale_down_goes_to_the_window_s_highest_not_to_the_current_count() -> None:
    hpa, w = _kv_hpa(), _world([75, 75, 0, 0])
    assert hpa(w, 0.0) == 3  # 1.5 / 0.5
    for p in w.pods:
        p.blocks = 10
    assert hpa(w, 15.0) == 3  # wants 1, holds the window's 3, not 4 nor 1


def test_hpa_stays_between_min_and_max_replicas() -> None:
    assert _kv_hpa(lo=2)(_world([0] * 4), 0.0) == 2
    assert _kv_hpa(hi=3)(_world([90, 90]), 0.0) == 3


def test_oracle_asks_for_the_peak_pod_start_plus_one_tick_ahead() -> None:
    # DT 2.5 s, so pod_start 120 s + TICK 15 s is 54 steps ahead: the spike at step 100
    # (260 blocks, 5.2 pods at 50 % of 100) is seen from step 46 to step 100, and no longer.
    demand = np.zeros(200)
    demand[100] = 260.0
    oracle = Oracle(demand, 0.5, 100, 120.0, 1, 100)
    w = _world([0])
    assert oracle(w, 45 * 2.5) == 1
    assert oracle(w, 46 * 2.5) == 6
    assert oracle(w, 100 * 2.5) == 6
    assert oracle(w, 101 * 2.5) == 1
    assert oracle(w, 200 * 2.5) == 1  # at and past the trace's end: nothing to hold
    assert oracle(w, 250 * 2.5) == 1
    # A pod of one block at 50 %: the end's 0 demand must not round up to a pod of its own.
    assert Oracle(np.zeros(4), 0.5, 1, 120.0, 1, 100)(w, 4 * 2.5) == 1
    assert Oracle(demand, 0.5, 100, 120.0, 1, 4)(w, 100 * 2.5) == 4
    assert Oracle(demand, 0.5, 100, 120.0, 2, 100)(w, 0.0) == 2


def test_hpa_keeps_the_count_when_starting_pods_at_zero_bring_the_ratio_within_tolerance() -> None:
    """Kubernetes' calcPlainMetricReplicas checks the tolerance again with starting pods at 0:
    two pods at 105 % of capacity against 50 % and two starting is a ratio of 1.05 over four,
    so the count stays; with one starting, 1.4 over three asks for ceil(4.2) = 5."""
    assert _kv_hpa()(_world([105, 105], starting=2), 0.0) == 4
    assert _kv_hpa()(_world([105, 105], starting=1), 0.0) == 5


def test_a_recommendation_exactly_300_s_old_has_left_the_scale_down_window() -> None:
    """stabilizeRecommendationWithBehaviors keeps what is newer than now - 300 s: four pods
    recommended at 0 s no longer hold them up at 300 s."""
    w, hpa = _world([50] * 4), _kv_hpa()
    assert hpa(w, 0.0) == 4
    for p in w.pods:
        p.blocks = 10
    held = [hpa(w, float(t)) for t in range(15, 301, 15)]
    assert held[-2] == 4 and held[-1] == 1  # 285 s still held, 300 s not
