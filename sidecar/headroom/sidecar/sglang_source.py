"""A stock SGLang server (`--enable-metrics`) as one `EngineReading`: its `/metrics`, and the
pool size from its server-info endpoint where the metrics do not carry it.

SGLang 0.5.3 (the pinned image) exports no `sglang:max_total_num_tokens`: the pool a running
server really has (`--max-total-tokens` is only a cap; SGLang takes less when it profiles less
memory) is in `GET /get_server_info`, as `max_total_num_tokens` (the first data-parallel rank's
scheduler) and `internal_states[i].memory_usage.token_capacity` (one per data-parallel rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from headroom.contract.jsonfile import parse_json
from headroom.sidecar.exposition import (
    MAX_FRACTION,
    Pool,
    PoolKey,
    as_int,
    by_pool,
    combine_pools,
    count,
    first_histogram,
    first_label,
    first_present,
    fraction,
    is_whole_number,
    one_per_pool,
    prometheus_samples,
    total,
)
from headroom.sidecar.sources import EngineReading, GarbageError

# The server-info route: `/get_server_info` in 0.5.3, kept as a deprecated alias of
# `/server_info` by later releases.
SERVER_INFO_PATHS = ("/get_server_info", "/server_info")

# SGLang's TPOT histogram became inter-token latency. Retractions (SGLang's preemptions) are
# the counter `sglang:num_retracted_requests_total`, which SGLang added in 0.5.7 (0.5.6's
# collector.py has none). Before it, the pinned 0.5.3 included, SGLang exports only the gauge
# `sglang:num_retracted_reqs`: the requests retracted since the scheduler's last stats log,
# reset at every log, not a running total. It is not read (summing it over polls would miss
# or repeat logs), so on those releases preemptions are unknown.
TPOT = ("sglang:time_per_output_token_seconds", "sglang:inter_token_latency_seconds")
RETRACTIONS = ("sglang:num_retracted_requests_total",)


# SGLang rounds `sglang:token_usage` to 2 decimals; `sglang:num_used_tokens` is exact. A ratio
# of the two that differs from the gauge by more than the rounding (and float noise) is not
# over the pool the server measured.
USAGE_ROUNDING = 0.005 + 1e-9


@dataclass(frozen=True, slots=True)
class SglangServerInfo:
    """What the server-info endpoint says about the KV pool."""

    pool_tokens: tuple[int, ...]  # one entry per data-parallel rank's pool
    page_size: int | None  # the server's --page-size, when it says
    # Whether the radix (prefix) cache is on: the endpoint carries every server argument, so
    # `--disable-radix-cache` (what the operator passes for engine.prefixCaching: false) shows.
    prefix_cache_enabled: bool | None = None


def parse_sglang_server_info(body: bytes) -> SglangServerInfo:
    """Parse SGLang's `GET /get_server_info` body; raises GarbageError."""
    try:
        doc: Any = parse_json(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise GarbageError(f"SGLang server info is not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise GarbageError("SGLang server info is not a JSON object")
    states = doc.get("internal_states")
    capacities = [
        _positive_int(s.get("memory_usage", {}).get("token_capacity"))
        if isinstance(s, dict) and isinstance(s.get("memory_usage"), dict)
        else None
        for s in (states if isinstance(states, list) else [])
    ]
    pool: tuple[int, ...]
    if capacities and all(c is not None for c in capacities):
        pool = tuple(c for c in capacities if c is not None)
    elif (tokens := _positive_int(doc.get("max_total_num_tokens"))) is not None:
        # the first rank's pool; data-parallel ranks run the same model on the same GPUs
        pool = (tokens,) * (_positive_int(doc.get("dp_size")) or 1)
    else:
        raise GarbageError(
            "SGLang server info has neither internal_states[].memory_usage.token_capacity nor "
            "max_total_num_tokens"
        )
    disabled = doc.get("disable_radix_cache")
    return SglangServerInfo(
        pool_tokens=pool,
        page_size=_positive_int(doc.get("page_size")),
        prefix_cache_enabled=(not disabled) if isinstance(disabled, bool) else None,
    )


def _positive_int(value: object) -> int | None:
    # bool is an int to Python, and never a size
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def parse_sglang_metrics(
    text: str, page_size: int = 1, server_info: SglangServerInfo | None = None
) -> EngineReading:
    """Parse an SGLang server's `/metrics` (started with `--enable-metrics`) into a reading.

    SGLang counts its KV pool in tokens: blocks are tokens // page size (the server's
    `page_size` from `server_info`, else the `page_size` argument, SGLang's `--page-size`).
    A pool's tokens are `sglang:max_total_num_tokens` where exported, else the server info's,
    paired with the pools in `dp_rank` order when their numbers match. Occupancy is
    `sglang:num_used_tokens` over the pool's tokens where both are known: SGLang exports
    `sglang:token_usage` (the same ratio) rounded to 2 decimals, which reads 14,300 of 14,336
    tokens as full. The gauge is read where the pool size is unknown, or where it disagrees
    with the ratio by more than its rounding (the ratio is then not over the pool the server
    measured). Both count the radix cache's evictable tokens as free.
    Prefix-cache counters are the prompt and cached tokens of finished requests
    (`sglang:prompt_tokens_total`, `sglang:cached_tokens_total`). SGLang creates the cached
    series at the first request that had a cached token, so on a release that counts finished
    requests (`sglang:num_requests_total`, 0.5.3) prompt tokens without it are 0 hits; the
    early release without either has no prefix figures; the
    per-batch `sglang:cache_hit_rate` gauge is not a windowed ratio and is not read. Departures
    are `sglang:num_requests_total` (counted when a request finishes), arrivals the departures
    plus the requests running and queued as the gauges say. SGLang 0.5.3 updates those gauges
    (and the used tokens) only at its scheduler's stats logs, while the counter rises at once:
    `PollState` reads them as of their log (`state._sglang_demand`). Ranks and data-parallel
    pools combine by the rule in `exposition`.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be at least 1, got {page_size}")
    page = (server_info.page_size if server_info else None) or page_size
    samples = prometheus_samples(text, "SGLang")
    usage = by_pool(samples.get("sglang:token_usage"))
    used_tokens = by_pool(samples.get("sglang:num_used_tokens"))
    max_tokens = {
        k: count(v, "sglang:max_total_num_tokens")
        for k, v in by_pool(samples.get("sglang:max_total_num_tokens")).items()
    }
    keys = list(usage) or [k for k in used_tokens if max_tokens.get(k)]
    if not keys:
        raise GarbageError(
            "SGLang /metrics has no sglang:token_usage (is the server started with "
            "--enable-metrics? its scheduler first exports it after a batch or 30 s idle)"
        )
    if server_info is not None and not all(max_tokens.get(k) for k in keys):
        max_tokens = _paired(keys, server_info.pool_tokens) or max_tokens
    pools = []
    for key in keys:
        tokens = max_tokens.get(key)
        # the gauge, rounded: all there is while the pool size is unknown
        share = fraction(usage[key], "SGLang token usage") if key in usage else None
        if key in used_tokens and tokens:
            ratio = count(used_tokens[key] / tokens, "SGLang token usage")
            # A ratio further from the gauge than its rounding is not over the pool the server
            # measured (a hybrid model's gauge is its fuller pool's; a server restarted with a
            # bigger pool, before the sidecar reads its size again): the gauge wins then. With
            # no gauge, a ratio past MAX_FRACTION is no pool's.
            if share is None:
                share = fraction(ratio, "SGLang token usage")
            elif ratio <= MAX_FRACTION and abs(min(ratio, 1.0) - share) <= USAGE_ROUNDING:
                share = min(ratio, 1.0)
        assert share is not None  # `keys` are the gauge's, or have both used and pool size
        pools.append(Pool(share, (int(tokens) // page or None) if tokens else None))
    occupancy, capacity, used = combine_pools(pools)
    queries = total(one_per_pool(samples.get("sglang:prompt_tokens_total")), "prompt tokens")
    hits = total(one_per_pool(samples.get("sglang:cached_tokens_total")), "cached tokens")
    departed = total(one_per_pool(samples.get("sglang:num_requests_total")), "requests")
    if hits is None and queries is not None and departed is not None:
        hits = 0.0  # no request has hit the cache yet, so the series does not exist yet
    if queries is None or hits is None:
        queries = hits = None
    running = as_int(total(one_per_pool(samples.get("sglang:num_running_reqs")), "running"))
    waiting = as_int(total(one_per_pool(samples.get("sglang:num_queue_reqs")), "waiting"))
    grammar = total(one_per_pool(samples.get("sglang:num_grammar_queue_reqs")), "grammar queue")
    retractions = first_present(samples, RETRACTIONS)
    start = samples.get("process_start_time_seconds")
    return EngineReading(
        source="sglang",
        model=first_label(samples, ("sglang:token_usage", "sglang:num_used_tokens"), "model_name"),
        instance_id=repr(start[0][1]) if start else None,
        occupancy=occupancy,
        capacity_blocks=capacity,
        used_blocks=used,
        free_blocks=capacity - used if capacity is not None and used is not None else None,
        cached_blocks=None,
        block_size=page,
        bytes_per_token=None,
        # Off, hits read 0 and would look like a cache that finds nothing.
        prefix_cache_enabled=server_info.prefix_cache_enabled if server_info else None,
        prefix_queries_tokens_total=queries,
        prefix_hits_tokens_total=hits,
        running=running,
        waiting=waiting,
        swapped=None,
        preemptions_total=total(one_per_pool(retractions), "retractions"),
        ttft=first_histogram(samples, ("sglang:time_to_first_token_seconds",), one_per_pool),
        tpot=first_histogram(samples, TPOT, one_per_pool),
        # The grammar queue holds requests waiting for their grammar to compile: arrived, not
        # yet queued for the scheduler.
        requests_arrived_total=departed + running + waiting + (grammar or 0.0)
        if departed is not None and running is not None and waiting is not None
        else None,
        # `sglang:prompt_tokens_total` counts a prompt when its request finishes, one request
        # lifetime after it arrived: not an arrival count.
        prompt_tokens_arrived_total=None,
        kv_block_seconds_total=None,
        requests_departed_total=departed,
    )


def _paired(keys: list[PoolKey], pool_tokens: tuple[int, ...]) -> dict[PoolKey, float] | None:
    """The server info's pools, matched to the exposition's in `dp_rank` order, or None."""
    if len(keys) != len(pool_tokens):
        return None

    def rank(key: PoolKey) -> tuple[int, str]:
        value = dict(key).get("dp_rank", "")
        return (int(value) if is_whole_number(value) else -1, value)

    return {k: float(t) for k, t in zip(sorted(keys, key=rank), pool_tokens, strict=True)}
