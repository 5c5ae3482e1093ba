"""Turn what an engine answers into one `EngineReading`: headroom's `/stats` or vLLM's `/metrics`.

Both parsers are pure: bytes in, a reading out, or `GarbageError` when the body is not something
the sidecar can trust (invalid JSON, a schema version it does not know, an exposition without
the KV usage gauge). The poller turns a `GarbageError` into `headroom_engine_up 0`.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from headroom.engine.stats import STATS_SCHEMA_VERSION, Histogram, StatsSnapshot

SourceKind = Literal["headroom", "vllm"]


class GarbageError(ValueError):
    """The engine answered, but with a body the sidecar cannot interpret."""


@dataclass(frozen=True, slots=True)
class HistogramReading:
    """A cumulative histogram: `counts[i]` observations <= `bounds[i]`; `count` includes +Inf."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    sum: float
    count: float


@dataclass(frozen=True, slots=True)
class EngineReading:
    """One poll's worth of engine state, the same shape whatever the source.

    A field is None when the source does not report it (vLLM has no cached-block count, and its
    block counts are known only when `vllm:cache_config_info` carries `num_gpu_blocks`).
    """

    source: SourceKind
    model: str | None
    instance_id: str | None  # changes when the engine restarts
    occupancy: float  # used / capacity, 0..1; evictable cached blocks count as free
    capacity_blocks: int | None
    used_blocks: int | None
    free_blocks: int | None
    cached_blocks: int | None
    block_size: int | None
    bytes_per_token: int | None
    prefix_cache_enabled: bool | None
    prefix_queries_tokens_total: float | None
    prefix_hits_tokens_total: float | None
    running: int | None
    waiting: int | None
    swapped: int | None
    preemptions_total: float | None
    ttft: HistogramReading | None = None
    tpot: HistogramReading | None = None


def parse_headroom_stats(body: bytes) -> EngineReading:
    """Parse a headroom engine's `GET /stats` body (a `StatsSnapshot`)."""
    try:
        snap = StatsSnapshot.model_validate_json(body)
    except ValidationError as exc:
        raise GarbageError(f"/stats body is not a StatsSnapshot: {_first_error(exc)}") from exc
    if snap.version != STATS_SCHEMA_VERSION:
        raise GarbageError(
            f"/stats schema version {snap.version} is unknown (this sidecar reads version "
            f"{STATS_SCHEMA_VERSION})"
        )
    kv = snap.kv
    if kv.free + kv.used + kv.cached != kv.capacity:
        raise GarbageError(
            f"/stats blocks do not add up: free {kv.free} + used {kv.used} + cached {kv.cached}"
            f" != capacity {kv.capacity}"
        )
    return EngineReading(
        source="headroom",
        model=snap.model,
        instance_id=snap.instance_id,
        occupancy=kv.occupancy,
        capacity_blocks=kv.capacity,
        used_blocks=kv.used,
        free_blocks=kv.free,
        cached_blocks=kv.cached,
        block_size=kv.block_size,
        bytes_per_token=kv.bytes_per_token,
        prefix_cache_enabled=snap.prefix_cache.enabled,
        prefix_queries_tokens_total=float(snap.prefix_cache.queries_tokens_total),
        prefix_hits_tokens_total=float(snap.prefix_cache.hits_tokens_total),
        running=snap.requests.running,
        waiting=snap.requests.waiting,
        swapped=snap.requests.swapped,
        preemptions_total=float(snap.preemptions_total),
        ttft=_engine_histogram(snap.time_to_first_token_seconds, "time_to_first_token_seconds"),
        tpot=_engine_histogram(snap.time_per_output_token_seconds, "time_per_output_token_seconds"),
    )


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or "body"
    return f"{where}: {err.get('msg', 'invalid')}"


def _engine_histogram(hist: Histogram | None, name: str) -> HistogramReading | None:
    if hist is None:
        return None
    if len(hist.buckets) != len(hist.counts):
        raise GarbageError(
            f"/stats {name}: {len(hist.buckets)} buckets but {len(hist.counts)} counts"
        )
    reading = HistogramReading(
        bounds=tuple(float(b) for b in hist.buckets),
        counts=tuple(float(c) for c in hist.counts),
        sum=float(hist.sum),
        count=float(hist.count),
    )
    _check_histogram(reading, name)
    return reading


def _check_histogram(h: HistogramReading, name: str) -> None:
    if any(b2 <= b1 for b1, b2 in itertools.pairwise(h.bounds)):
        raise GarbageError(f"{name}: bucket bounds are not increasing")
    cumulative = (*h.counts, h.count)
    if any(c2 < c1 for c1, c2 in itertools.pairwise(cumulative)) or (
        cumulative and cumulative[0] < 0
    ):
        raise GarbageError(f"{name}: bucket counts are not cumulative")


# vLLM renamed its KV gauge and prefix counters across releases; the first name present wins.
_VLLM_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_VLLM_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
_VLLM_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")


