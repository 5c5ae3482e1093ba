"""Little's-law demand and its forecast (headroom.contract.demand), shared by the sidecar, the
operator's decide() and the simulator."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from headroom.contract.demand import (
    CounterSample,
    DemandRates,
    forecast_demand,
    pooled,
    rates,
)
from headroom.contract.forecast import least_squares


def test_little_s_law_from_the_counters() -> None:
    # 2 requests/s arrive and leave; 1,000 blocks are held on average: 500 block-s per request.
    samples = [CounterSample(t, 2.0 * t, 2.0 * t, 1000.0 * t) for t in range(0, 61, 5)]
    r = rates(samples)
    assert r is not None
    assert (r.arrivals, r.departures, r.block_seconds) == pytest.approx((2.0, 2.0, 1000.0))
    assert r.block_seconds_per_request == pytest.approx(500.0)
    assert r.demand_blocks == pytest.approx(1000.0)  # steady traffic: demand is what is held


def test_demand_leads_occupancy_when_arrivals_step_up() -> None:
    # Arrivals doubled a moment ago; departures and the blocks held have not caught up yet.
    r = DemandRates(arrivals=4.0, departures=2.0, block_seconds=1000.0, window_seconds=60)
    assert r.demand_blocks == pytest.approx(2000.0)


def test_no_departure_no_demand() -> None:
    r = DemandRates(arrivals=3.0, departures=0.0, block_seconds=10.0, window_seconds=60)
    assert r.block_seconds_per_request is None and r.demand_blocks is None


def test_counters_reset_by_a_restart_are_not_negative_rates() -> None:
    before = [CounterSample(t, 100 + t, 100 + t, 5000 + 10 * t) for t in (0, 10, 20)]
    after = [CounterSample(t, t - 25, t - 25, 10 * (t - 25), epoch=1) for t in (30, 40)]
    r = rates(before + after)
    assert r is not None and r.arrivals > 0 and r.block_seconds > 0
    assert r.arrivals == pytest.approx((20 + 5 + 10) / 40)  # the new value counts from zero


def test_rates_need_two_samples_over_time() -> None:
    assert rates([]) is None
    assert rates([CounterSample(5, 1, 1, 1)]) is None
    assert rates([CounterSample(5, 1, 1, 1), CounterSample(5, 2, 2, 2)]) is None


def test_pooled_pods_share_one_block_seconds_per_request() -> None:
    old = DemandRates(arrivals=1.0, departures=1.0, block_seconds=800.0, window_seconds=60)
    new = DemandRates(arrivals=1.0, departures=0.0, block_seconds=50.0, window_seconds=20)
    both = pooled([old, new])
    assert both is not None and both.window_seconds == 60
    # The new pod has no departures of its own: its arrivals still count, at the pool's W.
    assert both.demand_blocks == pytest.approx(2.0 * 850.0)
    assert pooled([]) is None


def test_a_flat_series_projects_no_trend_and_a_poisson_band() -> None:
    hist = [(float(t), 1000.0) for t in range(0, 181, 15)]
    fc = forecast_demand(hist, horizon=165, quantile=0.95, blocks_per_request=100)
    assert fc is not None and fc.slope == 0 and fc.mean == pytest.approx(1000)
    # sqrt(1000 x 100) x z(0.95)
    assert fc.band == pytest.approx(1.6449 * math.sqrt(1e5), rel=1e-3)
    assert fc.upper == fc.mean + fc.band


def test_a_ramp_is_projected_over_the_horizon() -> None:
    rng = random.Random(1)
    hist = [(float(t), 1000.0 + 10.0 * t + rng.gauss(0, 20)) for t in range(0, 181, 15)]
    fc = forecast_demand(hist, horizon=165, quantile=0.95, blocks_per_request=10)
    assert fc is not None
    assert 9.0 < fc.slope < 10.0  # the slope less one standard error
    assert fc.mean == pytest.approx(1000 + 10 * (180 + 165), rel=0.03)


def test_a_ramp_that_starts_inside_the_window_is_read_by_one_line_over_all_of_it() -> None:
    # Flat for 90 s, then +20 blocks/s: the sidecar's segmented fit would read 20 from the
    # recent segment; the demand forecast fits one line over the window (growthWindowSeconds'
    # description says so), less one standard error.
    hist = [(float(t), 1000.0 + 20.0 * max(0, t - 90)) for t in range(0, 181, 15)]
    fc = forecast_demand(hist, horizon=165, quantile=0.95, blocks_per_request=10)
    whole = least_squares(hist)
    assert fc is not None and whole is not None
    assert fc.slope == pytest.approx(whole.slope - whole.slope_stderr)
    assert 5.0 < fc.slope < 15.0


def test_noise_is_not_a_trend() -> None:
    rng = random.Random(7)
    hits = 0
    for _ in range(200):
        hist = [(float(t), 1000.0 + rng.gauss(0, 150)) for t in range(0, 181, 15)]
        fc = forecast_demand(hist, horizon=165, quantile=0.95, blocks_per_request=10)
        assert fc is not None
        hits += fc.slope != 0
    assert hits <= 20  # a 2-standard-error test: about 5 % by chance


def test_the_band_is_the_kv_in_uses_own_scatter_when_it_is_wider() -> None:
    hist = [(float(t), 1000.0) for t in range(0, 181, 15)]
    calm = [(t, 1000.0) for t, _ in hist]
    wild = [(t, 1000.0 + (300.0 if i % 2 else -300.0)) for i, (t, _) in enumerate(hist)]
    quiet = forecast_demand(hist, 165, 0.95, 10, held=calm)
    bursty = forecast_demand(hist, 165, 0.95, 10, held=wild)
    assert quiet is not None and bursty is not None
    assert bursty.band > 2 * quiet.band


def test_overlapping_windows_widen_the_uncertainty() -> None:
    rng = random.Random(3)
    hist = [(float(t), 1000.0 + 5.0 * t + rng.gauss(0, 100)) for t in range(0, 181, 15)]
    apart = forecast_demand(hist, 165, 0.95, 1, averaging=15)
    shared = forecast_demand(hist, 165, 0.95, 1, averaging=60)
    assert apart is not None and shared is not None and shared.band > apart.band


@given(
    st.lists(st.floats(min_value=0, max_value=1e6), min_size=1, max_size=30),
    st.floats(min_value=0, max_value=3600),
    st.floats(min_value=0.5, max_value=0.99),
)
def test_the_forecast_is_never_negative_and_the_band_never_below_zero(
    ys: list[float], horizon: float, q: float
) -> None:
    hist = [(15.0 * i, y) for i, y in enumerate(ys)]
    fc = forecast_demand(hist, horizon, q, blocks_per_request=50)
    assert fc is not None
    assert fc.mean >= 0 and fc.level >= 0 and fc.band >= 0
    assert math.isfinite(fc.upper)
    assert forecast_demand([], horizon, q, 50) is None


Z95 = 1.6448536269514722  # NormalDist().inv_cdf(0.95)


def test_under_three_points_the_level_is_the_latest_and_the_band_poisson() -> None:
    """Two points are no line to trust: the latest point is the level, no trend, no scatter."""
    fc = forecast_demand([(0.0, 900.0), (15.0, 1000.0)], 165, 0.95, 10)
    assert fc is not None
    assert (fc.level, fc.slope, fc.mean, fc.scatter) == (1000.0, 0.0, 1000.0, 0.0)
    assert fc.band == pytest.approx(Z95 * math.sqrt(1000.0 * 10))


def test_three_points_on_a_line_are_a_trend() -> None:
    """Three points are enough for the line; an exact one has no error to take off its slope."""
    fc = forecast_demand([(0.0, 900.0), (15.0, 1050.0), (30.0, 1200.0)], 60, 0.95, 10)
    assert fc is not None
    assert fc.slope == pytest.approx(10.0) and fc.level == pytest.approx(1200.0)
    assert fc.mean == pytest.approx(1800.0)
    assert fc.band == pytest.approx(Z95 * math.sqrt(1800.0 * 10))  # Poisson at the mean


def test_a_falling_line_plans_for_the_poisson_noise_of_the_level_now() -> None:
    """Requests in flight now are max(mean, level): a fall is not counted on before it comes."""
    fc = forecast_demand([(0.0, 1200.0), (15.0, 1050.0), (30.0, 900.0)], 30, 0.95, 10)
    assert fc is not None
    assert fc.mean == pytest.approx(600.0) and fc.level == pytest.approx(900.0)
    assert fc.band == pytest.approx(Z95 * math.sqrt(900.0 * 10))


def test_without_a_trend_the_level_is_uncertain_by_the_scatter_over_root_n() -> None:
    """The mean's variance is stdev^2 / n, x averaging / spacing (points sharing a window)."""
    ys = [1000.0 + (100.0 if i % 2 else -100.0) for i in range(13)]
    hist = [(5000.0 + 15.0 * i, y) for i, y in enumerate(ys)]  # spacing 15 s, clock not at 0
    fc = forecast_demand(hist, 165, 0.95, 1, averaging=60)
    assert fc is not None and fc.slope == 0
    mean, sd = statistics.fmean(ys), statistics.stdev(ys)
    assert (fc.level, fc.mean, fc.scatter) == pytest.approx((mean, mean, sd))
    assert fc.band == pytest.approx(Z95 * math.sqrt(sd**2 / 13 * (60 / 15) + mean * 1))


