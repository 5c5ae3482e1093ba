"""The forecast's pure math: least-squares slope, eta, counter increase across resets."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from headroom.contract.forecast import (
    counter_increase,
    counter_rate,
    forecast_saturation,
    least_squares,
    least_squares_slope,
    recent_trend,
    saturation_eta,
    windowed_ratio,
)


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


def test_a_fall_within_one_epoch_adds_nothing() -> None:
    """With epochs, a lower value in the same process is a series gone, not a reset from zero."""
    assert counter_increase([10.0, 5.0, 8.0], epochs=[0, 0, 0]) == 3.0
    assert counter_increase([10.0, 5.0, 8.0]) == 5.0 + 3.0


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


def _line(n: int, slope: float, y0: float = 0.2) -> list[tuple[float, float]]:
    return [(float(t), y0 + slope * t) for t in range(n)]


def test_spike_after_flat_is_read_from_the_recent_segment() -> None:
    # 20 s flat at 30 %, then 10 s of 1 %/s growth: plain OLS reads about a third of that.
    points = [(float(t), 0.3) for t in range(20)]
    points += [(float(t), 0.3 + 0.01 * (t - 19)) for t in range(20, 30)]
    plain = forecast_saturation(points, segmented=False)
    seg = forecast_saturation(points)
    assert plain.slope_per_second is not None and plain.slope_per_second < 0.006
    assert seg.slope_per_second == pytest.approx(0.01, rel=0.05)
    assert seg.fit_points < seg.points == 30
    assert seg.eta_seconds == pytest.approx((1 - 0.4) / 0.01, rel=0.05)


def test_growth_that_stops_is_read_as_not_growing() -> None:
    points = _line(20, 0.01) + [(float(t), 0.2 + 0.01 * 19) for t in range(20, 30)]
    assert forecast_saturation(points).eta_seconds == math.inf
    assert forecast_saturation(points, segmented=False).eta_seconds != math.inf


def test_stairs_of_bursty_allocation_do_not_cut_the_window() -> None:
    # +5 % every 5 s: a 1 %/s trend in steps; no segment of it is a change of trend.
    points = [(float(t), 0.2 + 0.05 * (t // 5)) for t in range(30)]
    fc = forecast_saturation(points)
    assert fc.fit_points == 30
    assert fc.slope_per_second == pytest.approx(0.01, rel=0.1)


def test_noise_alone_does_not_cut_the_window() -> None:
    rng = random.Random(3)
    cuts = 0
    for _ in range(50):
        points = [(float(t), 0.3 + 0.004 * t + rng.gauss(0, 0.01)) for t in range(30)]
        cuts += forecast_saturation(points).fit_points < 30
    assert cuts <= 5  # BIC's penalty: a rare false break, not a habit


@given(slope=st.floats(-0.05, 0.05), n=st.integers(3, 90))
def test_segmented_fit_of_a_straight_line_is_the_line(slope: float, n: int) -> None:
    fc = forecast_saturation(_line(n, slope))
    assert fc.fit_points == n
    assert fc.slope_per_second == pytest.approx(slope, abs=1e-9)


def test_prefix_sum_fit_matches_direct_least_squares_far_from_zero() -> None:
    # Monotonic clocks read large numbers; centring keeps the fit exact.
    base = 8.6e6
    points = [(base + t * 0.5, 0.1 + 0.003 * t + (0.01 if t % 3 else -0.02)) for t in range(40)]
    mean_t = sum(t for t, _ in points) / 40
    mean_y = sum(y for _, y in points) / 40
    direct = sum((t - mean_t) * (y - mean_y) for t, y in points) / sum(
        (t - mean_t) ** 2 for t, _ in points
    )
    assert least_squares_slope(points) == pytest.approx(direct, rel=1e-9)


def test_growth_below_the_floor_is_not_growing() -> None:
    """Below 1e-9 occupancy/s (over 30 years to fill) is "not growing"; above, a finite eta."""
    assert saturation_eta(0.5, 0.5e-9) == math.inf
    assert saturation_eta(0.5, 1.5e-9) == pytest.approx(0.5 / 1.5e-9)


def test_the_slope_standard_error_is_finite_from_three_points() -> None:
    """sqrt(SSE / (n - 2) / Sxx), infinite below three points, whatever the spacing of t."""
    two = least_squares([(0.0, 0.0), (0.5, 1.0)])
    assert two is not None and two.slope_stderr == math.inf
    # Line y = 1/6 + t; residuals -1/6, 1/3, -1/6: SSE 1/6 over 1 degree of freedom; Sxx 0.5.
    three = least_squares([(0.0, 0.0), (0.5, 1.0), (1.0, 1.0)])
    assert three is not None
    assert three.slope_stderr == pytest.approx(math.sqrt(1 / 3))


def test_a_forecast_needs_two_points_whatever_min_points_asks() -> None:
    """Two points at distinct times are a slope; one is not, even with min_points below 2."""
    assert forecast_saturation([(0.0, 0.1), (1.0, 0.2)], min_points=2).ready
    one = forecast_saturation([(0.0, 0.1)], min_points=1)
    assert not one.ready and (one.points, one.fit_points) == (1, 0)


def test_points_at_one_time_are_no_forecast_and_no_fit() -> None:
    """A window without time spread has no slope: not ready, and nothing was fitted."""
    fc = forecast_saturation([(4.0, 0.1), (4.0, 0.2), (4.0, 0.3)])
    assert not fc.ready and (fc.points, fc.fit_points) == (3, 0)


def test_a_spike_of_just_min_segment_points_is_read_from_it() -> None:
    """The split is tried from 2 x min_segment points, with min_segment (5) on each side."""
    for flat in (5, 25):
        points = [(float(t), 0.3) for t in range(flat)]
        points += [(float(t), 0.35 + 0.01 * (t - flat)) for t in range(flat, flat + 5)]
        fc = forecast_saturation(points)
        assert fc.fit_points == 5
        assert fc.slope_per_second == pytest.approx(0.01)


def test_the_recent_segment_is_never_shorter_than_min_segment() -> None:
    """A jump in the last 4 points is read over 5, not fitted exactly by a 4-point segment."""
    points = [(float(t), 0.3) for t in range(26)]
    points += [(float(t), 0.5 + 0.01 * (t - 26)) for t in range(26, 30)]
    assert forecast_saturation(points).fit_points == 5


def test_a_segment_without_time_spread_is_skipped() -> None:
    """A split whose side holds one repeated time has no line; the others are still tried."""
    points = [(0.0, 0.3)] * 5 + [(float(t), 0.3 + 0.001 * t) for t in range(1, 20)]
    fit = recent_trend(points)
    assert fit is not None and fit.slope == pytest.approx(0.001, rel=0.5)


def _criterion(points: list[tuple[float, float]], min_segment: int = 5) -> int:
    """The module docstring's rule, written out: the recent segment's size, or 0 for the line."""
    n = len(points)

    def bic(sse: float, k: int) -> float:
        return n * math.log(max(sse, n * 1e-12) / n) + 1.5 * k * math.log(n)

    whole = least_squares(points)
    assert whole is not None
    best: tuple[float, int] | None = None
    for k in range(min_segment, n - min_segment + 1):
        before, after = least_squares(points[:k]), least_squares(points[k:])
        assert before is not None and after is not None
        if best is None or before.sse + after.sse < best[0]:
            best = (before.sse + after.sse, n - k)
    assert best is not None
    return best[1] if bic(best[0], 5) < bic(whole.sse, 2) else 0


def test_the_split_follows_the_documented_criterion() -> None:
    """n ln(SSE / n) + 1.5 k ln n, k = 5 against 2, over every split: many series sit near it."""
    rng = random.Random(11)
    for _ in range(100):
        knee, growth = rng.randint(8, 22), rng.uniform(0, 0.01)
        points = [
            (float(t), 0.3 + growth * max(0, t - knee) + rng.gauss(0, 0.01)) for t in range(30)
        ]
        fit = recent_trend(points)
        assert fit is not None
        assert fit.n == (_criterion(points) or 30)


def test_one_query_in_the_window_is_a_ratio() -> None:
    """Any increase of the query counter gives a ratio, even a single query."""
    assert windowed_ratio([7.0, 8.0], [9.0, 10.0]) == 1.0
    assert windowed_ratio([7.0, 7.0], [9.0, 10.0]) == 0.0


def test_a_ratio_never_exceeds_one() -> None:
    """Counters scraped a moment apart can show more hits than queries: the ratio stays at 1."""
    assert windowed_ratio([0.0, 12.0], [0.0, 10.0]) == 1.0


def test_counter_rate_over_no_elapsed_time_is_none() -> None:
    """Samples at one time have no rate (not a division by zero); the span is last - first."""
    assert counter_rate([5.0, 5.0], [1.0, 2.0]) is None
    assert counter_rate([100.0, 110.0], [4.0, 9.0]) == pytest.approx(0.5)
