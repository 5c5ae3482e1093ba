"""PollState and figures(): freshness, restarts, the forecast and windows on a fake clock."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from synthetic_engine import SyntheticEngine

from headroom.sidecar.config import SidecarConfig
from headroom.sidecar.sources import parse_headroom_stats
from headroom.sidecar.state import PollState, figures

CFG = SidecarConfig(engine_url="http://127.0.0.1:1", interval=1.0, timeout=0.5, window=10.0,
                    forecast_window=10.0)  # fmt: skip


def _state() -> PollState:
    return PollState(horizon=CFG.window + CFG.interval)


def _poll(state: PollState, eng: SyntheticEngine, t: float) -> bool:
    return state.record_success(parse_headroom_stats(eng.body()), t)


def test_nothing_before_the_first_poll() -> None:
    fig = figures(_state(), CFG, now=100.0)
    assert not fig.engine_up and not fig.fresh and fig.reading is None
    assert fig.eta_seconds is None and fig.age_seconds is None


def test_ramp_gives_eta_and_growth() -> None:
    eng = SyntheticEngine(capacity=1000)
    state = _state()
    for t in range(10):
        eng.set_used(100 + 20 * t)  # 20 blocks/s
        _poll(state, eng, float(t))
    fig = figures(state, CFG, now=9.0)
    assert fig.fresh
    assert fig.growth_blocks_per_second == pytest.approx(20.0)
    assert fig.growth_ratio_per_second == pytest.approx(0.02)
    # 280 used at t=9: 720 blocks left at 20/s
    assert fig.eta_seconds == pytest.approx(36.0)
    assert fig.forecast_points == 10


def test_flat_usage_is_infinite_eta() -> None:
    eng = SyntheticEngine(capacity=1000)
    eng.set_used(500)
    state = _state()
    for t in range(5):
        _poll(state, eng, float(t))
    assert figures(state, CFG, now=4.0).eta_seconds == math.inf


def test_stale_reading_is_not_fresh() -> None:
    eng = SyntheticEngine(capacity=1000)
    state = _state()
    for t in range(5):
        _poll(state, eng, float(t))
    assert figures(state, CFG, now=4.0 + CFG.stale_after).fresh
    late = figures(state, CFG, now=4.0 + CFG.stale_after + 0.01)
    assert late.engine_up and not late.fresh  # last poll was fine, but too long ago
    assert late.reading is None and late.eta_seconds is None and late.hit_ratio is None


def test_failed_poll_drops_figures_but_keeps_model_label() -> None:
    eng = SyntheticEngine(capacity=1000, model="tiny")
    state = _state()
    _poll(state, eng, 0.0)
    state.record_error("timeout", "no answer")
    fig = figures(state, CFG, now=0.1)
    assert not fig.engine_up and not fig.fresh and fig.reading is None
    assert fig.model == "tiny"
    assert fig.errors["timeout"] == 1 and fig.errors["garbage"] == 0
    assert fig.last_error == "timeout: no answer"


def test_restart_by_instance_id_restarts_the_forecast() -> None:
    eng = SyntheticEngine(capacity=1000)
    state = _state()
    for t in range(5):
        eng.set_used(500 + 50 * t)
        assert not _poll(state, eng, float(t))
    eng.restart()
    eng.set_used(10)
    assert _poll(state, eng, 5.0)
    assert state.restarts_total == 1
    fig = figures(state, CFG, now=5.0)
    # Only one point since the restart: no forecast, rather than a slope across the drop.
    assert fig.eta_seconds is None and fig.forecast_points == 1
    for t in (6, 7):
        eng.set_used(10 + 10 * (t - 5))
        _poll(state, eng, float(t))
    fig = figures(state, CFG, now=7.0)
    assert fig.growth_blocks_per_second == pytest.approx(10.0)


def test_restart_by_counter_going_backwards() -> None:
    eng = SyntheticEngine()
    eng.instance_id = "fixed"
    state = _state()
    eng.preemptions_total = 5
    _poll(state, eng, 0.0)
    eng.preemptions_total = 1  # same id (say, vLLM without an id) but the counter reset
    assert _poll(state, eng, 1.0)


def test_restart_seen_when_counters_come_back_lower_after_polls_without_them() -> None:
    # SGLang has no instance id, and a restarted server exports its request counters only once
    # a request has finished: the readings between have none, and the fall is against the last
    # reading that had them.
    eng = SyntheticEngine()
    state = _state()
    eng.requests_finished_total, eng.preemptions_total = 5, 3

    def poll(t: float, **absent: None) -> bool:
        reading = replace(parse_headroom_stats(eng.body()), instance_id=None)
        return state.record_success(replace(reading, **absent), t)

    assert not poll(0.0) and not poll(1.0)
    none = dict.fromkeys(("prefix_queries_tokens_total", "prefix_hits_tokens_total",
                          "preemptions_total", "requests_departed_total"))  # fmt: skip
    eng.requests_finished_total, eng.preemptions_total = 1, 0
    assert not poll(2.0, **none) and not poll(3.0, **none)
    assert poll(4.0)  # departures 5 -> 1: a new server
    assert (state.restarts_total, state.epoch) == (1, 1)
    eng.requests_finished_total = 2
    assert not poll(5.0)  # counting on from the new server's values


def test_hit_ratio_is_windowed_and_survives_restart() -> None:
    eng = SyntheticEngine()
    state = _state()
    eng.queries_tokens_total, eng.hits_tokens_total = 10_000, 9_000  # old, high-hit history
    _poll(state, eng, 0.0)
    for t in range(1, 25):
        eng.queries_tokens_total += 100
        eng.hits_tokens_total += 5
        _poll(state, eng, float(t))
    fig = figures(state, CFG, now=24.0)
    assert fig.hit_ratio == pytest.approx(0.05)  # the window, not the lifetime 0.73
    eng.restart()
    eng.queries_tokens_total, eng.hits_tokens_total = 200, 100
    _poll(state, eng, 25.0)
    fig = figures(state, CFG, now=25.0)
    # window: 15..25 -> 9 polls of 100/5 before, plus 200/100 since the restart
    assert fig.hit_ratio == pytest.approx((9 * 5 + 100) / (9 * 100 + 200))


def test_hit_ratio_absent_without_queries_or_with_caching_off() -> None:
    eng = SyntheticEngine()
    state = _state()
    for t in range(3):
        _poll(state, eng, float(t))
    assert figures(state, CFG, now=2.0).hit_ratio is None
    eng.prefix_enabled = False
    for t in range(3, 6):
        eng.queries_tokens_total += 10
        _poll(state, eng, float(t))
    assert figures(state, CFG, now=5.0).hit_ratio is None


def test_preemption_rate() -> None:
    eng = SyntheticEngine()
    state = _state()
    for t in range(11):
        eng.preemptions_total = 2 * t
        _poll(state, eng, float(t))
    assert figures(state, CFG, now=10.0).preemption_rate_per_second == pytest.approx(2.0)


def test_window_is_trimmed() -> None:
    eng = SyntheticEngine()
    state = _state()
    for t in range(100):
        _poll(state, eng, float(t))
    assert len(state.samples) <= CFG.window + CFG.interval + 1


def test_demand_is_arrivals_times_block_seconds_per_request() -> None:
    eng = SyntheticEngine(capacity=1000)
    eng.set_used(400)
    state = _state()
    for t in range(11):
        # 4 requests/s arrive, 2/s leave, and the 400 blocks held make 400 block-s each second.
        eng.requests_arrived_total, eng.requests_finished_total = 4 * t, 2 * t
        eng.kv_block_seconds_total = 400.0 * t
        _poll(state, eng, float(t))
    fig = figures(state, CFG, now=10.0)
    assert fig.demand is not None
    assert (fig.demand.arrivals, fig.demand.departures) == pytest.approx((4.0, 2.0))
    assert fig.demand.block_seconds_per_request == pytest.approx(200.0)
    assert fig.demand.demand_blocks == pytest.approx(800.0)  # ahead of the 400 in use
    assert fig.block_seconds_total == pytest.approx(4000.0)


def test_block_seconds_are_integrated_here_when_the_source_has_none() -> None:
    eng = SyntheticEngine(capacity=1000)
    state = _state()
    for t in range(6):
        eng.set_used(100 * t)
        reading = parse_headroom_stats(eng.body())
        # A source (vLLM, SGLang) with request counters but no block-seconds of its own.
        reading = replace(reading, kv_block_seconds_total=None, requests_arrived_total=float(t),
                          requests_departed_total=float(t))  # fmt: skip
        state.record_success(reading, float(t))
    fig = figures(state, CFG, now=5.0)
    # Used 0, 100, ..., 400 over the five 1 s gaps (left endpoints): 1,000 block-seconds.
    assert fig.block_seconds_total == pytest.approx(1000.0)
    assert fig.demand is not None and fig.demand.block_seconds == pytest.approx(200.0)


def test_no_request_counters_no_demand() -> None:
    eng = SyntheticEngine(capacity=1000)
    state = _state()
    for t in range(4):
        reading = replace(parse_headroom_stats(eng.body()), requests_arrived_total=None)
        state.record_success(reading, float(t))
    assert figures(state, CFG, now=3.0).demand is None
