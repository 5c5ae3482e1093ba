"""What the sidecar remembers between polls, and the figures derived from it at render time.

`PollState` is the only mutable object: the poller records each outcome into it. `figures()` is a
pure function of that state and the clock, so `/metrics` and `/saturation` always agree and a
value older than `stale_after` can never be shown as fresh.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

from headroom.contract.demand import CounterSample, DemandRates, rates
from headroom.contract.forecast import counter_rate, forecast_saturation, windowed_ratio
from headroom.sidecar.config import SidecarConfig
from headroom.sidecar.monotonic import Held
from headroom.sidecar.sources import EngineReading

ErrorReason = Literal["unreachable", "timeout", "http_status", "garbage", "internal"]
ERROR_REASONS: tuple[ErrorReason, ...] = get_args(ErrorReason)


@dataclass(frozen=True, slots=True)
class Sample:
    """One successful poll, as the window keeps it."""

    t: float  # monotonic seconds
    epoch: int  # bumped on every engine restart
    occupancy: float
    queries: float | None
    hits: float | None
    preemptions: float | None
    demand: CounterSample | None = None  # the demand counters, when the source has them


@dataclass(slots=True)
class PollState:
    """The poller's memory: last outcome, error counts, restarts and the sample window."""

    horizon: float  # seconds of samples kept
    last_reading: EngineReading | None = None
    last_ok_t: float | None = None
    last_poll_ok: bool = False
    last_error: str | None = None
    known_model: str | None = None  # sticky so series keep their labels while the engine is down
    epoch: int = 0
    restarts_total: int = 0
    polls_total: int = 0
    errors: dict[ErrorReason, int] = field(default_factory=lambda: dict.fromkeys(ERROR_REASONS, 0))
    samples: deque[Sample] = field(default_factory=deque)
    # Block-seconds integrated here, poll to poll, for sources that do not count them
    # (vLLM, SGLang): sampled at the poll interval, not exact like the engine's own counter.
    # vLLM's used blocks are integrated as reported, SGLang's as `_sglang_demand` reads them.
    integrated_block_seconds: float = 0.0
    # Each cumulative counter as exported this epoch: kept from falling (`_held`).
    counters: dict[str, Held] = field(default_factory=dict)
    # The last value of each restart marker (instance id, counters) in the last reading that
    # had it: a restarted SGLang exports its request counters only after its first request
    # finishes, so comparing with the previous reading alone would miss the fall.
    seen: dict[str, object] = field(default_factory=dict)
    # SGLang only (see `_sglang_demand`): the last stats log seen, the arrivals counted in this
    # epoch, and the blocks the requests in flight hold now (integrated up to the next poll).
    sglang_log: SglangLog | None = None
    sglang_arrived: float | None = None
    sglang_held: float | None = None

    def record_success(self, reading: EngineReading, t: float) -> bool:
        """Keep a good reading taken at monotonic time `t`; returns True if the engine restarted.

        Everything is computed before anything is kept: a reading this raises on leaves the
        state as it was (the poller counts it as an internal error).

        An SGLang reading is kept (as `last_reading` and in the window) with its arrivals
        replaced by the estimate of `_sglang_demand`, so that `/metrics`, `/saturation` and the
        demand rates all count the same arrivals. Every reading's counters are kept from falling
        within an epoch (`_held`); its other fields stay as parsed.
        """
        markers = _markers(reading)
        restarted = _restarted(self.seen, markers)
        epoch = self.epoch + 1 if restarted else self.epoch
        reading, counters = _held(reading, {} if restarted else self.counters)
        integrated = 0.0 if restarted else self.integrated_block_seconds
        if not restarted and self.samples and self.last_reading is not None:
            used: float | None = (
                self.sglang_held
                if self.last_reading.source == "sglang"
                else self.last_reading.used_blocks
            )
            if used is not None:
                integrated += used * max(t - self.samples[-1].t, 0.0)
        sglang_log = sglang_arrived = sglang_held = None
        if reading.source == "sglang":
            # The departures at the last poll, where it was this server's: without the counter,
            # none had finished (the new server's, where the counter has since come back lower).
            before: float | None = None
            last = self.last_reading
            if (
                last is not None
                and last.source == "sglang"
                and (not restarted or last.requests_departed_total is None)
            ):
                before = last.requests_departed_total or 0.0
            if not restarted:
                sglang_log, sglang_arrived = self.sglang_log, self.sglang_arrived
            elif self.sglang_log is not None and not self.sglang_log.counted:
                # logged by the new server before its first request finished: its own log
                sglang_log = self.sglang_log
            sglang_log, estimate, sglang_held = _sglang_demand(
                reading, sglang_log, sglang_arrived, before
            )
            if estimate is not None:
                sglang_arrived = estimate
                if reading.requests_arrived_total is not None:
                    reading = replace(reading, requests_arrived_total=estimate)
        sample = Sample(
            t=t,
            epoch=epoch,
            occupancy=reading.occupancy,
            queries=reading.prefix_queries_tokens_total,
            hits=reading.prefix_hits_tokens_total,
            preemptions=reading.preemptions_total,
            demand=_demand_counters(reading, t, epoch, integrated),
        )
        if restarted:
            self.restarts_total += 1
            self.seen = {}
        self.epoch = epoch
        self.integrated_block_seconds = integrated
        self.sglang_log, self.sglang_arrived = sglang_log, sglang_arrived
        self.sglang_held = sglang_held
        self.counters = counters
        self.seen.update(markers)
        self.polls_total += 1
        self.last_reading = reading
        self.last_ok_t = t
        self.last_poll_ok = True
        self.last_error = None
        if reading.model:
            self.known_model = reading.model
        self.samples.append(sample)
        while self.samples and self.samples[0].t < t - self.horizon:
            self.samples.popleft()
        return restarted

    def is_restart(self, reading: EngineReading) -> bool:
        """Whether recording `reading` would count an engine restart (it changes nothing)."""
        return _restarted(self.seen, _markers(reading))

    def record_error(self, reason: ErrorReason, message: str) -> None:
        """Count a failed poll; the last good reading stays but is no longer fresh."""
        self.polls_total += 1
        self.errors[reason] += 1
        self.last_poll_ok = False
        self.last_error = f"{reason}: {message}"


