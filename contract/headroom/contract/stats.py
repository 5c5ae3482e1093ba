"""The engine's `/stats` snapshot: the versioned JSON contract between engine and sidecar.

Counters are cumulative since `started_at`; a consumer that sees `instance_id` change (or a
counter go backwards) knows the engine restarted and must treat counters as reset.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

STATS_SCHEMA_VERSION = 1

# Token latencies, not web RPCs: TTFT spans a few ms (cached prefix) to tens of seconds (queued
# long prompt); per-output-token time is usually 5-200 ms.
TTFT_BUCKETS_S: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
TPOT_BUCKETS_S: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KVBlockStats(_Model):
    """Block pool state; free + used + cached == capacity always holds."""

    block_size: int = Field(ge=1, description="tokens per block")
    capacity: int = Field(ge=0, description="total blocks in the pool")
    free: int = Field(ge=0, description="blocks holding nothing")
    used: int = Field(ge=0, description="blocks referenced by at least one sequence")
    cached: int = Field(ge=0, description="refcount-0 blocks kept for prefix hits (evictable)")
    bytes_per_token: int = Field(ge=0, description="KV bytes per token from the budget model")

    @property
    def occupancy(self) -> float:
        """used / capacity; evictable cached blocks are free capacity, so they do not count."""
        return self.used / self.capacity if self.capacity else 0.0


class PrefixCacheStats(_Model):
    enabled: bool
    queries_tokens_total: int = Field(ge=0, description="prompt tokens looked up")
    hits_tokens_total: int = Field(ge=0, description="prompt tokens found cached")


class RequestStats(_Model):
    running: int = Field(ge=0)
    waiting: int = Field(ge=0)
    swapped: int = Field(ge=0, default=0, description="always 0: preemption is by recompute")


class Histogram(_Model):
    """A cumulative histogram: counts[i] observations <= buckets[i]; `count` includes +Inf."""

    buckets: list[float]
    counts: list[int]
    sum: float = 0.0
    count: int = 0


class SchedulerStats(_Model):
    """What the scheduler knows about itself (the engine adds identity and latencies)."""

    kv: KVBlockStats
    prefix_cache: PrefixCacheStats
    requests: RequestStats
    preemptions_total: int = Field(ge=0)
    steps_total: int = Field(ge=0)
    last_step_schedule_seconds: float = Field(ge=0, default=0.0)


class StatsSnapshot(_Model):
    """The body of `GET /stats`."""

    version: int = STATS_SCHEMA_VERSION
    model: str
    instance_id: str = Field(description="random id chosen at engine start")
    started_at: float = Field(description="engine start, unix seconds")
    time: float = Field(description="when this snapshot was taken, unix seconds")
    kv: KVBlockStats
    prefix_cache: PrefixCacheStats
    requests: RequestStats
    preemptions_total: int = Field(ge=0)
    steps_total: int = Field(ge=0)
    requests_finished_total: int = Field(
        ge=0, default=0, description="requests that left the engine: finished, aborted or failed"
    )
    prompt_tokens_total: int = Field(ge=0, default=0)
    # The demand signals (Little's law): what has arrived at the door, and the KV that finished
    # requests held over their lives. Occupancy lags a change of traffic by one request lifetime;
    # arrivals x block-seconds per request does not.
    requests_arrived_total: int = Field(
        ge=0, default=0, description="requests accepted by the engine (admitted or queued)"
    )
    prompt_tokens_arrived_total: int = Field(
        ge=0, default=0, description="prompt tokens of the requests counted in requests_arrived"
    )
    kv_block_seconds_total: float = Field(
        ge=0, default=0.0, description="integral of used KV blocks over time, block-seconds"
    )
    generation_tokens_total: int = Field(ge=0, default=0)
    time_to_first_token_seconds: Histogram | None = None
    time_per_output_token_seconds: Histogram | None = None
