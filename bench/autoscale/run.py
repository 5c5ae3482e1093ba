"""Run every policy at every target on every seed of a trace, in worker processes."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from statistics import NormalDist

from bench.autoscale.frontier import FLOOR, Run
from bench.autoscale.policies import HPA, Oracle, cpu_metric, kv_metric
from bench.autoscale.traces import BenchTrace
from headroom.operator.simulate.replay import (
    DT,
    HeadroomPolicy,
    ScalingPolicy,
    demand_curve,
    opening_replicas,
    policy_at,
    replay,
    shape_for,
)
from headroom.operator.simulate.sweep import SERVE_MEDIAN_SECONDS, Realization, realization_floor
from headroom.operator.simulate.trace import Trace
from headroom.operator.simulate.world import PodShape

POLICIES = ("headroom", "kv-threshold-hpa", "cpu-hpa", "oracle")
BASELINES = ("kv-threshold-hpa", "cpu-hpa")
# The oracle's sweep goes on past the grid so that its cheapest zero-second target is found,
# not the grid's edge.
ORACLE_BEYOND = (0.96, 0.97, 0.98, 0.99)
# headroom's knob is its service level: the quantile of the demand forecast the pools must
# hold (with the mean allowed up to 95 %). The grid is spread over it evenly in standard
# deviations of the band, from 0 (size to the mean forecast) at the grid's 0.50 to 2.58 (the
# 99.5th percentile) at its 0.95.
GRID_LOW, GRID_HIGH, Z_HIGH = 0.50, 0.95, 2.5758


def service_level(target: float) -> float:
    """The forecast quantile headroom runs at for one grid value."""
    z = Z_HIGH * (target - GRID_LOW) / (GRID_HIGH - GRID_LOW)
    return NormalDist().cdf(z)


def run_unit(unit: tuple[BenchTrace, int, tuple[float, ...]]) -> list[Run]:
    """Every policy at every target on one (trace, seed): the same requests for all of them."""
    bt, seed, grid = unit
    return run_policies(bt, seed, grid, POLICIES, floor=True)


def run_policies(
    bt: BenchTrace, seed: int, grid: Sequence[float], labels: Sequence[str], floor: bool
) -> list[Run]:
    """`labels` (of POLICIES) at every target on one (trace, seed), opening with the pods the
    trace's opening needs and at least the spec's minReplicas; with `floor`, the seed's
    clairvoyant floor beside them."""
    trace = bt.requests(seed)
    shape = shape_for(bt.spec)
    demand = demand_curve(trace, shape, int(trace.arrival[-1] / DT) + 2)
    lo, hi = bt.spec.scaling.min_replicas, bt.spec.scaling.max_replicas
    start = max(lo, opening_replicas(trace, shape))
    out = []
    for label in labels:
        for target in (*grid, *ORACLE_BEYOND) if label == "oracle" else grid:
            policy: ScalingPolicy
            if label == "headroom":
                policy = HeadroomPolicy(policy_at(bt.spec, service_level(target)))
            elif label == "kv-threshold-hpa":
                policy = HPA(kv_metric, target, lo, hi)
            elif label == "cpu-hpa":
                policy = HPA(cpu_metric, target, lo, hi)
            else:
                policy = Oracle(demand, target, shape.capacity_blocks, shape.pod_start, lo, hi)
            r = replay(trace, shape, policy, start)
            out.append(Run(**asdict(r), trace=bt.name, policy=label, target=target, seed=seed))
    if floor:
        out.append(floor_run(bt, seed, trace, shape, start))
    return out


def floor_run(bt: BenchTrace, seed: int, trace: Trace, shape: PodShape, start: int) -> Run:
    """The seed's clairvoyant floor as a row beside the runs: its GPU-hours, and the seconds
    it was allowed short (the serving bound's median) in place of measured ones."""
    cost = realization_floor(Realization(seed, trace, start), bt.spec, shape)
    return Run(
        limited_seconds=SERVE_MEDIAN_SECONDS, saturated_seconds=0.0, queued_seconds=0.0,
        preemptions=0, gpu_hours=cost, actions=0, peak_replicas=0, rejected=0,
        pod_starts=0, cancelled_starts=0, trace=bt.name, policy=FLOOR, target=0.0, seed=seed,
    )  # fmt: skip


def run_all(
    traces: Sequence[BenchTrace], grid: Sequence[float], seeds: Sequence[int], workers: int
) -> list[Run]:
    """Every (trace, seed) unit, spread over `workers` processes."""
    units = [(bt, seed, tuple(grid)) for bt in traces for seed in seeds]
    if workers <= 1:
        return [r for u in units for r in run_unit(u)]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return [r for rows in pool.map(run_unit, units) for r in rows]