def test_averages_shorter_than_the_spacing_share_nothing() -> None:
    """sqrt(averaging / spacing) never narrows the band: below one shared point it is 1."""
    ys = [1000.0 + (100.0 if i % 2 else -100.0) for i in range(13)]
    hist = [(15.0 * i, y) for i, y in enumerate(ys)]
    short = forecast_demand(hist, 165, 0.95, 1, averaging=5)
    none = forecast_demand(hist, 165, 0.95, 1)
    assert short is not None and none is not None and short.band == pytest.approx(none.band)
    mean, sd = statistics.fmean(ys), statistics.stdev(ys)
    assert short.band == pytest.approx(Z95 * math.sqrt(sd**2 / 13 + mean * 1))


def test_a_ramps_band_is_the_lines_prediction_interval_at_the_horizon() -> None:
    """s^2 (1/n + (t_now + horizon - mean t)^2 / Sxx) x shared, plus the Poisson term."""
    rng = random.Random(5)
    hist = [(float(t), 1000.0 + 10.0 * t + rng.gauss(0, 40)) for t in range(0, 181, 15)]
    fit = least_squares(hist)
    assert fit is not None and abs(fit.slope) > 2 * (fit.slope_stderr * 2)  # a trend, shared 4
    fc = forecast_demand(hist, 165, 0.95, 1, averaging=60)
    assert fc is not None
    se = fit.slope_stderr * 2  # sqrt(60 / 15)
    level = fit.intercept + fit.slope * 180
    assert fc.level == pytest.approx(level)
    assert fc.slope == pytest.approx(fit.slope - se)
    assert fc.mean == pytest.approx(level + (fit.slope - se) * 165)
    s2 = fit.sse / (13 - 2)
    assert fc.scatter == pytest.approx(math.sqrt(s2))
    var_level = s2 * (1 / 13 + (180 + 165 - 90) ** 2 / fit.sxx) * 4
    assert fc.band == pytest.approx(Z95 * math.sqrt(var_level + fc.mean))


