"""One `EngineReading` per poll, whatever the engine, and the parser of headroom's own `/stats`.

The stock servers' parsers live beside this one: `vllm_source` and `sglang_source` (over the
Prometheus-text helpers in `exposition`). Every parser is pure: bytes or text in, a reading
out, or `GarbageError` when the body is not something the sidecar can trust (invalid JSON, a
schema version it does not know, an exposition without the KV usage gauge, a series given
twice, a histogram whose sum or counts are not non-negative numbers, a count too large to be
a float exactly). The poller turns a `GarbageError` into `headroom_engine_up 0`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from pydantic import ValidationError

from headroom.contract.report import SourceKind
from headroom.contract.stats import STATS_SCHEMA_VERSION, Histogram, StatsSnapshot

# The largest count a `/stats` body may hold: past 2**53 a float no longer holds every whole
# number (past ~1.8e308 it holds none, and float() raises OverflowError). The contract's counts
# have no upper bound, and no engine's blocks, tokens or requests come near this one.
MAX_COUNT = 2**53


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
    `num_gpu_blocks`, SGLang's only when it exports `sglang:max_total_num_tokens` or its
    server-info endpoint answers).

    The four demand counters are cumulative. headroom's `/stats` counts them itself. For vLLM
    and SGLang, `requests_departed_total` is the server's finished-request counter, and
    `requests_arrived_total` is read as departed + in flight (running + waiting) at this
    instant: the poller's `ArrivalCounter` turns that level into a counter that never falls.
    vLLM's prompt tokens are counted at prefill, SGLang's only at the finish (too late: left
    None). Neither server exports block-seconds (None): `PollState` integrates the used blocks
    over the polls instead.
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
    # The demand counters (cumulative; None when the source cannot give them): Little's law
    # turns them into the KV the arriving traffic holds (headroom.contract.demand).
    requests_arrived_total: float | None = None
    prompt_tokens_arrived_total: float | None = None
    kv_block_seconds_total: float | None = None
    requests_departed_total: float | None = None


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
    _check_counts(snap.model_dump(), "")
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
        requests_arrived_total=float(snap.requests_arrived_total),
        prompt_tokens_arrived_total=float(snap.prompt_tokens_arrived_total),
        kv_block_seconds_total=_finite(snap.kv_block_seconds_total, "kv_block_seconds_total"),
        requests_departed_total=float(snap.requests_finished_total),
    )


def _check_counts(value: object, where: str) -> None:
    """Raise GarbageError at the first integer in `value` (a snapshot's dump) above MAX_COUNT."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_counts(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_counts(item, f"{where}[{i}]")
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_COUNT:
        # the number itself may have hundreds of digits: name the field, not the value
        raise GarbageError(f"/stats {where} is not a plausible count (above 2**53)")


def _finite(value: float, name: str) -> float:
    # pydantic takes JSON's Infinity for a float field with ge=0; and a total past MAX_COUNT
    # (a pool of 10^6 blocks full for 285 years) is no engine's: 1e308 block-seconds made the
    # Little's-law demand +Inf on /metrics.
    if not math.isfinite(value) or abs(value) > MAX_COUNT:
        raise GarbageError(f"/stats {name} is not a finite number up to 2**53: {value}")
    return float(value)


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
    check_histogram(reading, name)
    return reading


def check_histogram(h: HistogramReading, name: str) -> None:
    """Raise GarbageError unless `h` is a histogram Prometheus would accept from an exporter."""
    # NaN passes the order test, and +Inf is the `count`: either bound would be exported as a
    # second +Inf bucket or le="nan", which makes histogram_quantile NaN.
    if not all(math.isfinite(b) for b in h.bounds):
        raise GarbageError(f"{name}: a bucket bound is not a finite number")
    if any(b2 <= b1 for b1, b2 in itertools.pairwise(h.bounds)):
        raise GarbageError(f"{name}: bucket bounds are not increasing")
    cumulative = (*h.counts, h.count)
    # NaN compares false both ways, so it is named first: it would pass the order test below.
    if not all(math.isfinite(c) and c >= 0 for c in cumulative):
        raise GarbageError(f"{name}: a bucket count is not a non-negative number")
    if any(c2 < c1 for c1, c2 in itertools.pairwise(cumulative)):
        raise GarbageError(f"{name}: bucket counts are not cumulative")
    if not (math.isfinite(h.sum) and h.sum >= 0):
        # Latencies are never negative; a sum of NaN or -5 would reach Prometheus unchanged.
        raise GarbageError(f"{name}: sum is not a non-negative number: {h.sum}")
