"""PollState and figures(): freshness, restarts, the forecast and windows on a fake clock."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from functools import partial

import pytest
from synthetic_engine import SyntheticEngine

from headroom.sidecar.accrual import ArrivalCounter
from headroom.sidecar.config import SidecarConfig
from headroom.sidecar.sglang_source import SglangServerInfo, parse_sglang_metrics
from headroom.sidecar.sources import EngineReading, parse_headroom_stats
from headroom.sidecar.state import PollState, figures, finite_or_none

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
    assert (late.forecast_points, late.fit_points) == (0, 0)


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


def _poll_without_id(state: PollState, eng: SyntheticEngine, t: float) -> bool:
    """A poll of an engine without an id (vLLM multi-process, SGLang)."""
    return state.record_success(replace(parse_headroom_stats(eng.body()), instance_id=None), t)


def _one_instance() -> SyntheticEngine:
    """An engine under one instance id throughout, half its 1,024 blocks used."""
    eng = SyntheticEngine(capacity=1024)
    eng.instance_id = "fixed"
    eng.set_used(500)
    return eng


def test_restart_by_counter_going_backwards() -> None:
    eng = SyntheticEngine()
    state = _state()
    eng.preemptions_total = 5
    _poll_without_id(state, eng, 0.0)
    eng.preemptions_total = 1  # no id to tell: a counter that falls is the restart's sign
    assert _poll_without_id(state, eng, 1.0)


def test_a_counter_that_falls_under_the_same_instance_id_is_no_restart() -> None:
    # One series dipping (a data-parallel rank gone from vLLM's sum, an engine bug) counted
    # as a restart: every other counter's whole value then read as new in the window, and
    # the arrivals of 1/s read as 2,502/s, fresh, the demand 1.25 million blocks of 1,024.
    eng = _one_instance()
    state = _state()
    for t in range(40):
        eng.requests_arrived_total = eng.requests_finished_total = 2500 + t
        eng.kv_block_seconds_total = 500.0 * t
        eng.preemptions_total = 9 if t == 20 else 10
        assert not _poll(state, eng, float(t))
    fig = figures(state, CFG, now=39.0)
    assert fig.restarts_total == 0 and fig.demand is not None
    assert fig.demand.arrivals == pytest.approx(1.0)
    assert fig.demand.demand_blocks == pytest.approx(500.0)
    assert fig.preemption_rate_per_second is not None and fig.preemption_rate_per_second < 0.1


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


# ---------------------------------------------------------------- SGLang 0.5.3's stale gauges

STEP_S = 0.02  # one decode step
PROMPT = 1000  # tokens a request holds at its start; one more per decode step


class Sglang053:
    """What SGLang 0.5.3's `/metrics` says while requests come and go (one scheduler, page 1).

    Its scheduler sets the request and KV gauges only when it logs stats: at a new prefill
    batch (before the batch joins the running one: the new requests are neither running nor
    queued in that log), every 40 decode steps, and after 30 s idle. The tokenizer counts a
    request in `sglang:num_requests_total` as it finishes, a series created at the first.
    Time is in decode steps; `requests` are (arrival step, steps to run).
    """

    POOL = 32768  # above what the requests below hold at once: a real pool admits no more

    def __init__(self, requests: list[tuple[int, int]]) -> None:
        self.pending = sorted(requests)
        self.running: list[tuple[int, int]] = []  # (start step, end step)
        self.step = self.decode_steps = self.departed = 0
        self.gauges: tuple[int, int] | None = None  # running, used tokens, as last logged
        self.last_log = 0
        self.token_seconds = 0.0  # what the requests really held

    def used(self) -> int:
        return sum(PROMPT + self.step - start for start, _ in self.running)

    def log(self) -> None:
        self.gauges = (len(self.running), self.used())
        self.last_log = self.step

    def advance(self) -> None:
        """One decode step."""
        self.step += 1
        if self.pending and self.pending[0][0] <= self.step:
            self.log()  # the prefill log, before the new batch joins
            while self.pending and self.pending[0][0] <= self.step:
                _, steps = self.pending.pop(0)
                self.running.append((self.step, self.step + steps))
        left = [r for r in self.running if r[1] > self.step]
        self.departed += len(self.running) - len(left)  # counted at once, gauges as they were
        self.running = left
        if self.running:
            self.decode_steps += 1
            if self.decode_steps % 40 == 0:
                self.log()
        elif (self.step - self.last_log) * STEP_S > 30:
            self.log()  # idle
        self.token_seconds += self.used() * STEP_S

    def metrics(self) -> str | None:
        """The exposition, or None before the first log (SGLang's has no gauges yet)."""
        if self.gauges is None:
            return None
        running, used = self.gauges
        text = (
            f'sglang:token_usage{{tp_rank="0"}} {round(used / self.POOL, 2)}\n'
            f'sglang:num_used_tokens{{tp_rank="0"}} {used}\n'
            f'sglang:num_running_reqs{{tp_rank="0"}} {running}\n'
            'sglang:num_queue_reqs{tp_rank="0"} 0\n'
            'sglang:num_grammar_queue_reqs{tp_rank="0"} 0\n'
        )
        if self.departed:
            text += f'sglang:num_requests_total{{model_name="m"}} {self.departed}\n'
        return text


def _sglang_poll(
    state: PollState, arrivals: ArrivalCounter, engine: Sglang053, steps: int, t0: float = 0.0
) -> float:
    """Run `engine` for `steps` decode steps (from monotonic time `t0`), polled as the poller
    does every second, half a second after the steps its requests start on. Returns the used
    blocks as SGLang reports them, integrated over the polls."""
    info = SglangServerInfo((Sglang053.POOL,), 1)
    reported, used = 0.0, None
    for _ in range(steps):
        engine.advance()
        if engine.step % 50 == 25 and (text := engine.metrics()) is not None:
            reading = arrivals.apply(parse_sglang_metrics(text, server_info=info))
            reported += (used or 0) * 1.0
            used = reading.used_blocks
            state.record_success(reading, t0 + engine.step * STEP_S)
    return reported


def test_sglang_sparse_requests_are_counted_once_and_stop_holding_blocks_when_they_finish() -> None:
    """One 4 s request every 20 s. Each finishes between two logs: departed at once, still
    running in the gauges until the next arrival's log. It is one arrival, and its blocks are
    held for its 4 s, not the 20 s until that log (the demand this traffic makes, not 5x it)."""
    n, period, steps = 6, 1000, 200  # every 20 s, for 4 s
    engine = Sglang053([(1 + i * period, steps) for i in range(n)])
    state, arrivals = PollState(horizon=120.0), ArrivalCounter()
    _sglang_poll(state, arrivals, engine, n * period)
    assert engine.departed == n
    last = state.samples[-1].demand
    assert last is not None
    assert last.arrived == n and last.departed == n  # not 2n
    assert state.last_reading is not None and state.last_reading.requests_arrived_total == n
    # A request's first log comes 40 steps after it starts, and is seen at the next poll: up to
    # a poll interval of each request's blocks is missed, never 16 s of them added.
    most = PROMPT + steps
    assert abs(last.block_seconds - engine.token_seconds) <= n * 1.0 * most
    fig = figures(state, CFG.model_copy(update={"window": 60.0}), now=n * period * STEP_S)
    truth = (n / (n * period * STEP_S)) * engine.token_seconds / n  # arrival rate x per request
    assert fig.demand is not None and fig.demand.demand_blocks is not None
    assert 0.5 * truth <= fig.demand.demand_blocks <= 1.5 * truth


@pytest.mark.parametrize("rate", [0.5, 2.0])
def test_sglang_steady_traffic_reads_as_reported(rate: float) -> None:
    """Requests arriving at random (5 s each) keep the scheduler logging every 40 steps: the
    arrivals are the requests that came, and the block-seconds those of the used blocks as
    SGLang reports them, within a few percent."""
    rng = random.Random(1)
    requests, t = [], rng.expovariate(rate)
    while t < 300:
        requests.append((1 + round(t / STEP_S), 250))
        t += rng.expovariate(rate)
    engine = Sglang053(requests)
    state, arrivals = PollState(horizon=1e9), ArrivalCounter()
    reported = _sglang_poll(state, arrivals, engine, round(300 / STEP_S))
    last = state.samples[-1].demand
    assert last is not None
    arrived = len(requests) - len(engine.pending)
    assert last.arrived == pytest.approx(arrived, rel=0.02)
    assert last.block_seconds == pytest.approx(reported, rel=0.04)
    assert last.block_seconds == pytest.approx(engine.token_seconds, rel=0.08)


def test_sglang_restart_starts_the_stats_log_afresh() -> None:
    """After a restart the old server's log and arrivals are forgotten: the new server's first
    request, finished while its gauges still run it, is one arrival of the new epoch, and its
    blocks stop counting when it finishes."""
    state, arrivals = PollState(horizon=1e9), ArrivalCounter()
    old = Sglang053([(1, 200), (300, 200), (600, 200)])
    _sglang_poll(state, arrivals, old, 1500)
    assert state.samples[-1].demand is not None and state.samples[-1].demand.arrived == 3
    new = Sglang053([(1, 200)])  # counters from zero, no gauges before its first log
    _sglang_poll(state, arrivals, new, 1500, t0=state.samples[-1].t)
    assert state.restarts_total == 1 and state.epoch == 1
    last = state.samples[-1].demand
    assert last is not None and last.epoch == 1
    assert last.arrived == 1 and last.departed == 1  # not 2, nor the old server's 3
    # The integral restarts with the epoch, at the poll that sees the counter fall (after the
    # request finished): from there a poll interval of the log's blocks at most, not the 25 s
    # that the stale gauges still show them.
    assert 0 < last.block_seconds <= 1.0 * (PROMPT + 200)
    assert state.sglang_held == 0.0


def test_polls_total_counts_every_poll_good_or_bad() -> None:
    """A failed poll is a poll too: the poller's first-poll log line depends on the count."""
    eng = SyntheticEngine()
    state = _state()
    _poll(state, eng, 0.0)
    state.record_error("unreachable", "refused")
    _poll(state, eng, 1.0)
    assert state.polls_total == 3


def test_forecast_fits_the_sample_exactly_a_forecast_window_old() -> None:
    """The fit spans [now - forecast_window, now], both ends included."""
    eng = SyntheticEngine(capacity=1000)
    state = _state()
    for t in range(11):
        eng.set_used(100 + 10 * t)
        _poll(state, eng, float(t))
    assert figures(state, CFG, now=10.0).forecast_points == 11


def _sglang(running: int, waiting: int, used: int, departed: int | None) -> EngineReading:
    """An SGLang reading of a 1,000-token pool (page 1: a block is a token)."""
    text = (
        f"sglang:token_usage {round(used / 1000, 2)}\nsglang:num_used_tokens {used}\n"
        f"sglang:num_running_reqs {running}\nsglang:num_queue_reqs {waiting}\n"
    )
    if departed is not None:
        text += f"sglang:num_requests_total {departed}\n"
    return parse_sglang_metrics(text, server_info=SglangServerInfo((1000,), 1))


def test_sglang_blocks_held_between_logs_follow_the_requests_that_finish() -> None:
    """Between two stats logs the blocks held are the log's, in proportion to the requests it
    reported in flight that have not finished since (counted from the poll before the log); a
    log with none in flight holds its blocks while arrivals exceed departures, then none."""
    polls = [
        # (running, waiting, used, departed) -> (blocks held, arrivals)
        ((4, 0, 400, 10), (400, 14)),
        ((1, 1, 200, 10), (200, 14)),  # a new log: 2 in flight, 10 departed before it
        ((1, 1, 200, 11), (100, 14)),  # one of its 2 has finished since
        ((1, 0, 100, 11), (100, 14)),  # a new log: 1 in flight
        ((1, 0, 100, 12), (0, 14)),  # ... finished
        ((0, 0, 50, 12), (50, 14)),  # a new log: none in flight, 14 arrived > 12 departed
        ((0, 0, 50, 12), (50, 14)),
        ((0, 0, 50, 14), (0, 14)),  # all that arrived have departed
    ]
    state = PollState(horizon=1e9)
    for t, (gauges, want) in enumerate(polls):
        state.record_success(_sglang(*gauges), float(t))
        assert state.last_reading is not None
        assert (state.sglang_held, state.last_reading.requests_arrived_total) == want, t


def test_sglang_an_idle_server_at_its_first_poll_has_no_arrivals() -> None:
    """Nothing departed and nothing in flight is 0 arrivals, not a made-up first one."""
    state = PollState(horizon=1e9)
    state.record_success(_sglang(0, 0, 0, 0), 0.0)
    assert state.last_reading is not None and state.last_reading.requests_arrived_total == 0


def test_sglang_restart_keeps_the_log_the_new_server_wrote_before_its_counter() -> None:
    """A log read without the counter after one with it is the new server's: when its counter
    comes back lower (the restart seen), that log is kept, with the request that finished since
    no longer holding its blocks."""
    state = PollState(horizon=1e9)
    state.record_success(_sglang(2, 0, 200, 10), 0.0)
    state.record_success(_sglang(2, 0, 200, None), 1.0)  # restarted; no counter yet
    assert state.record_success(_sglang(2, 0, 200, 1), 2.0)  # its first request finished
    assert state.last_reading is not None
    assert (state.sglang_held, state.last_reading.requests_arrived_total) == (100, 2)


@pytest.mark.parametrize(
    ("value", "shown"), [(1.5, 1.5), (0.0, 0.0), (math.inf, None), (math.nan, None), (None, None)]
)
def test_finite_or_none_keeps_only_what_json_can_carry(
    value: float | None, shown: float | None
) -> None:
    """`/saturation` is JSON, which has no Inf or NaN: those are shown as null, finite ones kept."""
    assert finite_or_none(value) == shown


def test_integrated_block_seconds_start_again_from_zero_at_a_restart() -> None:
    """For a source without its own block-seconds the sidecar integrates used blocks over the
    time between polls, per engine life: a restarted engine's first poll has integrated none."""
    eng = SyntheticEngine(capacity=1000)
    eng.set_used(100)
    state = _state()

    def poll(t: float) -> None:
        reading = replace(parse_headroom_stats(eng.body()), kv_block_seconds_total=None,
                          requests_arrived_total=t, requests_departed_total=t)  # fmt: skip
        state.record_success(reading, t)

    poll(0.0)
    poll(0.5)  # polls closer than a second: 100 blocks for half a second
    assert figures(state, CFG, now=0.5).block_seconds_total == pytest.approx(50.0)
    eng.restart()
    eng.set_used(100)
    poll(1.0)
    assert state.restarts_total == 1
    assert figures(state, CFG, now=1.0).block_seconds_total == 0.0
    poll(3.0)
    assert figures(state, CFG, now=3.0).block_seconds_total == pytest.approx(200.0)


def test_sglang_reading_without_the_queue_gauge_is_kept_as_parsed() -> None:
    """Without both request gauges there is no stats log to read: no arrivals estimate, and
    the used blocks are integrated as reported."""
    state = PollState(horizon=1e9)
    reading = replace(_sglang(2, 0, 200, 10), waiting=None, requests_arrived_total=None)
    assert not state.record_success(reading, 0.0)
    assert state.last_reading == reading and state.sglang_held == 200


def test_sglang_restart_forgets_the_old_servers_counted_log() -> None:
    """A log read with the old server's counter is not the new server's: after the counter
    falls, arrivals are the new server's departures plus its requests in flight."""
    state = PollState(horizon=1e9)
    state.record_success(_sglang(2, 0, 200, 10), 0.0)
    assert state.record_success(_sglang(2, 0, 200, 1), 1.0)  # same gauges, counter fell
    assert state.last_reading is not None
    assert (state.sglang_held, state.last_reading.requests_arrived_total) == (200, 3)


def test_sglang_first_log_of_an_epoch_counts_departures_from_none() -> None:
    """At an epoch's first poll, when the log was written is unknown: every departure seen
    since counts against the requests it reported in flight."""
    state = PollState(horizon=1e9)
    state.record_success(_sglang(4, 0, 400, 2), 0.0)
    state.record_success(_sglang(4, 0, 400, 3), 1.0)  # 3 of its 4 may have finished
    assert state.sglang_held == 100


def _exported_totals(state: PollState, t: float) -> dict[str, float]:
    """Every `*_total` sample a scrape of the sidecar's /metrics shows at `t`."""
    from test_sidecar_collector import _families

    return {
        s.name: s.value
        for f in _families(state, CFG, partial(float, t)).values()
        for s in f.samples
        if s.name.endswith("_total") and not s.name.startswith("headroom_sidecar_")
    }


def _engine_counters(eng: SyntheticEngine, t: int, share: float) -> None:
    """Every counter of a steady engine at `t` s (1 request/s), `share` of it in this poll's sum."""
    eng.requests_arrived_total = eng.requests_finished_total = round(share * (2500 + t))
    eng.prompt_tokens_arrived_total = round(share * 100 * (2500 + t))
    eng.queries_tokens_total = round(share * 100 * (2500 + t))
    eng.hits_tokens_total = round(share * 50 * (2500 + t))
    eng.preemptions_total = round(share * 1000)
    eng.kv_block_seconds_total = share * 500.0 * (2500 + t)


def test_a_counter_that_dips_under_the_same_instance_id_is_held() -> None:
    # A series gone from a sum for a poll (a data-parallel rank missing from vLLM's /metrics)
    # made the exported counter fall, which Prometheus reads as a reset: increase() counted its
    # whole value again (1,000 preemptions: HeadroomPreempting on a pod that preempted none,
    # and arrivals for a Prometheus-fed autoscaler). The window counted the climb back as new.
    eng = _one_instance()
    state = _state()
    last: dict[str, float] = {}
    for t in range(31):
        _engine_counters(eng, t, 0.5 if t in (24, 25) else 1.0)  # half the sum gone, 2 polls
        assert not _poll(state, eng, float(t))
        exported = _exported_totals(state, float(t))
        assert len(exported) >= 7 and (not last or set(exported) == set(last))
        fell = {k: (last[k], v) for k, v in exported.items() if k in last and v < last[k]}
        assert not fell, (t, fell)
        last = exported
    fig = figures(state, CFG, now=30.0)
    assert fig.demand is not None and fig.demand.arrivals == pytest.approx(1.0)
    assert fig.demand.departures == pytest.approx(1.0)
    assert fig.demand.demand_blocks == pytest.approx(500.0)
    assert fig.hit_ratio == pytest.approx(0.5)
    assert fig.preemption_rate_per_second == 0.0
    # A restart still reads as one: the new engine's counters are exported as they are.
    eng.instance_id = "restarted"
    eng.preemptions_total, eng.requests_arrived_total = 3, 7
    assert _poll(state, eng, 31.0)
    reading = figures(state, CFG, now=31.0).reading
    assert reading is not None and reading.preemptions_total == 3.0
    assert reading.requests_arrived_total == 7.0


def test_a_sum_that_stays_lower_counts_on_from_there_after_the_hold() -> None:
    # A rank gone for good (or restarted on its own) under the same instance: held from falling
    # forever, every counter it fed stood still until the other ranks caught up (as long as the
    # engine had been up), hiding preemptions and the departures of the rank still serving.
    from headroom.sidecar.monotonic import HOLD_POLLS

    eng = _one_instance()
    state = _state()
    for t in range(20):
        _engine_counters(eng, t, 1.0)
        _poll(state, eng, float(t))
    before = _exported_totals(state, 19.0)
    for t in range(20, 45):  # half the sum from t = 20 on; the rest goes on at half the rate
        _engine_counters(eng, t, 0.5)
        eng.preemptions_total = 500 + (t - 20)  # and preempts one a second
        assert not _poll(state, eng, float(t))
        exported = _exported_totals(state, float(t))
        assert all(exported[k] >= before[k] for k in before), t
        before = exported
    fig = figures(state, CFG, now=44.0)  # the window (34-44 s) is past the hold
    assert 20 + HOLD_POLLS + 1 < 34
    assert fig.demand is not None and fig.demand.departures == pytest.approx(0.5, abs=0.06)
    assert fig.preemption_rate_per_second == pytest.approx(1.0)


def test_without_an_instance_id_a_fall_is_a_restart_and_exported_as_read() -> None:
    eng = SyntheticEngine()
    state = _state()
    eng.preemptions_total = eng.requests_finished_total = 50
    eng.prompt_tokens_arrived_total = 900
    assert not _poll_without_id(state, eng, 0.0)
    eng.prompt_tokens_arrived_total = 400  # no restart marker among the counters that fell
    assert not _poll_without_id(state, eng, 1.0)
    assert _exported_totals(state, 1.0)["headroom_prompt_tokens_arrived_total"] == 900.0
    eng.preemptions_total = eng.requests_finished_total = 2
    eng.prompt_tokens_arrived_total = 10
    assert _poll_without_id(state, eng, 2.0)
    exported = _exported_totals(state, 2.0)
    assert exported["headroom_preemptions_total"] == 2.0
    assert exported["headroom_prompt_tokens_arrived_total"] == 10.0


def _vllm(ranks: list[tuple[float, float]]) -> EngineReading:
    """A vLLM reading as its parser gives it from the ranks' (departed, in flight), summed:
    arrivals are the level departed + in flight."""
    departed, in_flight = sum(d for d, _ in ranks), sum(f for _, f in ranks)
    base = parse_headroom_stats(SyntheticEngine(capacity=1024).body())
    return replace(base, source="vllm", instance_id="fixed",
                   requests_arrived_total=departed + in_flight,
                   requests_departed_total=departed)  # fmt: skip


def _vllm_arrival_rates(gap: int | None) -> dict[int, float]:
    """Two ranks finishing 1 request/s each; every 5 s six of rank 0's requests are aborted by
    their clients (vLLM counts them nowhere: the level falls) and refilled. Rank 1's series
    are missing from the poll at `gap`. The window's arrival rate at 30 s and 39 s."""
    arrivals, state = ArrivalCounter(), _state()
    last, rates = 0.0, {}
    for t in range(40):
        ranks = [(float(t), 2.0 if t % 5 == 0 else 8.0), (float(t), 4.0)]  # departed, in flight
        if t == gap:
            ranks = ranks[:1]
        reading = _vllm(ranks)
        state.record_success(arrivals.apply(reading), float(t))
        exported = _exported_totals(state, float(t))["headroom_requests_arrived_total"]
        assert exported >= last, t
        last = exported
        if t in (30, 39):
            fig = figures(state, CFG, now=float(t))
            assert fig.demand is not None and fig.demand.arrivals is not None
            rates[t] = fig.demand.arrivals
    return rates


def test_vllm_arrivals_hold_through_a_rank_missing_from_a_poll() -> None:
    # The arrivals counter read fewer departures under the same id as a restart and started
    # again from the level: held from falling, the exported arrivals then stood still until the
    # level caught up with what it had counted (about 10 s here).
    steady, gapped = _vllm_arrival_rates(None), _vllm_arrival_rates(25)
    assert steady[30] > 2.0 and steady[39] > 2.0
    # The gap costs at most the arrivals its poll hides (a refill of aborted requests: 4).
    assert steady[30] - 0.45 <= gapped[30] <= steady[30]
    assert gapped[39] == pytest.approx(steady[39])


@pytest.mark.parametrize(("gap", "held"), [(3, True), (4, False)])
def test_a_fall_is_held_for_three_polls_then_the_lower_sum_stands(gap: int, held: bool) -> None:
    from headroom.sidecar.monotonic import HOLD_POLLS

    assert HOLD_POLLS == 3
    eng = SyntheticEngine()
    eng.instance_id = "fixed"
    state = _state()
    eng.preemptions_total = 100
    _poll(state, eng, 0.0)
    eng.preemptions_total = 40  # a pool's 60 missing from the sum
    for t in range(1, gap + 1):
        _poll(state, eng, float(t))
        assert _exported_totals(state, float(t))["headroom_preemptions_total"] == 100.0
    eng.preemptions_total = 41 if not held else 101  # one more: the pool back, or not
    _poll(state, eng, gap + 1.0)
    assert _exported_totals(state, gap + 1.0)["headroom_preemptions_total"] == 101.0


def test_vllm_arrivals_count_on_from_a_rank_gone_for_good() -> None:
    # Held from falling forever, the arrivals stood still once a rank was gone (rate 0).
    arrivals, state = ArrivalCounter(), _state()
    for t in range(40):
        ranks = [(float(t), 4.0), (float(t), 4.0)][: 2 if t < 20 else 1]  # departed, in flight
        reading = _vllm(ranks)
        state.record_success(arrivals.apply(reading), float(t))
    fig = figures(state, CFG, now=39.0)
    assert fig.demand is not None and fig.demand.arrivals == pytest.approx(1.0)
    assert fig.demand.departures == pytest.approx(1.0)