def _demand_counters(
    reading: EngineReading, t: float, epoch: int, integrated_block_seconds: float
) -> CounterSample | None:
    """The demand counters of `reading` as the window keeps them, or None without them."""
    arrived, departed = reading.requests_arrived_total, reading.requests_departed_total
    if arrived is None or departed is None:
        return None
    block_seconds = reading.kv_block_seconds_total
    if block_seconds is None:
        if reading.used_blocks is None:
            return None
        block_seconds = integrated_block_seconds
    return CounterSample(t, arrived, departed, block_seconds, epoch)


@dataclass(frozen=True, slots=True)
class SglangLog:
    """An SGLang scheduler stats log, as read at the first poll that saw its gauges."""

    gauges: tuple[int, int, int | None, float]  # running, waiting, used blocks, occupancy
    counted: bool  # whether the server had its request counter then
    departed: float  # the fewest requests that can have departed when it was logged
    arrived: float  # the requests that had arrived when it was logged, as best known
    in_flight: int  # running + waiting, as it reported them
    used_blocks: int | None  # the used blocks it reported


def _sglang_demand(
    reading: EngineReading, log: SglangLog | None, arrived: float | None, before: float | None
) -> tuple[SglangLog | None, float | None, float | None]:
    """An SGLang `reading`'s stats log, arrivals, and used blocks to integrate until the next
    poll; given the last `log`, the arrivals counted so far this epoch (`arrived`) and the
    departures at the last poll this epoch (`before`, None at its first). Arrivals are None
    where the reading lacks the request gauges or counter.

    SGLang 0.5.3 sets its scheduler gauges (`sglang:num_running_reqs`, `num_queue_reqs`,
    `num_used_tokens`, `token_usage`) only when its scheduler logs stats: at a new prefill
    batch, every 40 decode steps (`--decode-log-interval`) and after 30 s idle. Its
    `sglang:num_requests_total` rises the moment a request finishes. Between two logs, a
    request that has finished is both departed and, in the stale gauges, still running:
    departed + running counts it twice, and its used tokens would be integrated until the next
    log, up to 30 s after the last request left. So the gauges are read as of their log, which
    a poll sees as new when they differ from the last log's:
    - Arrivals are the departures at the log plus the requests in flight it reported, never
      fewer than the departures now, and never falling within an epoch. The log was written
      at some time since the last poll: the departures then are taken as the last poll's, so
      that a request that finished after the log is not counted twice (one that finished
      before it was counted by an earlier log, or is by the departures now). At an epoch's
      first poll, with no last poll, they are the departures now.
    - Used blocks logged since the last poll are at most a poll interval old and are
      integrated as reported, as vLLM's are: under steady traffic, about as many requests
      arrived since the log (which it cannot show yet) as finished since.
    - At later polls, the blocks held are the log's used blocks in proportion to the requests
      it reported in flight that have not finished since (all of them, while the arrivals
      exceed the departures, where it reported none in flight). Departures since the log are
      counted from the last poll before it (from none at an epoch's first poll): requests that
      the log did not show finishing then make this too low, until the next log, at most 40
      decode steps later while any request runs. What the last requests held stops being
      integrated as they finish, not at the next log, up to 30 s later.
    A new prefill batch is logged before it joins the running batch, so arrivals lag by up to
    one log interval, and the blocks of a request in that interval are not integrated.
    In flight is running + waiting, not the reading's arrivals less departures: the poller's
    `ArrivalCounter` has turned those into a counter that keeps every rise, double counts
    included. That leaves out the grammar queue: such a request is counted when it reaches the
    scheduler's queue (the next log) or finishes.
    SGLang creates `sglang:num_requests_total` when its first request finishes: until then
    (after a start or a restart) no request has departed, so the gauges cannot count a
    departed one and are read as reported, and a log read then had 0 departures.
    """
    running, waiting, departed = reading.running, reading.waiting, reading.requests_departed_total
    if running is None or waiting is None:
        return None, None, reading.used_blocks
    gauges = (running, waiting, reading.used_blocks, reading.occupancy)
    # A server does not lose its counter: without it after a log read with it, this is a new
    # server, whose gauges are a log of its own even where they read the same.
    new = log is None or log.gauges != gauges or (departed is None and log.counted)
    if log is None or new:
        in_flight = running + waiting
        if departed is None:
            fewest = level = 0.0
        elif before is None:
            fewest, level = 0.0, departed
        else:
            fewest = level = min(before, departed)
        log = SglangLog(
            gauges, departed is not None, fewest, level + in_flight, in_flight, reading.used_blocks
        )
    if departed is None:
        return log, None, reading.used_blocks
    arrived = max(arrived or 0.0, log.arrived, departed)
    if new or log.used_blocks is None:
        return log, arrived, reading.used_blocks
    if log.in_flight > 0:
        left = max(log.in_flight - (departed - log.departed), 0.0)
        return log, arrived, log.used_blocks * left / log.in_flight
    return log, arrived, float(log.used_blocks) if arrived > departed else 0.0


