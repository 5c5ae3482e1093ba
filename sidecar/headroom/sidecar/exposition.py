"""Reading a stock server's Prometheus text: samples by name, pools, ranks, totals, histograms.

How series from several engines or ranks become one pod, the same rule for vLLM and SGLang:
a KV *pool* is one cache with its own blocks (a vLLM data-parallel engine, one `engine` label
value; an SGLang data-parallel rank, one `dp_rank` value). The pod's figures are those of all
its pools together:
- capacity = the sum of the pools' blocks; occupancy = sum(usage_i * blocks_i) / capacity,
  i.e. the mean of the pools' usage weighted by their size; used = round(occupancy *
  capacity). When any pool's size is unknown: occupancy is the plain mean, blocks unknown.
- request gauges, counters and histogram buckets are summed over the pools.
SGLang's tensor/pipeline/expert-parallel ranks (`tp_rank`, `pp_rank`, `moe_ep_rank`, any other
`*_rank` label but `dp_rank`, and the multiprocess `pid` label) are processes that share one
pool: of their series, only the lowest rank's (rank 0, the one SGLang exports by default) is
read; they are never added up.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from headroom.sidecar.sources import GarbageError, HistogramReading, check_histogram

Labelled = list[tuple[dict[str, str], float]]
PoolKey = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Pool:
    """One KV pool: its usage and, when the source says, its size in blocks."""

    usage: float  # 0..1
    blocks: int | None  # None when the source does not say how big the pool is


def prometheus_samples(text: str, engine: str) -> dict[str, Labelled]:
    """Index every sample by its own name (counters keep `_total`, histograms `_bucket`...).

    A series (name and label set) that appears twice is garbage, whatever its values:
    Prometheus refuses such a scrape, and summing or averaging the copies would make up a
    number the engine never reported.
    """
    out: dict[str, Labelled] = defaultdict(list)
    seen: set[tuple[str, frozenset[tuple[str, str]]]] = set()
    try:
        families: Iterable[Metric] = text_string_to_metric_families(text)
        for family in families:
            for s in family.samples:
                series = (s.name, frozenset(s.labels.items()))
                if series in seen:
                    raise GarbageError(
                        f"{engine} /metrics has a duplicate series: {s.name}{dict(s.labels)}"
                    )
                seen.add(series)
                out[s.name].append((s.labels, float(s.value)))
    except GarbageError:
        raise
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise GarbageError(f"{engine} /metrics is not Prometheus text: {exc}") from exc
    return out


def combine_pools(pools: list[Pool]) -> tuple[float, int | None, int | None]:
    """(occupancy, capacity blocks, used blocks) of all pools together (the rule above)."""
    sizes = [p.blocks for p in pools if p.blocks is not None]
    if len(sizes) == len(pools):
        capacity = sum(sizes)
        occupancy = min(sum(p.usage * b for p, b in zip(pools, sizes, strict=True)) / capacity, 1.0)
        return occupancy, capacity, round(occupancy * capacity)
    return min(sum(p.usage for p in pools) / len(pools), 1.0), None, None


# Engines round their usage (SGLang to two decimals): a little over 1 is a full pool. Far over
# it is no share of a pool (a percent, 37.5, read as a full pool and bought pods), as the
# operator judges occupancy too.
MAX_FRACTION = 1.05


def fraction(value: float, what: str) -> float:
    """A 0..1 usage (up to MAX_FRACTION clamped to 1); NaN, negative or more is garbage."""
    if not math.isfinite(value) or not 0 <= value <= MAX_FRACTION:
        raise GarbageError(f"{what} is not a fraction: {value}")
    return min(value, 1.0)


def count(value: float, what: str) -> float:
    """A non-negative finite number, or garbage."""
    if not math.isfinite(value) or value < 0:
        raise GarbageError(f"{what} is not a non-negative number: {value}")
    return value


def _is_rank_label(name: str) -> bool:
    """A label naming a process within one pool (not a pool of its own)."""
    return name == "pid" or (name.endswith("_rank") and name != "dp_rank")


def pool_key(labels: dict[str, str]) -> PoolKey:
    """The labels that name a pool: all but the rank and process ones."""
    return tuple(sorted((k, v) for k, v in labels.items() if not _is_rank_label(k)))


# Longer than any count or rank an engine labels; int() refuses past 4,300 digits.
_MAX_DIGITS = 18


def is_whole_number(raw: str) -> bool:
    """Whether a label value spells a whole number `int()` reads: ASCII digits (`isdigit()`
    alone also takes "²"), not too many."""
    return raw.isascii() and raw.isdigit() and len(raw) <= _MAX_DIGITS


def _rank_order(labels: dict[str, str]) -> tuple[tuple[str, int, str], ...]:
    ranks = sorted((k, v) for k, v in labels.items() if _is_rank_label(k) and k != "pid")
    if "pid" in labels:  # last: the lowest rank wins whatever its process id
        ranks.append(("pid", labels["pid"]))
    return tuple((k, int(v) if is_whole_number(v) else sys.maxsize, v) for k, v in ranks)


def one_per_pool(series: Labelled | None) -> Labelled:
    """Of the series that differ only in rank labels, keep the lowest rank's."""
    best: dict[PoolKey, tuple[dict[str, str], float]] = {}
    for labels, value in series or ():
        key = pool_key(labels)
        if key not in best or _rank_order(labels) < _rank_order(best[key][0]):
            best[key] = (labels, value)
    return list(best.values())