def test_shrink_is_how_many_standard_errors_come_off_the_slope() -> None:
    """shrink 0 projects the fitted slope; shrink 1.5 takes 1.5 standard errors off it."""
    rng = random.Random(1)
    hist = [(float(t), 1000.0 + 10.0 * t + rng.gauss(0, 20)) for t in range(0, 181, 15)]
    fit = least_squares(hist)
    assert fit is not None
    whole = forecast_demand(hist, 165, 0.95, 10, shrink=0.0)
    less = forecast_demand(hist, 165, 0.95, 10, shrink=1.5)
    assert whole is not None and less is not None
    assert whole.slope == pytest.approx(fit.slope)
    assert less.slope == pytest.approx(fit.slope - 1.5 * fit.slope_stderr)


@pytest.mark.parametrize("amplitude", [0.4, 1.0, 1.6])
def test_a_shrink_beyond_the_fitted_slope_projects_no_slope(amplitude: float) -> None:
    """A slope of under `shrink` standard errors that passes a lower significance is projected
    flat: taking the margin off must not reflect it past zero, or the weaker the fitted slope,
    the steeper the projection."""
    hist = [(15.0 * i, 1000.0 + amplitude * 3 * i + (100 if i % 2 else -100)) for i in range(13)]
    fit = least_squares(hist)
    assert fit is not None and 0 < fit.slope < 2 * fit.slope_stderr
    fc = forecast_demand(hist, 165, 0.95, 1, significance=0.0, shrink=2.0)
    assert fc is not None and fc.slope == 0.0


