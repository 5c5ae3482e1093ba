"""Little's-law demand and its forecast (headroom.contract.demand), shared by the sidecar, the
operator's decide() and the simulator."""

from __future__ import annotations

import math
import random

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