def by_pool(series: Labelled | None) -> dict[PoolKey, float]:
    """One value per pool (the lowest rank's), keyed by the pool's labels."""
    return {pool_key(labels): value for labels, value in one_per_pool(series)}


def all_series(series: Labelled | None) -> Labelled:
    """Every series as it is (for sources whose series are all pools of their own)."""
    return list(series or ())


def first_present(samples: dict[str, Labelled], names: tuple[str, ...]) -> Labelled | None:
    """The series of the first of `names` the exposition has."""
    for name in names:
        if samples.get(name):
            return samples[name]
    return None


def total(series: Labelled | None, what: str) -> float | None:
    """The sum of the series, None when there are none; garbage if not a non-negative number."""
    if not series:
        return None
    value = sum(v for _, v in series)
    if not math.isfinite(value) or value < 0:
        raise GarbageError(f"{what} sample is not a non-negative number: {value}")
    return value


def as_int(value: float | None) -> int | None:
    """Round a summed gauge to a count."""
    return None if value is None else round(value)


def first_label(samples: dict[str, Labelled], names: tuple[str, ...], label: str) -> str | None:
    """The first non-empty value of `label` on the series of `names`."""
    for name in names:
        for labels, _ in samples.get(name, []):
            if labels.get(label):
                return labels[label]
    return None


def first_label_int(series: Labelled, label: str) -> int | None:
    """The first value of `label` that is a whole number."""
    for labels, _ in series:
        raw = labels.get(label, "")
        if is_whole_number(raw):
            return int(raw)
    return None


def first_histogram(
    samples: dict[str, Labelled],
    names: tuple[str, ...],
    select: Callable[[Labelled | None], Labelled],
) -> HistogramReading | None:
    """The first of `names` with buckets, summed over the series `select` keeps."""
    for name in names:
        buckets = select(samples.get(f"{name}_bucket"))
        if buckets:
            return _histogram(name, buckets, select(samples.get(f"{name}_sum")))
    return None


def _histogram(name: str, buckets: Labelled, sums: Labelled) -> HistogramReading:
    by_bound: dict[float, float] = defaultdict(float)
    for labels, value in buckets:
        try:
            bound = float(labels.get("le", "nan"))
        except ValueError:
            bound = math.nan
        by_bound[bound] += value
    if any(math.isnan(b) for b in by_bound):
        raise GarbageError(f"{name}: a bucket has no `le` bound")
    n = by_bound.pop(math.inf, None)
    if n is None:
        raise GarbageError(f"{name}: no +Inf bucket")
    bounds = tuple(sorted(by_bound))
    reading = HistogramReading(
        bounds=bounds,
        counts=tuple(by_bound[b] for b in bounds),
        sum=total(sums, f"{name}_sum") or 0.0,
        count=n,
    )
    check_histogram(reading, name)
    return reading
