"""Traffic made from a rate shape, for benchmarks and tests: launch spike, compressed day,
flash crowd. Arrivals are a Poisson process whose rate follows the shape times a bursty factor
(log-normal, `burst` sigma, one-minute memory: real traffic is burstier than Poisson), prompts
of 1,000-5,000 tokens and outputs of 200-1,800."""

from __future__ import annotations

import math

import numpy as np

from headroom.operator.simulate.trace import Trace

SHAPES = ("spike", "diurnal", "flash-crowd")
STEP = 2.0  # seconds per rate sample
BURSTINESS = 0.08
SECONDS = 7200.0  # two hours: the compressed day, and room before and after each event


def rate(name: str, seconds: float, base: float = 2.0) -> np.ndarray:
    """Requests/s per STEP over `seconds` for one of SHAPES."""
    t = np.arange(0, seconds, STEP)
    if name == "spike":
        # A launch: traffic ramps to 4x over 6 minutes, holds 20 minutes, ramps back.
        up = np.clip((t - 1800) / 360, 0, 1)
        down = np.clip((t - 1800 - 360 - 1200) / 360, 0, 1)
        out: np.ndarray = base * (1 + 3 * (up - down))
        return out
    if name == "diurnal":
        # A day compressed 12x into two hours (so its ramps are 12x steeper than a real day's):
        # night at 0.5x, the morning ramp to 3.5x in 8 minutes, a lunch dip, an afternoon peak
        # and a 30-minute evening decline.
        knots_min = [0, 20, 28, 50, 60, 80, 110, 120]
        level = [0.5, 0.5, 3.5, 3.0, 3.5, 3.5, 0.5, 0.5]
        day: np.ndarray = base * np.interp(t / 60, knots_min, level)
        return day
    if name == "flash-crowd":
        # A link goes viral: 6x within a minute, decaying with a 10-minute time constant.
        rise = np.clip((t - 1500) / 60, 0, 1)
        decay = np.exp(-np.clip(t - 1560, 0, None) / 600)
        crowd: np.ndarray = base * (1 + 5 * rise * decay)
        return crowd
    raise ValueError(f"unknown traffic shape {name!r}; known: {', '.join(SHAPES)}")


def synthetic(name: str, seed: int, seconds: float = SECONDS, burst: float = BURSTINESS) -> Trace:
    """One realization of a shape's traffic."""
    r = rate(name, seconds)
    rng = np.random.default_rng(seed)
    k = math.exp(-STEP / 60.0)
    x = np.empty(len(r))
    x[0] = 0.0
    shocks = rng.normal(0.0, burst * math.sqrt(1 - k * k), len(r))
    for i in range(1, len(r)):
        x[i] = k * x[i - 1] + shocks[i]
    counts = rng.poisson(r * np.exp(x - burst * burst / 2) * STEP)
    steps = np.repeat(np.arange(len(r)), counts)
    t = (steps + rng.uniform(0, 1, len(steps))) * STEP
    t.sort()
    n = len(t)
    return Trace(name, t, rng.integers(1000, 5001, n), rng.integers(200, 1801, n))