def test_three_points_of_held_kv_measure_its_scatter() -> None:
    """Held KV's scatter is around its own line, over n - 2 degrees of freedom, from 3 points."""
    hist = [(float(t), 1000.0) for t in range(0, 181, 15)]
    # A flat line at 1,200 with residuals -200, +400, -200: SSE 240,000 over 1 degree.
    held = [(150.0, 1000.0), (165.0, 1600.0), (180.0, 1000.0)]
    fc = forecast_demand(hist, 165, 0.95, 10, held=held)
    assert fc is not None
    assert fc.band == pytest.approx(Z95 * math.sqrt(240_000.0))


def test_a_slope_is_projected_beyond_two_standard_errors_by_default() -> None:
    """significance defaults to 2: 1.9 standard errors is noise, 2.8 is a trend."""

    def ramp(growth: float) -> list[tuple[float, float]]:
        return [
            (15.0 * i, 1000.0 + growth * 15 * i + (100.0 if i % 2 else -100.0)) for i in range(13)
        ]

    for growth, projected in ((1.0, False), (1.5, True)):
        fit = least_squares(ramp(growth))
        fc = forecast_demand(ramp(growth), 165, 0.95, 10)
        assert fit is not None and fc is not None
        assert (abs(fit.slope) > 2 * fit.slope_stderr) is projected
        assert (fc.slope != 0) is projected


def test_rates_are_over_the_span_from_the_first_sample_to_the_last() -> None:
    """The window is last t - first t, whatever the clock read at the first sample; two do."""
    samples = [CounterSample(t, 2.0 * t, 2.0 * t, 1000.0 * t) for t in (100.0, 160.0)]
    r = rates(samples)
    assert r is not None and r.window_seconds == 60.0
    assert (r.arrivals, r.departures, r.block_seconds) == pytest.approx((2.0, 2.0, 1000.0))


def test_a_steady_series_with_no_noise_anywhere_has_no_band() -> None:
    """No scatter, no Poisson term (0 blocks per request), held KV under 3 points: band 0."""
    hist = [(float(t), 1000.0) for t in range(0, 181, 15)]
    fc = forecast_demand(hist, 165, 0.95, 0, held=[(165.0, 900.0), (180.0, 1100.0)])
    assert fc is not None and fc.band == 0.0 and fc.upper == 1000.0


def test_an_idle_deployment_and_a_fall_below_zero_forecast_zero() -> None:
    """Demand is never negative: the level and the mean stop at 0, not at some floor above."""
    idle = forecast_demand([(float(t), 0.0) for t in range(0, 181, 15)], 165, 0.95, 10)
    assert idle is not None and (idle.level, idle.mean, idle.band) == (0.0, 0.0, 0.0)
    falling = forecast_demand([(0.0, 200.0), (15.0, 100.0), (30.0, 0.0)], 60, 0.95, 10)
    assert falling is not None and falling.slope < 0
    assert (falling.level, falling.mean) == pytest.approx((0.0, 0.0), abs=1e-9)
