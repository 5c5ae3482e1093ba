"""`GET /saturation`: the sidecar's figures rendered as the contract's `SaturationReport`."""

from __future__ import annotations

import time

from headroom.contract.report import SaturationReport
from headroom.sidecar.config import SidecarConfig
from headroom.sidecar.state import Figures, finite_or_none


def build_report(
    fig: Figures, cfg: SidecarConfig, now_unix: float | None = None
) -> SaturationReport:
    """Render `fig` as the `/saturation` body."""
    r = fig.reading
    d = fig.demand
    ready = fig.eta_seconds is not None
    return SaturationReport(
        time=time.time() if now_unix is None else now_unix,
        source=cfg.source,
        pod=cfg.labels.pod or None,
        namespace=cfg.labels.namespace or None,
        inferencedeployment=cfg.labels.inferencedeployment or None,
        model=fig.model,
        engine_up=fig.engine_up,
        fresh=fig.fresh,
        age_seconds=fig.age_seconds,
        stale_after_seconds=cfg.stale_after,
        last_error=fig.last_error,
        occupancy=r.occupancy if r else None,
        used_blocks=r.used_blocks if r else None,
        capacity_blocks=r.capacity_blocks if r else None,
        cached_blocks=r.cached_blocks if r else None,
        block_size=r.block_size if r else None,
        bytes_per_token=r.bytes_per_token if r else None,
        growth_blocks_per_second=fig.growth_blocks_per_second,
        growth_ratio_per_second=fig.growth_ratio_per_second,
        eta_seconds=finite_or_none(fig.eta_seconds),
        forecast_ready=ready,
        forecast_points=fig.forecast_points,
        fit_points=fig.fit_points,
        hit_ratio=fig.hit_ratio,
        prefix_cache_enabled=r.prefix_cache_enabled if r else None,
        running=r.running if r else None,
        waiting=r.waiting if r else None,
        preemptions_total=round(r.preemptions_total)
        if r and r.preemptions_total is not None
        else None,
        preemption_rate_per_second=fig.preemption_rate_per_second,
        arrival_rate_per_second=d.arrivals if d else None,
        departure_rate_per_second=d.departures if d else None,
        kv_block_seconds_per_second=d.block_seconds if d else None,
        kv_demand_blocks=d.demand_blocks if d else None,
        demand_window_seconds=d.window_seconds if d else None,
        requests_arrived_total=r.requests_arrived_total if r else None,
        requests_departed_total=r.requests_departed_total if r else None,
        kv_block_seconds_total=fig.block_seconds_total,
        window_seconds=cfg.window,
        forecast_window_seconds=cfg.forecast_window,
        engine_restarts_total=fig.restarts_total,
    )
