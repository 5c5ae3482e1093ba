"""Saturation forecast and windowed ratios: pure functions over the sidecar's recent samples.

Method. Every poll adds a point (t, occupancy), t on the sidecar's monotonic clock and
occupancy = used / capacity (evictable prefix-cache blocks count as free, as in the metric
contract). The forecast reads the points of the last `forecast_window` seconds (30 s by
default) *since the engine last restarted*. A restart drops usage to zero, and a fit across
that drop would forecast shrinking usage while the new instance is in fact filling up.

1. Least squares over the window. The growth rate is the ordinary least-squares slope
   `sum((t - mean_t) * (y - mean_y)) / sum((t - mean_t) ** 2)` in occupancy per second. Block
   usage moves in steps: a prefill grabs many blocks at once, a finished request frees them.
   A line through every point averages the steps into the trend, while a two-point difference
   would swing between zero and a cliff.
2. Segmented, for spikes. A window that holds a flat stretch and then the start of a spike
   averages the two, and under-reads the new growth several times over. Exactly when it
   matters, the forecast would be late. So the fit also tries every break point that leaves
   at least `min_segment` points on each side, and fits the two sides separately (prefix sums
   make this O(n)). If the two-line model explains the points better by the Bayesian
   information criterion, the slope of the recent segment is used. The criterion is
   `n ln(SSE / n) + 1.5 k ln n`, with k = 5 parameters for two lines and a break against 2 for
   one. The penalty is 1.5 times BIC's because the search tries every split, and with the plain
   penalty noise alone sometimes wins a split. Measured on a steady 0.5 %/s ramp with 0.5 %
   noise, the plain penalty cut one run in 20 at 20 s of data and read a 170 % error; 1.5
   cut none. The stairs of bursty allocation do not cut the window either.

From the slope, with y the latest observed occupancy (the cliff is measured from where the cache
is now, not from where the fitted line says it should be):

    eta = (1 - y) / slope     when slope > 0 and y < 1
    eta = 0                   when y >= 1 (already full)
    eta = +Inf                when slope <= 0 (not growing)

The forecast needs at least `min_points` points spanning a non-zero time. Before that there is
no forecast at all, which is not the same as "+Inf". bench/sidecar.py measures the accuracy,
plain against segmented, on synthetic ramps.

Counters (prefix-cache queries and hits, preemptions) are cumulative in the engine. Their
increase over the window follows Prometheus's `increase()` reset rule: a value lower than its
predecessor means the counter restarted from zero, so the new value itself is the increase.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Point = tuple[float, float]

# Growth below this (occupancy per second: over 30 years to fill) is "not growing"; it also
# absorbs the rounding residue a perfectly flat series leaves in the prefix sums.
MIN_GROWTH_PER_SECOND = 1e-9
# Residual floor per point, so that a perfectly straight series (SSE 0) has a finite BIC.
_SSE_FLOOR = 1e-12
# Multiplier on BIC's k ln n penalty (see the module docstring).
_PENALTY = 1.5


@dataclass(frozen=True, slots=True)
class LineFit:
    """An OLS line over some points: slope, intercept at t = 0, and residual sum of squares."""

    slope: float
    intercept: float
    sse: float
    n: int
    sxx: float = 0.0  # sum of squared deviations of t: the slope's leverage

    @property
    def slope_stderr(self) -> float:
        """The slope's standard error (infinite with fewer than three points)."""
        if self.n < 3 or self.sxx <= 0:
            return math.inf
        return math.sqrt(self.sse / (self.n - 2) / self.sxx)


class _Sums:
    """Prefix sums of t, y, t*t, t*y, y*y: an OLS fit of any contiguous run in O(1)."""

    def __init__(self, points: Sequence[Point]) -> None:
        # Centre t so the squares stay small whatever the monotonic clock reads.
        t0 = points[0][0] if points else 0.0
        self.acc: list[tuple[float, float, float, float, float]] = [(0.0, 0.0, 0.0, 0.0, 0.0)]
        st = sy = stt = sty = syy = 0.0
        for t, y in points:
            u = t - t0
            st, sy, stt, sty, syy = st + u, sy + y, stt + u * u, sty + u * y, syy + y * y
            self.acc.append((st, sy, stt, sty, syy))
        self.t0 = t0

    def fit(self, i: int, j: int) -> LineFit | None:
        """The OLS line through points[i:j]; None with fewer than two distinct times."""
        n = j - i
        if n < 2:
            return None
        a, b = self.acc[i], self.acc[j]
        st, sy, stt, sty, syy = (b[k] - a[k] for k in range(5))
        sxx = stt - st * st / n
        if sxx <= 1e-12:
            return None
        sxy = sty - st * sy / n
        slope = sxy / sxx
        sse = max(syy - sy * sy / n - slope * sxy, 0.0)
        intercept = sy / n - slope * st / n - slope * self.t0
        return LineFit(slope, intercept, sse, n, sxx)


