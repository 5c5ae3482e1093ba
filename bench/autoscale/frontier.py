"""Cost/KV-limited-seconds frontiers and the claims graded on them (issue 20).

A policy's setting (one target) is a `Point` over the seeds: its median (or worst-seed)
GPU-hours and KV-limited seconds. A frontier maps a cost c to the fewest seconds any setting
reaches at a cost <= c.

Graded, per trace:
- **Cost at the service level** (spike, diurnal and the real traces): the cheapest setting
  whose median KV-limited seconds are <= 30 and whose worst seed is <= 120 ("serves"). headroom's
  must cost <= 0.85x each HPA's (where an HPA has none, headroom must still have one) and
  <= 1.25x the oracle's cheapest setting with 0 s on every seed.
- **Frontier** (all traces): headroom's median frontier is at or below each HPA's at every cost
  where that HPA's median KV-limited seconds are under 600, and at least 30 % below it at one.

Beside them, ungraded, each seed's clairvoyant floor (`headroom.operator.simulate.floor`): the
fewest GPU-hours any policy could spend leaving at most 30 s short, knowing every request and
packing KV perfectly. A bound below it asks for the impossible.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from headroom.operator.simulate.replay import Result

# The service level is `headroom simulate`'s, so the bench grades what the CLI recommends.
from headroom.operator.simulate.sweep import (
    SERVE_MEDIAN_SECONDS,
    SERVE_WORST_SECONDS,
    floor_median,
)

VS_HPA = 0.85
VS_ORACLE = 1.25
FRONTIER_CEILING_SECONDS = 600.0
FRONTIER_MARGIN = 0.30
FLOOR = "floor"  # the policy name of the clairvoyant floor's rows


@dataclass(frozen=True)
class Run(Result):
    """One replay's figures, with what it was: (trace, policy, target, seed)."""

    trace: str
    policy: str
    target: float
    seed: int


@dataclass(frozen=True)
class Point:
    """One (trace, policy, target) over its seeds."""

    policy: str
    target: float
    runs: tuple[Run, ...]

    def figure(self, attr: str, case: str = "median") -> float:
        values = [float(getattr(r, attr)) for r in self.runs]
        return statistics.median(values) if case == "median" else max(values)

    @property
    def cost(self) -> float:
        """Median GPU-hours."""
        return self.figure("gpu_hours")

    @property
    def seconds(self) -> float:
        """Median KV-limited seconds."""
        return self.figure("limited_seconds")

    @property
    def serves(self) -> bool:
        """Median <= 30 s and worst seed <= 120 s of KV-limited time."""
        return (
            self.seconds <= SERVE_MEDIAN_SECONDS
            and self.figure("limited_seconds", "worst") <= SERVE_WORST_SECONDS
        )


def points(runs: list[Run], trace: str, policy: str) -> list[Point]:
    """The settings of one policy on one trace, by target."""
    by: dict[float, list[Run]] = {}
    for r in runs:
        if r.trace == trace and r.policy == policy:
            by.setdefault(r.target, []).append(r)
    return [Point(policy, t, tuple(rs)) for t, rs in sorted(by.items())]


def frontier(pts: list[Point]) -> list[Point]:
    """The Pareto frontier on medians, cheapest first: each point beats every cheaper one."""
    out: list[Point] = []
    best = math.inf
    for p in sorted(pts, key=lambda p: (p.cost, p.seconds)):
        if p.seconds < best:
            out.append(p)
            best = p.seconds
    return out


def at(front: list[Point], cost: float) -> float:
    """The fewest median seconds at a median cost <= `cost` (infinite when none is that cheap)."""
    hit = [p.seconds for p in front if p.cost <= cost]
    return min(hit) if hit else math.inf


def cheapest_serving(pts: list[Point]) -> Point | None:
    """The cheapest setting that serves (see `Point.serves`)."""
    ok = [p for p in pts if p.serves]
    return min(ok, key=lambda p: p.cost) if ok else None


def cheapest_zero(pts: list[Point]) -> Point | None:
    """The cheapest setting with 0 KV-limited seconds on every seed."""
    ok = [p for p in pts if p.figure("limited_seconds", "worst") == 0]
    return min(ok, key=lambda p: p.cost) if ok else None


@dataclass(frozen=True)
class Claim:
    """One claim: whether it holds, the numbers that say so, and whether it is graded (one
    with nothing to measure is printed, not graded)."""

    ok: bool
    text: str
    graded: bool = True


def floor_cost(pts: list[Point]) -> float | None:
    """The clairvoyant floor's median over the seeds, from its rows (None without them, or
    where a seed needs more than max replicas)."""
    return floor_median([r.gpu_hours for r in pts[0].runs]) if pts else None


