"""The diurnal onset bench's two measures, on hand-built series, and its replays at a standing
reserve."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from bench.autoscale.run import run_policies
from bench.autoscale.traces import from_file, spec
from bench.diurnal_onset import excess_z, shortfall_seconds
from headroom.operator.simulate.replay import DT, graded_steps
from headroom.operator.simulate.synthetic import STEP


def test_shortfall_counts_only_steps_over_the_pools_before_the_pods_are_ready() -> None:
    demand = np.array([5, 5, 12, 15, 20, 25, 30, 8], dtype=float)  # blocks per DT step
    onset = 1 * DT
    # Steps 1..4 are before the pods are ready; of them 2, 3 and 4 exceed 10 blocks.
    assert shortfall_seconds(demand, 10.0, onset, 5 * DT) == 3 * DT
    # Ready at the onset: nothing short. Ready before the onset is not a negative span.
    assert shortfall_seconds(demand, 10.0, onset, onset) == 0.0
    assert shortfall_seconds(demand, 10.0, onset, 0.0) == 0.0
    # Pools large enough for the peak: nothing short however late the pods come.
    assert shortfall_seconds(demand, 30.0, onset, 8 * DT) == 0.0


def test_excess_z_of_a_linear_ramp() -> None:
    # 1 req/s until t = 10 s, then +0.1 req/s every second.
    t = np.arange(0, 100, STEP)
    rates = 1.0 + 0.1 * np.clip(t - 10, 0, None)
    excess, z = excess_z(rates, 10.0, 40.0, burst=0.0)
    # Left Riemann sum of 0.1 * s over [0, 40) in steps of STEP.
    assert excess == pytest.approx(sum(0.1 * s * STEP for s in np.arange(0, 40, STEP)))
    assert z == pytest.approx(excess / math.sqrt(40.0))
    # Burstiness widens the night's spread, so the same excess is less evidence.
    _, z_bursty = excess_z(rates, 10.0, 40.0, burst=0.1)
    assert z_bursty == pytest.approx(excess / math.sqrt(40.0 + 4.0**2))
    assert excess_z(rates, 10.0, 0.0, burst=0.1) == (0.0, 0.0)


def test_a_policy_replayed_with_a_reserve_opens_with_it_and_keeps_it(tmp_path: Path) -> None:
    """At minReplicas 3 a light trace needs 1 pod, yet every policy opens with 3 and holds them:
    none is asked for, and the GPU-hours are 3 pods' for the whole trace."""
    rng = np.random.default_rng(1)
    arrivals = np.sort(rng.uniform(0, 300, 60))
    rows = "".join(f"{a:.3f},1000,200\n" for a in arrivals)
    csv = tmp_path / "light.csv"
    csv.write_text("arrival_s,prompt_tokens,output_tokens\n" + rows)
    bt = from_file(csv, 1.0, spec("h100-80gb", 8192, 256, 4096, lo=3))
    runs = run_policies(bt, 1, (0.9,), ("kv-threshold-hpa", "headroom"), floor=False)
    assert {r.policy for r in runs} == {"kv-threshold-hpa", "headroom"}
    graded = graded_steps(bt.requests(1)) * DT  # the seed's realization: requests moved +-5 s
    for r in runs:
        assert r.pod_starts == 0 and r.peak_replicas == 3, r
        assert r.gpu_hours == pytest.approx(3 * graded / 3600)
