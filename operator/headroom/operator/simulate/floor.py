"""The clairvoyant floor: the fewest GPU-hours any autoscaler could spend on a trace.

A yardstick, not a policy. It knows every request in advance and packs KV perfectly: a step
needs the pods that hold its in-flight blocks at 100 % and its sequences at the batch cap, with
sequences free to move between pods and a removed pod gone at once. A pod is still paid from
the moment it is asked for, `pod_start` before it serves. It may leave up to `allowed` seconds
short. Every real policy pays for fragmentation, watermarks and draining on top, so its cost
on the same trace is at least this (up to requests a real policy delays, which hold fewer
blocks while they wait).
"""

from __future__ import annotations

import math

import numpy as np

from headroom.operator.simulate.replay import DT, graded_steps, in_flight
from headroom.operator.simulate.trace import Trace
from headroom.operator.simulate.world import PodShape


def pods_needed(trace: Trace, shape: PodShape, steps: int) -> np.ndarray:
    """Per step, the pods that hold what is in flight with perfect packing."""
    blocks, seqs = in_flight(trace, shape, steps)
    return np.maximum(
        np.ceil(blocks / shape.capacity_blocks), np.ceil(seqs / shape.max_num_seqs)
    ).astype(int)


def floor_pod_seconds(
    need: np.ndarray, start: int, lo: int, hi: int, start_steps: int, allowed_steps: int
) -> float:
    """The least pod-seconds over `need` (pods per DT step) for ready pods in [lo, hi], from
    `start` ready pods, each new pod paid `start_steps` steps before it serves, short of `need`
    on at most `allowed_steps` steps. Exact: a dynamic program over (pods, steps short)."""
    if not 0 <= lo <= hi or start_steps < 0 or allowed_steps < 0:
        raise ValueError(f"bad bounds: lo={lo} hi={hi} start_steps={start_steps}")
    n = np.arange(hi + 1, dtype=float)[:, None]
    cost = np.full((hi + 1, allowed_steps + 1), math.inf)
    cost[min(max(start, 0), hi), 0] = 0.0
    up = start_steps * DT
    for k in need:
        # Reach n' from n <= n' paying `up` per pod added, or from n >= n' for nothing.
        grow = np.minimum.accumulate(cost - up * n, axis=0) + up * n
        shrink = np.minimum.accumulate(cost[::-1], axis=0)[::-1]
        best = np.minimum(grow, shrink)
        best[:lo] = math.inf
        short = n[:, 0] < k
        nxt = np.full_like(best, math.inf)
        nxt[~short] = best[~short]
        nxt[short, 1:] = best[short, :-1]
        cost = nxt + n * DT
    return float(cost.min())


def clairvoyant_floor(
    trace: Trace, shape: PodShape, start: int, lo: int, hi: int, allowed: float
) -> float:
    """The floor in GPU-hours over the trace (from t = 0), `allowed` seconds short at most."""
    need = pods_needed(trace, shape, graded_steps(trace))
    seconds = floor_pod_seconds(
        need, start, lo, hi, round(shape.pod_start / DT), int(allowed // DT)
    )
    return seconds * shape.gpus / 3600
