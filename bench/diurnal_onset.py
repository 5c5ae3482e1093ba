"""Diurnal's morning ramp against the pod start: how soon after the ramp begins a policy must
order its second pod, and how much evidence it has by then. Informational (exit 0).

The autoscaling bench's diurnal trace climbs from 0.5x to 3.5x in 8 minutes while the
deployment runs one pod, and a pod takes 120 s to start. For each of the bench's 20 seeds this
takes the KV demand every request would hold if admitted on arrival and counts the seconds it
exceeds the opening pods' usable pools (capacity less the admission watermark) before pods
ordered at one of the first decisions after the onset are ready: the shortfall of a policy that
orders at that decision and orders enough. It approximates the KV-limited seconds such a policy
would be charged (requests that wait hold fewer blocks; growth past the watermark holds more).
Beside it, the evidence by then: the ramp's extra arrivals over the night's rate, in standard
deviations of the night's count over the same time (Poisson, plus the trace's log-normal
burstiness, which holds for about a minute). Last, when headroom's `decide()` orders its first
pod after the onset, replayed at the grid's two ends.

Then what does serve it: a standing reserve. Every policy of the autoscaling bench but the CPU
HPA (it serves no trace) replayed again at `minReplicas: 2` (the bench holds 1 for all of them)
on the same seeds and grid, each opening with at least 2 pods, and each one's cheapest setting
that serves, priced as the bench prices diurnal's (against the kv-HPA, and the oracle's cheapest
zero-second setting). `headroom simulate` finds such a reserve when nothing serves.

Run: .venv/bin/python -m bench.diurnal_onset
"""

from __future__ import annotations

import math
import os
import statistics
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace as with_fields

import numpy as np

from bench.autoscale.frontier import (
    Claim,
    Run,
    cost_claim,
    frontier_claim,
    oracle_claim,
    points,
)
from bench.autoscale.run import run_policies, service_level
from bench.autoscale.traces import TRACES, BenchTrace
from bench.autoscale_sim import GRID, SEEDS
from headroom.operator.simulate.replay import (
    DT,
    TICK,
    HeadroomPolicy,
    demand_curve,
    opening_replicas,
    policy_at,
    replay,
    shape_for,
)
from headroom.operator.simulate.sweep import (
    SERVE_MEDIAN_SECONDS,
    SERVE_WORST_SECONDS,
    with_min_replicas,
)
from headroom.operator.simulate.synthetic import BURSTINESS, SECONDS, STEP, rate
from headroom.operator.simulate.trace import Trace
from headroom.operator.simulate.world import PodShape, World

DECISIONS = 6  # rows: ordering at each of the first decisions after the onset
RESERVE = 2  # the standing reserve replayed: minReplicas one above the autoscaling bench's
RESERVE_POLICIES = ("headroom", "kv-threshold-hpa", "oracle")


def shortfall_seconds(demand: np.ndarray, usable: float, onset: float, ready: float) -> float:
    """Seconds in [onset, ready) whose demand (blocks per DT step from t = 0) exceeds `usable`."""
    lo, hi = int(onset / DT), max(int(onset / DT), int(ready / DT))
    return float(np.count_nonzero(demand[lo:hi] > usable) * DT)


def excess_z(rates: np.ndarray, onset: float, delay: float, burst: float) -> tuple[float, float]:
    """Arrivals above the onset's rate in [onset, onset + delay] (`rates` per STEP from t = 0),
    and that excess in standard deviations of the baseline count over the same time."""
    lo, hi = int(onset / STEP), int((onset + delay) / STEP)
    base = float(rates[lo])
    excess = float((rates[lo:hi] - base).sum() * STEP)
    count = base * delay
    sd = math.sqrt(count + (burst * count) ** 2)
    return excess, excess / sd if sd > 0 else 0.0


def first_order(
    bt: BenchTrace, trace: Trace, shape: PodShape, start: int, target: float, onset: float
) -> float | None:
    """Seconds after `onset` at which headroom's decide() first asks for more than `start`
    pods on this realization."""
    seen: list[float] = []

    def tick(now: float, world: World) -> None:
        if now >= onset and not seen and world.replicas() > start:
            seen.append(now - onset)

    replay(trace, shape, HeadroomPolicy(policy_at(bt.spec, service_level(target))), start,
           on_tick=tick)  # fmt: skip
    return seen[0] if seen else None


