"""The forecast's pure math: least-squares slope, eta, counter increase across resets."""

from __future__ import annotations

import math
import random

import pytest
from headroom.sidecar.forecast import (
    counter_increase,
    counter_rate,
    forecast_saturation,
    least_squares_slope,
    saturation_eta,
    windowed_ratio,
)
from hypothesis import given
from hypothesis import strategies as st


@given(
    slope=st.floats(-10, 10),
    intercept=st.floats(-100, 100),
    n=st.integers(2, 60),
    dt=st.floats(0.1, 5),
)
def test_slope_of_an_exact_line_is_its_slope(
    slope: float, intercept: float, n: int, dt: float
) -> None:
    points = [(i * dt, intercept + slope * i * dt) for i in range(n)]
    fitted = least_squares_slope(points)
    assert fitted is not None
    assert fitted == pytest.approx(slope, abs=1e-6)


def test_slope_needs_two_distinct_times() -> None:
    assert least_squares_slope([]) is None
    assert least_squares_slope([(1.0, 5.0)]) is None
    assert least_squares_slope([(1.0, 5.0), (1.0, 7.0)]) is None


def test_slope_averages_allocation_steps_into_the_trend() -> None:
    # Usage that grows in bursts of 8 blocks every 4 s: the trend is 2 blocks/s; a two-point
    # difference would say 0 or 8.
    points = [(float(t), float(8 * (t // 4))) for t in range(40)]
    fitted = least_squares_slope(points)
    assert fitted is not None
    assert fitted == pytest.approx(2.0, rel=0.05)


def test_eta() -> None:
    assert saturation_eta(0.5, 0.01) == pytest.approx(50.0)
    assert saturation_eta(0.5, 0.0) == math.inf
    assert saturation_eta(0.5, -0.1) == math.inf
    assert saturation_eta(1.0, 0.1) == 0.0
    assert saturation_eta(1.0, -0.1) == 0.0


def test_forecast_waits_for_enough_points() -> None:
    assert not forecast_saturation([(0.0, 0.1), (1.0, 0.2)], min_points=3).ready
    fc = forecast_saturation([(0.0, 0.1), (1.0, 0.2), (2.0, 0.3)], min_points=3)
    assert fc.ready
    assert fc.slope_per_second == pytest.approx(0.1)
    assert fc.eta_seconds == pytest.approx(7.0)  # from the last observed 0.3


def test_forecast_flat_usage_is_infinite_not_missing() -> None:
    fc = forecast_saturation([(float(t), 0.4) for t in range(10)])
    assert fc.ready
    assert fc.eta_seconds == math.inf


def test_forecast_of_a_noisy_ramp_is_close() -> None:
    rng = random.Random(7)
    # 0.5 %/s growth with +-2 % jitter: saturation from 0.3 is 140 s away.
    points = [(t * 1.0, 0.3 + 0.005 * t + rng.uniform(-0.02, 0.02)) for t in range(30)]
    fc = forecast_saturation(points)
    assert fc.slope_per_second == pytest.approx(0.005, rel=0.2)


def test_counter_increase_follows_prometheus_reset_rule() -> None:
    assert counter_increase([]) == 0.0
    assert counter_increase([5.0]) == 0.0
    assert counter_increase([10.0, 15.0, 20.0]) == 10.0
    # reset between 20 and 3: the 3 counts as increase from zero
    assert counter_increase([10.0, 20.0, 3.0, 8.0]) == 10.0 + 3.0 + 5.0


def test_counter_increase_honours_known_restarts() -> None:
    # The engine restarted (epoch 0 -> 1) and counted past its old value before the next poll:
    # value order alone would miss the reset.
    assert counter_increase([10.0, 12.0], epochs=[0, 1]) == 12.0
    assert counter_increase([10.0, 12.0], epochs=[0, 0]) == 2.0


def test_windowed_ratio() -> None:
    assert windowed_ratio([0.0, 0.0], [0.0, 0.0]) is None
    assert windowed_ratio([100.0, 150.0], [200.0, 300.0]) == pytest.approx(0.5)
    # cumulative since start would be 150/300 = 0.5, but in the window it is 0 / 100
    assert windowed_ratio([150.0, 150.0], [300.0, 400.0]) == 0.0
    assert windowed_ratio([90.0, 5.0], [100.0, 10.0]) == pytest.approx(0.5)


def test_counter_rate() -> None:
    assert counter_rate([], []) is None
    assert counter_rate([1.0], [4.0]) is None
    assert counter_rate([0.0, 10.0], [4.0, 9.0]) == pytest.approx(0.5)
