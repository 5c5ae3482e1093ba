"""Saturation forecast and windowed ratios: pure functions over the sidecar's recent samples.

Method. Every poll adds a point (t, occupancy), t on the sidecar's monotonic clock and
occupancy = used / capacity (evictable prefix-cache blocks count as free, as in the metric
contract). Over the last `forecast_window` seconds of points *since the engine last restarted*
the growth rate is the ordinary least-squares slope

    slope = sum((t - mean_t) * (y - mean_y)) / sum((t - mean_t) ** 2)        (occupancy / s)

A fit over the whole window rather than the last two points is what makes it robust: block
usage moves in steps (a prefill grabs many blocks at once, a finished request frees them), and
the slope of a line through every point averages the steps into the trend while a two-point
difference would swing from zero to a cliff. Points from before a restart are excluded because
a restart drops usage to zero, and a fit across that drop would forecast shrinking usage where
the new instance is in fact filling up. The forecast needs at least `min_points` points
spanning a non-zero time; before that there is no forecast at all (not "+Inf").

From the slope, with y the latest observed occupancy (the cliff is measured from where the cache
is now, not from where the fitted line says it should be):

    eta = (1 - y) / slope     when slope > 0 and y < 1
    eta = 0                   when y >= 1 (already full)
    eta = +Inf                when slope <= 0 (not growing)

Counters (prefix-cache queries and hits, preemptions) are cumulative in the engine; their
increase over the window follows Prometheus's `increase()` reset rule: a value lower than its
predecessor means the counter restarted from zero, so the new value itself is the increase.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Point = tuple[float, float]


def least_squares_slope(points: Sequence[Point]) -> float | None:
    """The OLS slope dy/dt through `points`; None with fewer than two distinct times."""
    n = len(points)
    if n < 2:
        return None
    mean_t = sum(t for t, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((t - mean_t) ** 2 for t, _ in points)
    if sxx <= 0.0:
        return None
    sxy = sum((t - mean_t) * (y - mean_y) for t, y in points)
    return sxy / sxx


def saturation_eta(occupancy: float, slope_per_second: float) -> float:
    """Seconds until occupancy reaches 1.0 at `slope_per_second`; +Inf when not growing."""
    if occupancy >= 1.0:
        return 0.0
    if slope_per_second <= 0.0 or not math.isfinite(slope_per_second):
        return math.inf
    return (1.0 - occupancy) / slope_per_second


@dataclass(frozen=True, slots=True)
class Forecast:
    """A saturation forecast; `slope_per_second` and `eta_seconds` are None when not ready."""

    points: int
    slope_per_second: float | None
    eta_seconds: float | None

    @property
    def ready(self) -> bool:
        """Whether enough points existed to fit a slope."""
        return self.eta_seconds is not None


def forecast_saturation(points: Sequence[Point], min_points: int = 3) -> Forecast:
    """Fit the occupancy series (one engine instance, oldest first) and forecast saturation."""
    if len(points) < max(min_points, 2):
        return Forecast(len(points), None, None)
    slope = least_squares_slope(points)
    if slope is None:
        return Forecast(len(points), None, None)
    return Forecast(len(points), slope, saturation_eta(points[-1][1], slope))


def counter_increase(values: Sequence[float], epochs: Sequence[int] | None = None) -> float:
    """Total increase of a cumulative counter over `values` (oldest first), across resets.

    `epochs`, when given, marks known restarts: a change of epoch is a reset even if the new
    value happens not to be lower than the old one.
    """
    total = 0.0
    for i in range(1, len(values)):
        prev, cur = values[i - 1], values[i]
        reset = cur < prev or (epochs is not None and epochs[i] != epochs[i - 1])
        total += cur if reset else cur - prev
    return total


def windowed_ratio(
    hits: Sequence[float], queries: Sequence[float], epochs: Sequence[int] | None = None
) -> float | None:
    """hits / queries over the window from cumulative counters; None when nothing was queried."""
    asked = counter_increase(queries, epochs)
    if asked <= 0.0:
        return None
    found = counter_increase(hits, epochs)
    return min(max(found / asked, 0.0), 1.0)


def counter_rate(
    times: Sequence[float], values: Sequence[float], epochs: Sequence[int] | None = None
) -> float | None:
    """Per-second increase of a counter over the window; None with under two samples."""
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return counter_increase(values, epochs) / (times[-1] - times[0])