def main() -> int:
    bt = next(b for b in TRACES if b.name == "diurnal")
    shape = shape_for(bt.spec)
    r = rate(bt.source, SECONDS)
    # The shape is piecewise linear: its ramp starts at the last sample before the first rise.
    onset = float((np.argmax(r > r[0] * 1.0001) - 1) * STEP)
    usable = shape.capacity_blocks - shape.watermark_blocks
    print(
        f"diurnal, {bt.spec.model.preset} on {bt.spec.gpu.type} x{shape.gpus} per pod: {usable:,} "
        f"usable KV blocks per pod, pod start {shape.pod_start:.0f} s, decisions every "
        f"{TICK:.0f} s; the ramp begins at {onset:.0f} s ({r[0]:.1f} -> {r.max():.1f} req/s)"
    )
    runs, walls = [], []
    for seed in SEEDS:
        trace = bt.requests(seed)
        d = demand_curve(trace, shape, int(trace.arrival[-1] / DT) + 2)
        start = opening_replicas(trace, shape)
        over = np.nonzero(d[int(onset / DT) :] > start * usable)[0]
        runs.append((trace, d, start))
        walls.append(float(over[0] * DT) if len(over) else math.inf)
    starts = [start for _, _, start in runs]
    print(
        f"opening pods {min(starts)}-{max(starts)}; their pools fill "
        f"{min(walls):.0f}-{max(walls):.0f} s after the onset (median "
        f"{statistics.median(walls):.0f} s) when every request is admitted on arrival"
    )
    print()
    print("decision  ordered  ready  short s med  short s worst  serves  extra arrivals    z")
    first = TICK * (math.floor(onset / TICK) + 1)  # decisions fall on multiples of TICK
    for k in range(DECISIONS):
        order = first + k * TICK
        short = [
            shortfall_seconds(d, start * usable, onset, order + shape.pod_start)
            for _, d, start in runs
        ]
        med, worst = statistics.median(short), max(short)
        serves = med <= SERVE_MEDIAN_SECONDS and worst <= SERVE_WORST_SECONDS
        excess, z = excess_z(r, onset, order - onset, BURSTINESS)
        print(
            f"{k + 1:8d}  +{order - onset:4.0f} s  +{order + shape.pod_start - onset:3.0f} s  "
            f"{med:11.1f}  {worst:13.1f}  {'yes' if serves else 'no':6s}  {excess:14.1f}  {z:4.1f}"
        )
    print()
    for target in (GRID[0], GRID[-1]):
        seen = [first_order(bt, trace, shape, start, target, onset) for trace, _, start in runs]
        got = [x for x in seen if x is not None]
        print(
            f"headroom at {target:.2f} (forecast p{service_level(target) * 100:.1f}): first "
            f"scale-out after the onset at +{statistics.median(got):.0f} s median "
            f"(+{min(got):.0f} to +{max(got):.0f} s over {len(got)} of {len(seen)} seeds)"
        )
    print()
    reserve_table(bt)
    print("informational: no target, exit 0")
    return 0


def reserve_unit(unit: tuple[BenchTrace, int]) -> list[Run]:
    """RESERVE_POLICIES over the grid on one seed of `unit`'s trace (its spec's minReplicas
    held)."""
    bt, seed = unit
    return run_policies(bt, seed, GRID, RESERVE_POLICIES, floor=False)


def reserve_claims(runs: list[Run], name: str) -> list[tuple[str, Claim]]:
    """The bench's claims on diurnal against these policies, graded as the bench grades them."""
    head, hpa, oracle = (points(runs, name, p) for p in RESERVE_POLICIES)
    return [
        ("cost vs kv-threshold-hpa", cost_claim(head, hpa, "kv-threshold-hpa", oracle)),
        ("frontier vs kv-threshold-hpa", frontier_claim(head, hpa, "kv-threshold-hpa")),
        ("cost vs the oracle", oracle_claim(head, oracle)),
    ]


def reserve_table(bt: BenchTrace) -> None:
    """Every policy but the CPU HPA at minReplicas RESERVE, graded by the bench's cost claims."""
    held = with_fields(bt, spec=with_min_replicas(bt.spec, RESERVE))
    with ProcessPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        runs = [r for rows in pool.map(reserve_unit, [(held, s) for s in SEEDS]) for r in rows]
    print(
        f"a standing reserve: minReplicas {RESERVE} for every policy (the autoscaling bench "
        f"holds {bt.spec.scaling.min_replicas}), each opening with at least {RESERVE} pods; "
        f"{len(SEEDS)} seeds, the bench's grid, graded as the bench grades diurnal "
        "(informational here)"
    )
    for what, claim in reserve_claims(runs, bt.name):
        print(f"  {what}: {'PASS' if claim.ok else 'MISS'}: {claim.text}")


if __name__ == "__main__":
    raise SystemExit(main())
