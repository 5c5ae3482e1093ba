"""Turn what an engine answers into one `EngineReading`: headroom's `/stats`, or the `/metrics`
exposition of a stock vLLM or SGLang server.

The parsers are pure: bytes or text in, a reading out, or `GarbageError` when the body is not
something the sidecar can trust (invalid JSON, a schema version it does not know, an exposition
without the KV usage gauge). The poller turns a `GarbageError` into `headroom_engine_up 0`.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from headroom.contract.report import SourceKind
from headroom.contract.stats import STATS_SCHEMA_VERSION, Histogram, StatsSnapshot


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

    A field is None when the source does not report it (vLLM and SGLang have no cached-block
    count; vLLM's block counts are known only when `vllm:cache_config_info` carries
    `num_gpu_blocks`, SGLang's only when it exports `sglang:max_total_num_tokens`).
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


# Prometheus sources (vLLM, SGLang): how series from several engines or ranks become one pod.
#
# A KV *pool* is one cache with its own blocks: a vLLM data-parallel engine (one `engine` label
# value), an SGLang data-parallel rank (one `dp_rank` value). The pod's figures are those of
# all its pools together, the same rule for both engines:
# - capacity = the sum of the pools' blocks; occupancy = sum(usage_i * blocks_i) / capacity,
#   i.e. the mean of the pools' usage weighted by their size; used = round(occupancy *
#   capacity). When any pool's size is unknown: occupancy is the plain mean, blocks unknown.
# - request gauges, counters and histogram buckets are summed over the pools.
# SGLang's tensor/pipeline/expert-parallel ranks (`tp_rank`, `pp_rank`, `moe_ep_rank`, any other
# `*_rank` label but `dp_rank`, and the multiprocess `pid` label) are processes that share one
# pool: of their series, only the lowest rank's (rank 0, the one SGLang exports by default) is
# read; they are never added up.

# vLLM renamed its KV gauge, prefix counters and TPOT histogram across releases (0.9: gpu_*
# names; 0.10-0.11: both; 0.12: the new ones only); the first name present wins.
_VLLM_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_VLLM_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
_VLLM_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
_VLLM_TPOT = ("vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds")

Labelled = list[tuple[dict[str, str], float]]
PoolKey = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class _Pool:
    usage: float  # 0..1
    blocks: int | None  # None when the source does not say how big the pool is


def parse_vllm_metrics(text: str) -> EngineReading:
    """Parse a stock vLLM server's `/metrics` exposition into a reading.

    Every `engine` label value is one data-parallel engine with its own KV pool, paired with the
    `vllm:cache_config_info` series of the same `engine` for its `num_gpu_blocks`. The pools
    combine by the rule above: blocks and request counts are summed over the engines, occupancy
    is the capacity-weighted mean of their usage (the plain mean when block counts are unknown).
    """
    samples = _prometheus_samples(text, "vLLM")
    usage = _first_present(samples, _VLLM_USAGE)
    if usage is None:
        raise GarbageError(f"vLLM /metrics has none of {', '.join(_VLLM_USAGE)}")
    config = samples.get("vllm:cache_config_info", [])
    occupancy, capacity, used = _combine_pools(_vllm_pools(usage, config))
    start = samples.get("process_start_time_seconds")
    return EngineReading(
        source="vllm",
        model=_first_label(samples, _VLLM_USAGE, "model_name"),
        instance_id=repr(start[0][1]) if start else None,
        occupancy=occupancy,
        capacity_blocks=capacity,
        used_blocks=used,
        free_blocks=capacity - used if capacity is not None and used is not None else None,
        cached_blocks=None,
        block_size=_first_label_int(config, "block_size"),
        bytes_per_token=None,
        prefix_cache_enabled=_prefix_caching_flag(config),
        prefix_queries_tokens_total=_total(_first_present(samples, _VLLM_QUERIES), "queries"),
        prefix_hits_tokens_total=_total(_first_present(samples, _VLLM_HITS), "hits"),
        running=_int(_total(samples.get("vllm:num_requests_running"), "running")),
        waiting=_int(_total(samples.get("vllm:num_requests_waiting"), "waiting")),
        swapped=_int(_total(samples.get("vllm:num_requests_swapped"), "swapped")),
        preemptions_total=_total(samples.get("vllm:num_preemptions_total"), "preemptions"),
        ttft=_first_histogram(samples, ("vllm:time_to_first_token_seconds",), _all_series),
        tpot=_first_histogram(samples, _VLLM_TPOT, _all_series),
    )


def _vllm_pools(usage: Labelled, config: Labelled) -> list[_Pool]:
    """One pool per usage series, sized from the `cache_config_info` series of its `engine`.

    Sizes are used only when usage and config series pair one to one (by `engine`, or a single
    series on each side whatever its labels); otherwise every size is unknown.
    """
    engines = [(labels.get("engine", ""), _fraction(v, "vLLM KV usage")) for labels, v in usage]
    blocks: dict[str, int] = {}
    duplicated = False
    for labels, _ in config:
        raw = labels.get("num_gpu_blocks", "")
        if raw.isdigit() and int(raw) > 0:
            key = labels.get("engine", "")
            duplicated = duplicated or key in blocks
            blocks[key] = int(raw)
    names = [e for e, _ in engines]
    if not duplicated and len(set(names)) == len(names):
        if set(names) == blocks.keys():
            return [_Pool(u, blocks[e]) for e, u in engines]
        if len(engines) == 1 and len(blocks) == 1:
            return [_Pool(engines[0][1], next(iter(blocks.values())))]
    return [_Pool(u, None) for _, u in engines]


# SGLang's TPOT histogram became inter-token latency; retractions (SGLang's preemptions) are a
# counter in current releases, `sglang:num_retracted_requests_total`. The older
# `sglang:num_retracted_reqs` is a gauge of the requests retracted since the scheduler's last
# stats log (reset at every log), not a running total: it is read only where it is typed as a
# counter (`sglang:num_retracted_reqs_total`), never summed up by the sidecar.
_SGLANG_TPOT = ("sglang:time_per_output_token_seconds", "sglang:inter_token_latency_seconds")
_SGLANG_RETRACTIONS = ("sglang:num_retracted_requests_total", "sglang:num_retracted_reqs_total")


def parse_sglang_metrics(text: str, page_size: int = 1) -> EngineReading:
    """Parse an SGLang server's `/metrics` (started with `--enable-metrics`) into a reading.

    SGLang counts its KV pool in tokens: blocks are tokens // `page_size` (SGLang's
    `--page-size`, 1 by default). Occupancy is `sglang:token_usage`, which already counts the
    radix cache's evictable tokens as free; capacity is `sglang:max_total_num_tokens` (unknown
    on releases that do not export it). Prefix-cache counters are the prompt and cached tokens
    of finished requests (`sglang:prompt_tokens_total`, `sglang:cached_tokens_total`), reported
    only as a pair; the per-batch `sglang:cache_hit_rate` gauge is not a windowed ratio and is
    not read. Ranks and data-parallel pools combine by the rule above.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be at least 1, got {page_size}")
    samples = _prometheus_samples(text, "SGLang")
    usage = _by_pool(samples.get("sglang:token_usage"))
    used_tokens = _by_pool(samples.get("sglang:num_used_tokens"))
    max_tokens = {
        k: _count(v, "sglang:max_total_num_tokens")
        for k, v in _by_pool(samples.get("sglang:max_total_num_tokens")).items()
    }
    keys = list(usage) or [k for k in used_tokens if max_tokens.get(k)]
    if not keys:
        raise GarbageError(
            "SGLang /metrics has no sglang:token_usage (is the server started with "
            "--enable-metrics? its scheduler first exports it after a batch or 30 s idle)"
        )
    pools = []
    for key in keys:
        tokens = max_tokens.get(key)
        if key in usage:
            fraction = _fraction(usage[key], "SGLang token usage")
        else:  # no token_usage gauge: used / max, both known and max > 0 (see `keys`)
            fraction = _fraction(used_tokens[key] / (tokens or 1.0), "SGLang token usage")
        pools.append(_Pool(fraction, (int(tokens) // page_size or None) if tokens else None))
    occupancy, capacity, used = _combine_pools(pools)
    queries = _total(_one_per_pool(samples.get("sglang:prompt_tokens_total")), "prompt tokens")
    hits = _total(_one_per_pool(samples.get("sglang:cached_tokens_total")), "cached tokens")
    if queries is None or hits is None:
        queries = hits = None
    retractions = _first_present(samples, _SGLANG_RETRACTIONS)
    start = samples.get("process_start_time_seconds")
    return EngineReading(
        source="sglang",
        model=_first_label(samples, ("sglang:token_usage", "sglang:num_used_tokens"), "model_name"),
        instance_id=repr(start[0][1]) if start else None,
        occupancy=occupancy,
        capacity_blocks=capacity,
        used_blocks=used,
        free_blocks=capacity - used if capacity is not None and used is not None else None,
        cached_blocks=None,
        block_size=page_size,
        bytes_per_token=None,
        prefix_cache_enabled=None,
        prefix_queries_tokens_total=queries,
        prefix_hits_tokens_total=hits,
        running=_int(_total(_one_per_pool(samples.get("sglang:num_running_reqs")), "running")),
        waiting=_int(_total(_one_per_pool(samples.get("sglang:num_queue_reqs")), "waiting")),
        swapped=None,
        preemptions_total=_total(_one_per_pool(retractions), "retractions"),
        ttft=_first_histogram(samples, ("sglang:time_to_first_token_seconds",), _one_per_pool),
        tpot=_first_histogram(samples, _SGLANG_TPOT, _one_per_pool),
    )


def _prometheus_samples(text: str, engine: str) -> dict[str, Labelled]:
    """Index every sample by its own name (counters keep `_total`, histograms `_bucket`...)."""
    out: dict[str, Labelled] = defaultdict(list)
    try:
        families: Iterable[Metric] = text_string_to_metric_families(text)
        for family in families:
            for s in family.samples:
                out[s.name].append((s.labels, float(s.value)))
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise GarbageError(f"{engine} /metrics is not Prometheus text: {exc}") from exc
    return out


def _combine_pools(pools: list[_Pool]) -> tuple[float, int | None, int | None]:
    """(occupancy, capacity blocks, used blocks) of all pools together (the rule above)."""
    sizes = [p.blocks for p in pools if p.blocks is not None]
    if len(sizes) == len(pools):
        capacity = sum(sizes)
        occupancy = min(sum(p.usage * b for p, b in zip(pools, sizes, strict=True)) / capacity, 1.0)
        return occupancy, capacity, round(occupancy * capacity)
    return min(sum(p.usage for p in pools) / len(pools), 1.0), None, None


def _fraction(value: float, what: str) -> float:
    if not math.isfinite(value) or value < 0:
        raise GarbageError(f"{what} is not a fraction: {value}")
    return min(value, 1.0)


def _count(value: float, what: str) -> float:
    if not math.isfinite(value) or value < 0:
        raise GarbageError(f"{what} is not a non-negative number: {value}")
    return value


def _is_rank_label(name: str) -> bool:
    """A label naming a process within one pool (not a pool of its own)."""
    return name == "pid" or (name.endswith("_rank") and name != "dp_rank")


def _pool_key(labels: dict[str, str]) -> PoolKey:
    return tuple(sorted((k, v) for k, v in labels.items() if not _is_rank_label(k)))


def _rank_order(labels: dict[str, str]) -> tuple[tuple[str, int, str], ...]:
    ranks = sorted((k, v) for k, v in labels.items() if _is_rank_label(k) and k != "pid")
    if "pid" in labels:  # last: the lowest rank wins whatever its process id
        ranks.append(("pid", labels["pid"]))
    return tuple((k, int(v) if v.isdigit() else sys.maxsize, v) for k, v in ranks)


def _one_per_pool(series: Labelled | None) -> Labelled:
    """Of the series that differ only in rank labels, keep the lowest rank's."""
    best: dict[PoolKey, tuple[dict[str, str], float]] = {}
    for labels, value in series or ():
        key = _pool_key(labels)
        if key not in best or _rank_order(labels) < _rank_order(best[key][0]):
            best[key] = (labels, value)
    return list(best.values())


def _by_pool(series: Labelled | None) -> dict[PoolKey, float]:
    return {_pool_key(labels): value for labels, value in _one_per_pool(series)}


def _all_series(series: Labelled | None) -> Labelled:
    return list(series or ())


def _first_present(samples: dict[str, Labelled], names: tuple[str, ...]) -> Labelled | None:
    for name in names:
        if samples.get(name):
            return samples[name]
    return None


def _total(series: Labelled | None, what: str) -> float | None:
    if not series:
        return None
    total = sum(v for _, v in series)
    if not math.isfinite(total) or total < 0:
        raise GarbageError(f"{what} sample is not a non-negative number: {total}")
    return total


def _int(value: float | None) -> int | None:
    return None if value is None else round(value)


def _first_label(samples: dict[str, Labelled], names: tuple[str, ...], label: str) -> str | None:
    for name in names:
        for labels, _ in samples.get(name, []):
            if labels.get(label):
                return labels[label]
    return None


def _first_label_int(series: Labelled, label: str) -> int | None:
    for labels, _ in series:
        raw = labels.get(label, "")
        if raw.isdigit():
            return int(raw)
    return None


def _prefix_caching_flag(series: Labelled) -> bool | None:
    for labels, _ in series:
        raw = labels.get("enable_prefix_caching")
        if raw is not None:
            return raw.lower() == "true"
    return None


def _first_histogram(
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
    count = by_bound.pop(math.inf, None)
    if count is None:
        raise GarbageError(f"{name}: no +Inf bucket")
    bounds = tuple(sorted(by_bound))
    reading = HistogramReading(
        bounds=bounds,
        counts=tuple(by_bound[b] for b in bounds),
        sum=_total(sums, f"{name}_sum") or 0.0,
        count=count,
    )
    _check_histogram(reading, name)
    return reading