def parse_vllm_metrics(text: str) -> EngineReading:
    """Parse a stock vLLM server's `/metrics` exposition into a reading.

    Data-parallel servers export one series per `engine` label: counts and counters are summed,
    KV usage is averaged (the engines' pools are the same size, so the mean is the pod's usage).
    """
    samples = _vllm_samples(text)
    usage = _first_present(samples, _VLLM_USAGE)
    if usage is None:
        raise GarbageError(f"vLLM /metrics has none of {', '.join(_VLLM_USAGE)}")
    values = [v for _, v in usage]
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise GarbageError(f"vLLM KV usage is not a fraction: {values}")
    occupancy = min(sum(values) / len(values), 1.0)

    config = samples.get("vllm:cache_config_info", [])
    num_blocks = _sum_label_int(config, "num_gpu_blocks")
    block_size = _first_label_int(config, "block_size")
    capacity = num_blocks if num_blocks else None
    used = round(occupancy * capacity) if capacity is not None else None
    model = _first_label(samples, "model_name")
    start = samples.get("process_start_time_seconds")
    return EngineReading(
        source="vllm",
        model=model,
        instance_id=repr(start[0][1]) if start else None,
        occupancy=occupancy,
        capacity_blocks=capacity,
        used_blocks=used,
        free_blocks=capacity - used if capacity is not None and used is not None else None,
        cached_blocks=None,
        block_size=block_size,
        bytes_per_token=None,
        prefix_cache_enabled=_prefix_caching_flag(config),
        prefix_queries_tokens_total=_total(_first_present(samples, _VLLM_QUERIES)),
        prefix_hits_tokens_total=_total(_first_present(samples, _VLLM_HITS)),
        running=_int(_total(samples.get("vllm:num_requests_running"))),
        waiting=_int(_total(samples.get("vllm:num_requests_waiting"))),
        swapped=_int(_total(samples.get("vllm:num_requests_swapped"))),
        preemptions_total=_total(samples.get("vllm:num_preemptions_total")),
        ttft=_vllm_histogram(samples, "vllm:time_to_first_token_seconds"),
        tpot=_vllm_histogram(samples, "vllm:time_per_output_token_seconds"),
    )


Labelled = list[tuple[dict[str, str], float]]


def _vllm_samples(text: str) -> dict[str, Labelled]:
    """Index every sample by its own name (counters keep `_total`, histograms `_bucket`...)."""
    out: dict[str, Labelled] = defaultdict(list)
    try:
        families: Iterable[Metric] = text_string_to_metric_families(text)
        for family in families:
            for s in family.samples:
                out[s.name].append((s.labels, float(s.value)))
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise GarbageError(f"vLLM /metrics is not Prometheus text: {exc}") from exc
    return out


def _first_present(samples: dict[str, Labelled], names: tuple[str, ...]) -> Labelled | None:
    for name in names:
        if samples.get(name):
            return samples[name]
    return None


def _total(series: Labelled | None) -> float | None:
    if not series:
        return None
    total = sum(v for _, v in series)
    if not math.isfinite(total) or total < 0:
        raise GarbageError(f"vLLM sample is not a non-negative number: {total}")
    return total


def _int(value: float | None) -> int | None:
    return None if value is None else round(value)


def _first_label(samples: dict[str, Labelled], label: str) -> str | None:
    for name in _VLLM_USAGE:
        for labels, _ in samples.get(name, []):
            if labels.get(label):
                return labels[label]
    return None


def _label_ints(series: Labelled, label: str) -> list[int]:
    out = []
    for labels, _ in series:
        raw = labels.get(label, "")
        if raw.isdigit():
            out.append(int(raw))
    return out


def _sum_label_int(series: Labelled, label: str) -> int | None:
    # One cache_config_info series per engine under data parallelism: their pools add up.
    values = _label_ints(series, label)
    return sum(values) if values else None


def _first_label_int(series: Labelled, label: str) -> int | None:
    values = _label_ints(series, label)
    return values[0] if values else None


def _prefix_caching_flag(series: Labelled) -> bool | None:
    for labels, _ in series:
        raw = labels.get("enable_prefix_caching")
        if raw is not None:
            return raw.lower() == "true"
    return None


def _vllm_histogram(samples: dict[str, Labelled], name: str) -> HistogramReading | None:
    buckets = samples.get(f"{name}_bucket")
    if not buckets:
        return None
    by_bound: dict[float, float] = defaultdict(float)
    for labels, value in buckets:
        by_bound[float(labels.get("le", "nan"))] += value
    if any(math.isnan(b) for b in by_bound):
        raise GarbageError(f"{name}: a bucket has no `le` bound")
    count = by_bound.pop(math.inf, None)
    if count is None:
        raise GarbageError(f"{name}: no +Inf bucket")
    bounds = tuple(sorted(by_bound))
    reading = HistogramReading(
        bounds=bounds,
        counts=tuple(by_bound[b] for b in bounds),
        sum=_total(samples.get(f"{name}_sum")) or 0.0,
        count=count,
    )
    _check_histogram(reading, name)
    return reading
