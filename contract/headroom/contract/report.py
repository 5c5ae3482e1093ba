"""The sidecar -> operator report: the body of the sidecar's `GET /saturation`.

The operator reads this instead of Prometheus when `scaling.metricsSource` is `sidecar`; the
numbers are the ones the sidecar's `/metrics` exports at the same instant.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# What a sidecar can poll: headroom's /stats, or a stock vLLM or SGLang server's /metrics.
SourceKind = Literal["headroom", "vllm", "sglang"]

SATURATION_REPORT_VERSION: Literal[1] = 1


class SaturationReport(BaseModel):
    """One pod's KV-cache state and saturation forecast.

    Read `fresh` first: when it is false the engine is down or the last good poll is too old,
    and every figure below it is None (never a stale value). When `fresh` is true a figure is
    None only when the source does not report it or there is not enough data yet.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = Field(
        default=SATURATION_REPORT_VERSION, description="schema version of this body"
    )
    time: float = Field(description="when this report was made, unix seconds")
    source: SourceKind = Field(description="what the sidecar polls")
    pod: str | None = Field(description="pod name (flag or POD_NAME), None when unknown")
    namespace: str | None = Field(description="pod namespace (flag or POD_NAMESPACE)")
    inferencedeployment: str | None = Field(description="owning InferenceDeployment name")
    model: str | None = Field(description="served model, from the flag or the engine")
    engine_up: bool = Field(description="the last poll of the engine succeeded")
    fresh: bool = Field(
        description="engine_up and the last good poll is younger than stale_after_seconds"
    )
    age_seconds: float | None = Field(description="seconds since the last good poll")
    stale_after_seconds: float = Field(description="age at which a good poll stops being fresh")
    last_error: str | None = Field(description="why the last poll failed, None when it did not")
    occupancy: float | None = Field(
        description="used / capacity blocks, 0..1; evictable prefix-cache blocks count as free"
    )
    used_blocks: int | None = Field(description="blocks referenced by running sequences")
    capacity_blocks: int | None = Field(description="total blocks in the KV pool")
    cached_blocks: int | None = Field(description="evictable prefix-cache blocks (headroom only)")
    block_size: int | None = Field(description="tokens per block")
    bytes_per_token: int | None = Field(description="KV bytes per token (headroom only)")
    growth_blocks_per_second: float | None = Field(
        description="least-squares slope of used blocks over the forecast window; None when the "
        "forecast is not ready or capacity is unknown"
    )
    growth_ratio_per_second: float | None = Field(
        description="the same slope as occupancy per second (known even when blocks are not)"
    )
    eta_seconds: float | None = Field(
        description="seconds until occupancy reaches 1.0 at the current growth; None means not "
        "growing (+Inf) when forecast_ready, or no forecast yet when not"
    )
    forecast_ready: bool = Field(description="enough points since the last restart to fit a slope")
    forecast_points: int = Field(description="points in the forecast window since the restart")
    fit_points: int = Field(
        description="points the slope was fitted over: the recent segment when the trend changed"
    )
    hit_ratio: float | None = Field(
        description="prefix-cache hit tokens / queried tokens over window_seconds; None with no "
        "queries in the window or prefix caching off"
    )
    prefix_cache_enabled: bool | None = Field(description="engine has prefix caching on")
    running: int | None = Field(description="requests being decoded")
    waiting: int | None = Field(description="requests queued for admission")
    preemptions_total: int | None = Field(description="cumulative preemptions since engine start")
    preemption_rate_per_second: float | None = Field(
        description="preemptions per second over window_seconds"
    )
    arrival_rate_per_second: float | None = Field(
        default=None, description="requests accepted per second over demand_window_seconds"
    )
    departure_rate_per_second: float | None = Field(
        default=None,
        description="requests that left (finished, aborted, failed) per second over the window",
    )
    kv_block_seconds_per_second: float | None = Field(
        default=None,
        description="block-seconds per second over the window: the mean used blocks",
    )
    kv_demand_blocks: float | None = Field(
        default=None,
        description="Little's law: arrival rate x block-seconds per departed request; the KV "
        "the current traffic holds at steady state (None before any request has left)",
    )
    demand_window_seconds: float | None = Field(
        default=None, description="the span the demand rates were measured over"
    )
    requests_arrived_total: float | None = Field(
        default=None, description="the engine's cumulative arrivals (resets with the engine)"
    )
    requests_departed_total: float | None = Field(
        default=None, description="the engine's cumulative departures (resets with the engine)"
    )
    kv_block_seconds_total: float | None = Field(
        default=None,
        description="cumulative block-seconds: the engine's own, or the sidecar's integral of its "
        "polls for sources that do not count them (resets with the engine)",
    )
    window_seconds: float = Field(description="window of hit_ratio and preemption rate")
    forecast_window_seconds: float = Field(description="window of the slope fit")
    engine_restarts_total: int = Field(description="engine restarts this sidecar has seen")