_COUNTERS = (
    "prefix_queries_tokens_total",
    "prefix_hits_tokens_total",
    "preemptions_total",
    "requests_departed_total",
)


# The cumulative counters a reading carries, each exported and windowed as `Held` (the TTFT and
# TPOT histograms are exported as read).
_CUMULATIVE = (
    *_COUNTERS,
    "requests_arrived_total",
    "prompt_tokens_arrived_total",
    "kv_block_seconds_total",
)


def _held(
    reading: EngineReading, counters: dict[str, Held]
) -> tuple[EngineReading, dict[str, Held]]:
    """`reading` with each counter as `Held` keeps it (never falling within an epoch), and the
    counters' new state; `counters` is empty at an epoch's first reading."""
    after = dict(counters)
    changed: dict[str, Any] = {}  # all float: every _CUMULATIVE field is `float | None`
    for name in _CUMULATIVE:
        read = getattr(reading, name)
        if read is None:
            continue
        before = counters.get(name)
        after[name] = Held(read) if before is None else before.step(read)
        if after[name].value != read:
            changed[name] = after[name].value
    return (replace(reading, **changed) if changed else reading), after


def _markers(reading: EngineReading) -> dict[str, object]:
    """The instance id and the counters `reading` has (absent ones left out)."""
    found: dict[str, object] = {"instance_id": reading.instance_id}
    found |= {name: getattr(reading, name) for name in _COUNTERS}
    return {k: v for k, v in found.items() if v is not None}


