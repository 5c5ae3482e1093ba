"""`headroom simulate`'s sweep: one spec replayed at several forecast quantiles on the same seeded
realizations of a trace, and the cheapest setting that serves.

A seed is one realization of the recorded traffic (`scaled(trace, rate, seed, JITTER_SECONDS)`:
every request moved by up to +-5 s, copied as the rate says), the same for every setting, as in
the autoscaling bench. A setting serves when its median KV-limited seconds are <= 30 and its
worst seed's <= 120, the bench's service level.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from headroom.operator.bounds import clamp
from headroom.operator.crd.models import InferenceDeploymentSpec
from headroom.operator.reconcile.sizing import Sizing
from headroom.operator.scaling.decide import Policy
from headroom.operator.simulate.floor import clairvoyant_floor
from headroom.operator.simulate.progress import Progress
from headroom.operator.simulate.replay import (
    HeadroomPolicy,
    Result,
    opening_replicas,
    policy_at,
    replay,
    shape_for,
)
from headroom.operator.simulate.trace import Trace, scaled
from headroom.operator.simulate.world import PodShape, World

JITTER_SECONDS = 5.0
SERVE_MEDIAN_SECONDS = 30.0
SERVE_WORST_SECONDS = 120.0


@dataclass(frozen=True)
class Setting:
    """One forecast quantile, the policy it makes, and one result per seed (with the requests
    of that seed's realization the engine refuses: longer than its max model length)."""

    quantile: float
    policy: Policy
    seeds: tuple[int, ...]
    results: tuple[Result, ...]
    refused: tuple[int, ...]

    def _values(self, attr: str) -> list[float]:
        if attr == "refused":
            return [float(n) for n in self.refused]
        return [float(getattr(r, attr)) for r in self.results]

    def median(self, attr: str) -> float:
        """The median over the seeds of one `Result` figure (or of `refused`)."""
        return float(statistics.median(self._values(attr)))

    def worst(self, attr: str) -> float:
        """The largest over the seeds of one `Result` figure (or of `refused`)."""
        return max(self._values(attr))

    @property
    def serves(self) -> bool:
        """Median KV-limited seconds <= 30 and the worst seed's <= 120."""
        return (
            self.median("limited_seconds") <= SERVE_MEDIAN_SECONDS
            and self.worst("limited_seconds") <= SERVE_WORST_SECONDS
        )


def policies(
    spec: InferenceDeploymentSpec, sizing: Sizing, quantiles: Sequence[float]
) -> tuple[Policy, ...]:
    """The policy at each quantile (raises ValueError when the spec's scaling makes none)."""
    return tuple(policy_at(spec, q, sizing) for q in quantiles)


@dataclass(frozen=True)
class Realization:
    """One seed's realization of the trace and the pods every replay of it opens with."""

    seed: int
    trace: Trace
    start: int


def realize(
    trace: Trace,
    shape: PodShape,
    seeds: Sequence[int],
    rate: float,
    bounds: tuple[int, int] | None = None,
) -> tuple[Realization, ...]:
    """Each seed's realization (`scaled`, as the autoscaling bench's), made once for the sweep
    and the floors alike. It opens with the pods its opening needs, within the spec's
    (minReplicas, maxReplicas) `bounds`: no deployed operator runs outside them."""
    out = []
    for s in seeds:
        run = scaled(trace, rate, s, JITTER_SECONDS)
        start = opening_replicas(run, shape)
        if bounds is not None:
            start = clamp(start, *bounds)
        out.append(Realization(s, run, start))
    return tuple(out)


def sweep(
    runs: Sequence[Realization],
    spec: InferenceDeploymentSpec,
    sizing: Sizing,
    quantiles: Sequence[float],
    progress: Progress | None = None,
    label: str = "",
) -> tuple[Setting, ...]:
    """Replay every (quantile, realization) through the operator's `decide()` on the spec's
    pods (`label` leads each progress line)."""
    shape = shape_for(spec, sizing)
    seeds = tuple(r.seed for r in runs)
    # The requests longer than the engine's max model length, from the trace itself: the
    # same ones Result.rejected counts as the graded replay meets them (its warm-up's copies
    # are not graded).
    refused = tuple(
        int(((r.trace.prompt + r.trace.output) > shape.max_model_len).sum()) for r in runs
    )
    out = []
    total = len(quantiles) * len(runs)
    for i, (q, policy) in enumerate(zip(quantiles, policies(spec, sizing, quantiles), strict=True)):
        results = []
        for j, run in enumerate(runs):
            what = f"[{i * len(runs) + j + 1}/{total}] {label}forecastQuantile {q:.2f}"
            what += f", seed {run.seed}"
            end = float(run.trace.arrival[-1])

            def tick(now: float, _world: World, what: str = what, end: float = end) -> None:
                if progress is not None:
                    progress.update(what, now, end)

            if progress is not None:
                progress.start(what)
            r = replay(run.trace, shape, HeadroomPolicy(policy), run.start, on_tick=tick,
                       interval=policy.interval_seconds)  # fmt: skip
            if progress is not None:
                progress.done(
                    f"{what}: {r.gpu_hours:.2f} GPU-hours, {r.limited_seconds:.0f} KV-limited s"
                )
            results.append(r)
        out.append(Setting(q, policy, seeds, tuple(results), refused))
    return tuple(out)


def cheapest_serving(settings: Sequence[Setting]) -> Setting | None:
    """The setting that serves at the lowest median GPU-hours (None when none serves)."""
    ok = [s for s in settings if s.serves]
    return min(ok, key=lambda s: (s.median("gpu_hours"), s.quantile)) if ok else None


@dataclass(frozen=True)
class Reserve:
    """The sweep again with a higher minReplicas: a standing reserve of pods, for ramps that
    outrun a pod's start (no forecast orders a pod soon enough on evidence a burst also gives)."""

    min_replicas: int
    settings: tuple[Setting, ...]

    @property
    def best(self) -> Setting | None:
        """Its cheapest setting that serves."""
        return cheapest_serving(self.settings)


def serving(reserves: Sequence[Reserve]) -> Reserve | None:
    """The reserve that serves: the last one tried, when it does (the search stops there)."""
    return reserves[-1] if reserves and reserves[-1].best is not None else None


def pick(best: Setting | None, reserves: Sequence[Reserve]) -> Setting | None:
    """What to deploy: the cheapest setting that serves at the spec's minReplicas, else the
    serving reserve's."""
    held = serving(reserves)
    return best or (held.best if held is not None else None)


def capped(settings: Sequence[Setting]) -> bool:
    """Whether the highest quantile asked for maxReplicas on some seed: then more pods at the
    peak, not a reserve or a higher quantile, are what is missing."""
    top = max(settings, key=lambda s: s.quantile)
    return top.worst("peak_replicas") >= top.policy.max_replicas


def reserve_limit(settings: Sequence[Setting], spec: InferenceDeploymentSpec) -> int:
    """The largest minReplicas a reserve search tries: the most pods the highest quantile asked
    for on any seed (holding them all along is a fixed deployment); the spec's own minReplicas
    (no search) when that quantile reached maxReplicas."""
    top = max(settings, key=lambda s: s.quantile)
    lo = spec.scaling.min_replicas
    return lo if capped(settings) else max(lo, round(top.worst("peak_replicas")))


def search_reserve(
    runs: Sequence[Realization],
    spec: InferenceDeploymentSpec,
    sizing: Sizing,
    quantiles: Sequence[float],
    limit: int,
    progress: Progress | None = None,
) -> tuple[Reserve, ...]:
    """The sweep at minReplicas + 1, + 2, ... up to `limit` (each a whole sweep), on the same
    realizations (each opening with at least that many pods), stopping at the first that
    serves or whose highest quantile reached maxReplicas; every reserve tried, in order."""
    out: list[Reserve] = []
    for n in range(spec.scaling.min_replicas + 1, limit + 1):
        held = with_min_replicas(spec, n)
        opened = [replace(r, start=max(r.start, n)) for r in runs]
        settings = sweep(opened, held, sizing, quantiles, progress, f"minReplicas {n}, ")
        out.append(Reserve(n, settings))
        if out[-1].best is not None or capped(settings):
            break
    return tuple(out)


def with_min_replicas(spec: InferenceDeploymentSpec, n: int) -> InferenceDeploymentSpec:
    """The spec with `n` as its minReplicas (at least 1 and within its maxReplicas, as the CRD
    and the policy require)."""
    if not 1 <= n <= spec.scaling.max_replicas:
        raise ValueError(f"minReplicas {n} is outside [1, {spec.scaling.max_replicas}]")
    scaling = spec.scaling.model_copy(update={"min_replicas": n})
    return spec.model_copy(update={"scaling": scaling})


def floors(
    runs: Sequence[Realization], spec: InferenceDeploymentSpec, sizing: Sizing
) -> tuple[float, ...]:
    """Each realization's clairvoyant floor: the fewest GPU-hours any autoscaler could spend on
    it, at most the serving median's seconds short (`headroom.operator.simulate.floor`)."""
    shape = shape_for(spec, sizing)
    return tuple(realization_floor(r, spec, shape) for r in runs)


def realization_floor(run: Realization, spec: InferenceDeploymentSpec, shape: PodShape) -> float:
    """One realization's clairvoyant floor on `shape` pods within the spec's replica bounds,
    at most the serving median's seconds short (this CLI's and the autoscaling bench's)."""
    lo, hi = spec.scaling.min_replicas, spec.scaling.max_replicas
    return clairvoyant_floor(run.trace, shape, run.start, lo, hi, SERVE_MEDIAN_SECONDS)


def floor_median(floors: Sequence[float]) -> float | None:
    """The floors' median; None when there are none or a seed has none (it needs more than
    maxReplicas pods)."""
    if not floors or not all(math.isfinite(f) for f in floors):
        return None
    return float(statistics.median(floors))