def least_squares(points: Sequence[Point]) -> LineFit | None:
    """The OLS line through `points`; None with fewer than two distinct times."""
    return _Sums(points).fit(0, len(points))


def least_squares_slope(points: Sequence[Point]) -> float | None:
    """The OLS slope dy/dt through `points`; None with fewer than two distinct times."""
    fit = least_squares(points)
    return None if fit is None else fit.slope


def _bic(sse: float, n: int, params: int) -> float:
    return n * math.log(max(sse, n * _SSE_FLOOR) / n) + _PENALTY * params * math.log(n)


def recent_trend(points: Sequence[Point], min_segment: int = 5) -> LineFit | None:
    """The line the forecast extrapolates: the whole window's OLS line, or, when a two-segment
    fit wins by BIC, the line through the recent segment (see the module docstring)."""
    sums = _Sums(points)
    n = len(points)
    whole = sums.fit(0, n)
    if whole is None or n < 2 * min_segment:
        return whole
    best: tuple[float, LineFit] | None = None
    for k in range(min_segment, n - min_segment + 1):
        before, after = sums.fit(0, k), sums.fit(k, n)
        if before is None or after is None:
            continue
        sse = before.sse + after.sse
        if best is None or sse < best[0]:
            best = (sse, after)
    if best is not None and _bic(best[0], n, 5) < _bic(whole.sse, n, 2):
        return best[1]
    return whole


def saturation_eta(occupancy: float, slope_per_second: float) -> float:
    """Seconds until occupancy reaches 1.0 at `slope_per_second`; +Inf when not growing."""
    if occupancy >= 1.0:
        return 0.0
    if slope_per_second <= MIN_GROWTH_PER_SECOND or not math.isfinite(slope_per_second):
        return math.inf
    return (1.0 - occupancy) / slope_per_second


@dataclass(frozen=True, slots=True)
class Forecast:
    """A saturation forecast; `slope_per_second` and `eta_seconds` are None when not ready.

    `points` is how many points the window held, `fit_points` how many the slope was fitted
    over (fewer when a recent change of trend cut the window).
    """

    points: int
    fit_points: int
    slope_per_second: float | None
    eta_seconds: float | None

    @property
    def ready(self) -> bool:
        """Whether enough points existed to fit a slope."""
        return self.eta_seconds is not None


def forecast_saturation(
    points: Sequence[Point], min_points: int = 3, segmented: bool = True, min_segment: int = 5
) -> Forecast:
    """Fit the occupancy series (one engine instance, oldest first) and forecast saturation."""
    if len(points) < max(min_points, 2):
        return Forecast(len(points), 0, None, None)
    fit = recent_trend(points, min_segment) if segmented else least_squares(points)
    if fit is None:
        return Forecast(len(points), 0, None, None)
    return Forecast(len(points), fit.n, fit.slope, saturation_eta(points[-1][1], fit.slope))


def counter_increase(values: Sequence[float], epochs: Sequence[int] | None = None) -> float:
    """Total increase of a cumulative counter over `values` (oldest first), across resets.

    `epochs`, when given, marks the restarts: a change of epoch is a reset even if the new
    value happens not to be lower than the old one, and a fall within an epoch (one series of a
    sum gone, in the same process) adds nothing. Without them, any fall is a reset.
    """
    total = 0.0
    for i in range(1, len(values)):
        prev, cur = values[i - 1], values[i]
        if epochs is not None and epochs[i] != epochs[i - 1]:
            total += cur
        elif cur < prev:
            total += 0.0 if epochs is not None else cur
        else:
            total += cur - prev
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