def _restarted(seen: dict[str, object], cur: dict[str, object]) -> bool:
    """A new instance id; without ids on both sides, a counter below its last value seen."""
    if "instance_id" in seen and "instance_id" in cur:
        # Under the same id a counter that falls is that series' glitch (a data-parallel rank
        # gone from vLLM's sum), not a restart, which would count every other counter's whole
        # value as new in the window (arrivals 2,502/s for 1/s). `_held` keeps it from falling.
        return seen["instance_id"] != cur["instance_id"]
    for name in _COUNTERS:
        before, after = seen.get(name), cur.get(name)
        if isinstance(before, float | int) and isinstance(after, float | int) and after < before:
            return True
    return False


@dataclass(frozen=True, slots=True)
class Figures:
    """Everything `/metrics` and `/saturation` show, derived at one instant.

    `reading` and every derived figure are None unless `fresh`. `eta_seconds` is None when the
    forecast is not ready yet and +Inf when usage is not growing.
    """

    engine_up: bool
    fresh: bool
    age_seconds: float | None
    model: str | None
    reading: EngineReading | None
    growth_ratio_per_second: float | None
    growth_blocks_per_second: float | None
    eta_seconds: float | None
    forecast_points: int
    fit_points: int
    hit_ratio: float | None
    preemption_rate_per_second: float | None
    demand: DemandRates | None  # the demand counters' rates over the window (Little's law)
    block_seconds_total: float | None  # the engine's counter, or the sidecar's own integral
    errors: dict[ErrorReason, int]
    restarts_total: int
    last_error: str | None


def figures(state: PollState, cfg: SidecarConfig, now: float) -> Figures:
    """Derive the figures from `state` at monotonic time `now`."""
    age = None if state.last_ok_t is None else max(now - state.last_ok_t, 0.0)
    fresh = state.last_poll_ok and age is not None and age <= cfg.stale_after
    reading = state.last_reading if fresh else None
    slope = blocks_slope = eta = hit_ratio = preempt_rate = block_seconds = None
    demand: DemandRates | None = None
    points = fit_points = 0
    if reading is not None:
        fit_from = now - cfg.forecast_window
        fit = [
            (s.t, s.occupancy) for s in state.samples if s.epoch == state.epoch and s.t >= fit_from
        ]
        fc = forecast_saturation(fit, cfg.min_forecast_points)
        slope, eta = fc.slope_per_second, fc.eta_seconds
        points, fit_points = fc.points, fc.fit_points
        if slope is not None and reading.capacity_blocks is not None:
            blocks_slope = slope * reading.capacity_blocks

        window = [s for s in state.samples if s.t >= now - cfg.window]
        if reading.prefix_cache_enabled is not False:
            hits, queries = _counter(window, "hits"), _counter(window, "queries")
            if hits.times == queries.times:
                hit_ratio = windowed_ratio(hits.values, queries.values, hits.epochs)
        pre = _counter(window, "preemptions")
        preempt_rate = counter_rate(pre.times, pre.values, pre.epochs)
        demand = rates([s.demand for s in window if s.demand is not None])
        last = state.samples[-1].demand if state.samples else None
        block_seconds = None if last is None else last.block_seconds

    return Figures(
        engine_up=state.last_poll_ok,
        fresh=fresh,
        age_seconds=age,
        model=cfg.labels.model or state.known_model,
        reading=reading,
        growth_ratio_per_second=slope,
        growth_blocks_per_second=blocks_slope,
        eta_seconds=eta,
        forecast_points=points,
        fit_points=fit_points,
        hit_ratio=hit_ratio,
        preemption_rate_per_second=preempt_rate,
        demand=demand,
        block_seconds_total=block_seconds,
        errors=dict(state.errors),
        restarts_total=state.restarts_total,
        last_error=state.last_error,
    )


@dataclass(frozen=True, slots=True)
class _Series:
    times: list[float]
    values: list[float]
    epochs: list[int]


def _counter(samples: list[Sample], name: Literal["hits", "queries", "preemptions"]) -> _Series:
    """One counter's samples, skipping those where the source did not report it."""
    rows = [(s.t, v, s.epoch) for s in samples if (v := getattr(s, name)) is not None]
    return _Series([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])


def finite_or_none(value: float | None) -> float | None:
    """JSON has no Inf: map +/-Inf and NaN to None."""
    return value if value is not None and math.isfinite(value) else None