def cost_claim(
    head: list[Point],
    hpa: list[Point],
    hpa_name: str,
    oracle: list[Point] | None = None,
    floor: float | None = None,
) -> Claim:
    """headroom's cheapest serving setting costs <= VS_HPA x the HPA's. With the oracle's
    points, the text also says how far perfect foresight gets against the same HPA, and with
    the floor, how far the clairvoyant floor lies below it (the verdict stands either way)."""
    h, b = cheapest_serving(head), cheapest_serving(hpa)
    if h is None:
        what = "none" if b is None else f"{b.cost:.2f} GPU-h @{b.target:.2f}"
        return Claim(False, f"headroom has no serving setting ({hpa_name}: {what})")
    if b is None:
        return Claim(True, f"headroom {h.cost:.2f} GPU-h @{h.target:.2f}; {hpa_name} has none")
    ratio = h.cost / b.cost
    text = (
        f"headroom {h.cost:.2f} GPU-h @{h.target:.2f} vs {hpa_name} {b.cost:.2f} @{b.target:.2f}"
        f" = {ratio:.2f}x (<= {VS_HPA:.2f}x)"
    )
    o = cheapest_serving(oracle) if oracle else None
    if o is not None:
        reach = o.cost / b.cost
        text += f"; the oracle's cheapest serving setting is {reach:.2f}x" + (
            ": even its foresight does not reach the bound here" if reach > VS_HPA else ""
        )
    if floor is not None:
        # Three places: a floor just under the bound (mooncake's 0.846x) must not print as it.
        text += f"; the clairvoyant floor is {floor / b.cost:.3f}x" + (
            ": the bound is below even that" if floor > VS_HPA * b.cost else ""
        )
    return Claim(ratio <= VS_HPA, text)


def oracle_claim(head: list[Point], oracle: list[Point]) -> Claim:
    """headroom's cheapest serving setting costs <= VS_ORACLE x the oracle's cheapest 0 s (its
    cheapest serving setting when even foresight cannot avoid a few seconds: a long prompt that
    waits for one pod to have its blocks free)."""
    h, o = cheapest_serving(head), cheapest_zero(oracle)
    which = "0 s"
    if o is None:
        o, which = cheapest_serving(oracle), "serving (no 0 s setting)"
    if h is None or o is None:
        return Claim(False, "headroom has no serving setting" if h is None else "no oracle point")
    ratio = h.cost / o.cost
    return Claim(
        ratio <= VS_ORACLE,
        f"headroom {h.cost:.2f} GPU-h vs the oracle's cheapest {which} {o.cost:.2f} "
        f"@{o.target:.2f} = {ratio:.2f}x (<= {VS_ORACLE:.2f}x)",
    )


def frontier_claim(head: list[Point], hpa: list[Point], hpa_name: str) -> Claim:
    """At or below the HPA's frontier wherever the HPA's median is under 600 s, and at least
    30 % below it at some cost (both frontiers are step functions of cost, compared at every
    cost either policy has a setting at). Where the HPA never loses a second and headroom
    matches it, there is nothing to be below: the claim is printed, not graded."""
    fh, fb = frontier(head), frontier(hpa)
    above = [
        f"{p.cost:.2f} GPU-h: {hpa_name} {p.seconds:.0f} s, headroom {at(fh, p.cost):.0f} s"
        for p in fb
        if p.seconds < FRONTIER_CEILING_SECONDS and at(fh, p.cost) > p.seconds
    ]
    where = "above at " + "; ".join(above) if above else "at or below wherever it is under 600 s"
    if not above and hpa and all(p.seconds == 0 for p in hpa):
        return Claim(
            True,
            f"{where}; nothing to be below: {hpa_name} has 0 KV-limited seconds at every setting "
            "(the traffic never fills these pods: a smaller pod (--spec) or a higher --rate "
            "makes it a test)",
            graded=False,
        )
    best_gain, best_at = -math.inf, "nowhere"
    for cost in sorted({p.cost for p in fh + fb}):
        mine, theirs = at(fh, cost), at(fb, cost)
        if theirs > 0 and math.isfinite(theirs) and math.isfinite(mine):
            gain = (theirs - mine) / theirs
            if gain > best_gain:
                best_gain = gain
                best_at = f"{cost:.2f} GPU-h ({hpa_name} {theirs:.0f} s, headroom {mine:.0f} s)"
    gap = f"{best_gain:.0%} below at {best_at}" if math.isfinite(best_gain) else "never below"
    return Claim(not above and best_gain >= FRONTIER_MARGIN, f"{where}; largest gap {gap}")
