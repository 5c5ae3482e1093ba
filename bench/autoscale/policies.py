"""The policies headroom is compared with: Kubernetes' HPA on a per-pod metric (KV occupancy,
as the peers recommend, or CPU), and an oracle that knows the future."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

import numpy as np

from headroom.operator.simulate.replay import DT, TICK
from headroom.operator.simulate.world import Pod, World


def kv_metric(world: World, p: Pod) -> float:
    """A pod's KV occupancy."""
    return p.blocks / world.shape.capacity_blocks


def cpu_metric(world: World, p: Pod) -> float:
    """Host CPU follows the batch's token rate, blind to how much KV each sequence holds."""
    return 0.15 + 0.85 * p.seqs / 170


class HPA:
    """Kubernetes HPA v2 on a per-pod utilization metric: desired = ceil(sum of ready pods'
    metric / target), 10 % tolerance, not-ready pods at 0 on scale-up, scale-up at most
    max(4 pods, 100 %) per step, 300 s scale-down stabilization."""

    def __init__(
        self,
        metric: Callable[[World, Pod], float],
        target: float,
        min_replicas: int,
        max_replicas: int,
    ) -> None:
        self.metric, self.target = metric, target
        self.lo, self.hi = min_replicas, max_replicas
        self.recommendations: deque[tuple[float, int]] = deque()

    def observe(self, world: World, now: float) -> None:
        """Warm-up: recommend (filling the stabilization window), act on nothing."""
        self(world, now)

    def __call__(self, world: World, now: float) -> int:
        current = world.replicas()
        ready = [p for p in world.pods if p.ready(now)]
        if not ready:
            return current
        usage = sum(self.metric(world, p) for p in ready)
        ratio = usage / (len(ready) * self.target)
        if abs(ratio - 1) <= 0.1:
            desired = current
        elif ratio > 1:
            # replica_calculator.go (calcPlainMetricReplicas): on a scale-up, pods still
            # starting count at 0 and the tolerance and direction are checked again on that
            # ratio; within them the count stays.
            rebalanced = usage / (current * self.target)
            desired = current if rebalanced <= 1.1 else math.ceil(usage / self.target)
        else:
            desired = math.ceil(usage / self.target)
        # The window keeps recommendations before the rate limit, and a recommendation exactly
        # 300 s old has left it (stabilizeRecommendationWithBehaviors: timestamp.After(cutoff)).
        self.recommendations.append((now, desired))
        while self.recommendations and self.recommendations[0][0] <= now - 300:
            self.recommendations.popleft()
        if desired < current:
            desired = min(current, max(r for _, r in self.recommendations))
        desired = min(desired, current + max(4, current))
        return max(self.lo, min(self.hi, desired))


class Oracle:
    """Perfect foresight of KV demand (every request admitted on arrival): asks `pod_start +
    TICK` ahead for the pods that keep the coming peak at the target, releases them as soon as
    the future allows."""

    def __init__(
        self, demand: np.ndarray, target: float, capacity: int, pod_start: float, lo: int, hi: int
    ) -> None:
        self.demand, self.target, self.capacity = demand, target, capacity
        self.ahead = int((pod_start + TICK) / DT)
        self.lo, self.hi = lo, hi

    def observe(self, world: World, now: float) -> None:
        """Nothing to learn: it already knows the future."""

    def __call__(self, world: World, now: float) -> int:
        step = int(now / DT)
        hi = min(len(self.demand), step + self.ahead + 1)
        peak = float(self.demand[step:hi].max()) if hi > step else 0.0
        return max(self.lo, min(self.hi, math.ceil(peak / (self.capacity * self.target))))
