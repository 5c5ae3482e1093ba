"""What the sidecar remembers between polls, and the figures derived from it at render time.

`PollState` is the only mutable object: the poller records each outcome into it. `figures()` is a
pure function of that state and the clock, so `/metrics` and `/saturation` always agree and a
value older than `stale_after` can never be shown as fresh.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal, get_args

from headroom.contract.demand import CounterSample, DemandRates, rates
from headroom.contract.forecast import counter_rate, forecast_saturation, windowed_ratio
from headroom.sidecar.config import SidecarConfig
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
    integrated_block_seconds: float = 0.0
    # The last value of each restart marker (instance id, counters) in the last reading that
    # had it: a restarted SGLang exports its request counters only after its first request
    # finishes, so comparing with the previous reading alone would miss the fall.
    seen: dict[str, object] = field(default_factory=dict)

    def record_success(self, reading: EngineReading, t: float) -> bool:
        """Keep a good reading taken at monotonic time `t`; returns True if the engine restarted.

        Everything is computed before anything is kept: a reading this raises on leaves the
        state as it was (the poller counts it as an internal error).
        """
        markers = _markers(reading)
        restarted = _restarted(self.seen, markers)
        epoch = self.epoch + 1 if restarted else self.epoch
        integrated = 0.0 if restarted else self.integrated_block_seconds
        if not restarted and self.samples and self.last_reading is not None:
            used = self.last_reading.used_blocks
            if used is not None:
                integrated += used * max(t - self.samples[-1].t, 0.0)
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


_COUNTERS = (
    "prefix_queries_tokens_total",
    "prefix_hits_tokens_total",
    "preemptions_total",
    "requests_departed_total",
)


def _markers(reading: EngineReading) -> dict[str, object]:
    """The instance id and the counters `reading` has (absent ones left out)."""
    found: dict[str, object] = {"instance_id": reading.instance_id}
    found |= {name: getattr(reading, name) for name in _COUNTERS}
    return {k: v for k, v in found.items() if v is not None}


def _restarted(seen: dict[str, object], cur: dict[str, object]) -> bool:
    """A new instance id, or a counter below its last value seen."""
    if "instance_id" in seen and "instance_id" in cur and seen["instance_id"] != cur["instance_id"]:
        return True
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
