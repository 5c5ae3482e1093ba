"""A stock vLLM server's `/metrics` (vLLM v1: 0.9 to 0.12) as one `EngineReading`.

The pool's size is `vllm:cache_config_info`'s `num_gpu_blocks` label. With data parallelism
vLLM's front end adds up the blocks of all its engines (the engine handshake: "Sum values from
all engines in DP case") and stamps that one total on the info series of every `engine` label,
so the total is read once, never summed over the engines. vLLM exports no per-engine size:
its data-parallel engines are read as equal pools, occupancy being the plain mean of their
usage gauges. (Before 0.10 each engine's logger unregistered the previous one's metrics, so a
data-parallel 0.9 server shows only its last engine's series beside the total.)
"""

from __future__ import annotations

from headroom.sidecar.exposition import (
    Labelled,
    all_series,
    as_int,
    first_histogram,
    first_label,
    first_label_int,
    first_present,
    fraction,
    is_whole_number,
    prometheus_samples,
    total,
)
from headroom.sidecar.sources import EngineReading, GarbageError

# vLLM renamed its KV gauge, prefix counters and TPOT histogram across releases (0.9: gpu_*
# names; 0.10: both; 0.11: the new ones, the gpu_* ones hidden, TPOT under both names; 0.12:
# the new ones only); the first name present wins.
USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
TPOT = ("vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds")


def parse_vllm_metrics(text: str) -> EngineReading:
    """Parse a stock vLLM server's `/metrics` exposition into a reading.

    Every `engine` label value is one data-parallel engine with its own KV pool; request
    gauges, counters and histograms are summed over the engines. Departures are
    `vllm:request_success_total` over every `finished_reason` (a request its client aborts is
    not counted there), arrivals the departures plus the requests running and waiting now, and
    prompt tokens `vllm:prompt_tokens_total`, counted when a prompt's prefill completes.
    """
    samples = prometheus_samples(text, "vLLM")
    usage = first_present(samples, USAGE)
    if usage is None:
        raise GarbageError(f"vLLM /metrics has none of {', '.join(USAGE)}")
    config = samples.get("vllm:cache_config_info", [])
    usages = [fraction(v, "vLLM KV usage") for _, v in usage]
    occupancy = min(sum(usages) / len(usages), 1.0)
    capacity = _front_end_blocks(usage, config)
    used = round(occupancy * capacity) if capacity is not None else None
    running = as_int(total(samples.get("vllm:num_requests_running"), "running"))
    waiting = as_int(total(samples.get("vllm:num_requests_waiting"), "waiting"))
    departed = total(samples.get("vllm:request_success_total"), "request_success")
    start = samples.get("process_start_time_seconds")
    return EngineReading(
        source="vllm",
        model=first_label(samples, USAGE, "model_name"),
        instance_id=repr(start[0][1]) if start else None,
        occupancy=occupancy,
        capacity_blocks=capacity,
        used_blocks=used,
        free_blocks=capacity - used if capacity is not None and used is not None else None,
        cached_blocks=None,
        block_size=first_label_int(config, "block_size"),
        bytes_per_token=None,
        prefix_cache_enabled=_prefix_caching_flag(config),
        prefix_queries_tokens_total=total(first_present(samples, QUERIES), "queries"),
        prefix_hits_tokens_total=total(first_present(samples, HITS), "hits"),
        running=running,
        waiting=waiting,
        swapped=as_int(total(samples.get("vllm:num_requests_swapped"), "swapped")),
        preemptions_total=total(samples.get("vllm:num_preemptions_total"), "preemptions"),
        ttft=first_histogram(samples, ("vllm:time_to_first_token_seconds",), all_series),
        tpot=first_histogram(samples, TPOT, all_series),
        requests_arrived_total=departed + running + waiting
        if departed is not None and running is not None and waiting is not None
        else None,
        prompt_tokens_arrived_total=total(samples.get("vllm:prompt_tokens_total"), "prompt"),
        kv_block_seconds_total=None,
        requests_departed_total=departed,
    )


def _front_end_blocks(usage: Labelled, config: Labelled) -> int | None:
    """The pod's blocks: the one total the front end stamps on every engine's info series.

    Known only when every usage series pairs with an info series (by `engine`, or a single
    series on each side whatever its labels) and all of them carry the same positive count;
    counts that differ are not what any vLLM release renders, and are not guessed at.
    """
    engines = [labels.get("engine", "") for labels, _ in usage]
    stamped: dict[str, str] = {}
    for labels, _ in config:
        key = labels.get("engine", "")
        if key in stamped:  # two info series for one engine: which is it?
            return None
        stamped[key] = labels.get("num_gpu_blocks", "")
    paired = set(engines) == stamped.keys() or (len(engines) == 1 and len(stamped) == 1)
    counts = set(stamped.values())
    if not paired or len(engines) != len(set(engines)) or len(counts) != 1:
        return None
    raw = counts.pop()
    return int(raw) if is_whole_number(raw) and int(raw) > 0 else None


def _prefix_caching_flag(series: Labelled) -> bool | None:
    for labels, _ in series:
        raw = labels.get("enable_prefix_caching")
        if raw is not None:
            return raw.lower() == "true"
    return None
