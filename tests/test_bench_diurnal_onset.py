"""The diurnal onset bench's two measures, on hand-built series."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.diurnal_onset import excess_z, shortfall_seconds
from headroom.operator.simulate.replay import DT
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
