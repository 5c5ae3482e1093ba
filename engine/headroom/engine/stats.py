"""The engine's observability: counters, latency histograms and the `/stats` snapshot.

Demand counters (issue 20): a request arrives when the engine accepts it (queued or admitted;
a rejected request never arrived), once per API request whatever its `n`, and departs once
(`requests_finished_total`: finished, aborted or failed). `kv_block_seconds_total` is the KV
manager's exact integral of used blocks over wall-clock time.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

from headroom.contract.stats import (
    TPOT_BUCKETS_S,
    TTFT_BUCKETS_S,
    Histogram,
    KVBlockStats,
    PrefixCacheStats,
    RequestStats,
    SchedulerStats,
    StatsSnapshot,
)
from headroom.engine.scheduler import Scheduler


class HistogramAccumulator:
    """Observations into fixed buckets, exported as the cumulative `stats.Histogram`."""

    __slots__ = ("_buckets", "_counts", "_sum", "_total")

    def __init__(self, buckets: Sequence[float]) -> None:
        self._buckets = tuple(buckets)
        self._counts = [0] * len(self._buckets)
        self._sum = 0.0
        self._total = 0

    def observe(self, value: float) -> None:
        for i, upper in enumerate(self._buckets):
            if value <= upper:
                self._counts[i] += 1
                break
        self._sum += value
        self._total += 1

    def snapshot(self) -> Histogram:
        cumulative, running = [], 0
        for c in self._counts:
            running += c
            cumulative.append(running)
        return Histogram(
            buckets=list(self._buckets), counts=cumulative, sum=self._sum, count=self._total
        )


def scheduler_stats(scheduler: Scheduler, bytes_per_token: int = 0) -> SchedulerStats:
    """What the scheduler and its KV pool look like now (see `headroom.contract.stats`)."""
    kv = scheduler.kv
    pool, cache = kv.pool, kv.cache
    return SchedulerStats(
        kv=KVBlockStats(
            block_size=kv.block_size,
            capacity=pool.num_blocks,
            free=pool.num_free,
            used=pool.num_used,
            cached=pool.num_cached,
            bytes_per_token=bytes_per_token,
        ),
        prefix_cache=PrefixCacheStats(
            enabled=cache is not None,
            queries_tokens_total=cache.queries_tokens_total if cache else 0,
            hits_tokens_total=cache.hits_tokens_total if cache else 0,
        ),
        requests=RequestStats(
            running=len(scheduler.running), waiting=len(scheduler.seqs) - len(scheduler.running)
        ),
        preemptions_total=scheduler.preemptions_total,
        steps_total=scheduler.steps_total,
        last_step_schedule_seconds=scheduler.last_step_schedule_seconds,
    )


class EngineStats:
    """Everything `/stats` counts beyond the scheduler's own state."""

    def __init__(self) -> None:
        self.instance_id = uuid.uuid4().hex
        self.started_at = time.time()
        self.requests_arrived_total = 0
        self.prompt_tokens_arrived_total = 0
        self.requests_finished_total = 0
        self.generation_tokens_total = 0
        self.ttft = HistogramAccumulator(TTFT_BUCKETS_S)
        self.tpot = HistogramAccumulator(TPOT_BUCKETS_S)

    def arrived(self, prompt_tokens: int) -> None:
        """The engine accepted a request with this many prompt tokens."""
        self.requests_arrived_total += 1
        self.prompt_tokens_arrived_total += prompt_tokens

    def snapshot(self, model: str, scheduler: Scheduler, bytes_per_token: int) -> StatsSnapshot:
        """The body of `GET /stats`."""
        s = scheduler_stats(scheduler, bytes_per_token)
        return StatsSnapshot(
            model=model,
            instance_id=self.instance_id,
            started_at=self.started_at,
            time=time.time(),
            kv=s.kv,
            prefix_cache=s.prefix_cache,
            requests=s.requests,
            preemptions_total=s.preemptions_total,
            steps_total=s.steps_total,
            requests_finished_total=self.requests_finished_total,
            # Prompt tokens of accepted requests, as before the demand counters existed.
            prompt_tokens_total=self.prompt_tokens_arrived_total,
            requests_arrived_total=self.requests_arrived_total,
            prompt_tokens_arrived_total=self.prompt_tokens_arrived_total,
            kv_block_seconds_total=scheduler.kv.block_seconds(),
            generation_tokens_total=self.generation_tokens_total,
            time_to_first_token_seconds=self.ttft.snapshot(),
            time_per_output_token_seconds=self.tpot.snapshot(),
        )
