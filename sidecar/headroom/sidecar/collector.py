"""The prometheus-client collector that renders the metric contract (shared/DESIGN.md).

A custom collector over a per-sidecar registry, not the global one: each scrape derives the
figures afresh, and a value the sidecar does not have (engine down, stale, not reported by the
source, forecast not ready) is simply not emitted. Only `headroom_engine_up` and the sidecar's
own counters are always present.

Beyond the contract table, three series, each for a consumer:
- `headroom_sidecar_poll_errors_total{reason}`: why `headroom_engine_up` is 0. The reasons
  are unreachable, timeout, http_status, garbage and internal, all pre-set to 0 so that
  `rate()` works from the first scrape. This is what the HeadroomEngineDown runbook checks.
- `headroom_sidecar_engine_restarts_total`: explains a counter reset (and a restarted
  forecast) when it is seen in a graph.
- `headroom_prefix_cache_enabled`: lets HeadroomPrefixCacheIneffective skip engines that run
  with caching off.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import CollectorRegistry

from headroom.contract import metric_names as names_
from headroom.sidecar.config import SidecarConfig
from headroom.sidecar.sources import HistogramReading
from headroom.sidecar.state import Figures, PollState, figures

LABEL_NAMES = ("model", "namespace", "inferencedeployment", "pod")


class SidecarCollector:
    """Collects the headroom metrics from a `PollState` at scrape time."""

    def __init__(
        self, state: PollState, cfg: SidecarConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._state = state
        self._cfg = cfg
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        """Yield every family that has a value now."""
        fig = figures(self._state, self._cfg, self._clock())
        yield from render(fig, self._cfg)


def make_registry(collector: SidecarCollector) -> CollectorRegistry:
    """A fresh registry holding only this sidecar's collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def _labels(fig: Figures, cfg: SidecarConfig) -> tuple[list[str], list[str]]:
    values = {
        "model": fig.model or "",
        "namespace": cfg.labels.namespace,
        "inferencedeployment": cfg.labels.inferencedeployment,
        "pod": cfg.labels.pod,
    }
    names = [n for n in LABEL_NAMES if values[n]]
    return names, [values[n] for n in names]


def render(fig: Figures, cfg: SidecarConfig) -> Iterator[Metric]:
    """The metric families for one set of figures."""
    names, values = _labels(fig, cfg)

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=names)
        g.add_metric(values, value)
        return g

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=names)
        c.add_metric(values, value)
        return c

    yield gauge(
        "headroom_engine_up",
        "1 when the last poll of the engine succeeded and is fresh",
        1.0 if fig.fresh else 0.0,
    )
    errors = CounterMetricFamily(
        "headroom_sidecar_poll_errors_total",
        "Engine polls that failed, by reason: unreachable, timeout, http_status, garbage, internal",
        labels=[*names, "reason"],
    )
    for reason, n_errors in fig.errors.items():
        errors.add_metric([*values, reason], n_errors)
    yield errors
    yield counter(
        "headroom_sidecar_engine_restarts_total",
        "Engine restarts seen by the sidecar (instance id changed or a counter went backwards)",
        fig.restarts_total,
    )

    r = fig.reading
    if r is None:
        return

    blocks = GaugeMetricFamily(
        "headroom_kv_blocks",
        "KV blocks in each state (cached = evictable prefix blocks)",
        labels=[*names, "state"],
    )
    for state, count in (
        ("free", r.free_blocks),
        ("used", r.used_blocks),
        ("cached", r.cached_blocks),
    ):
        if count is not None:
            blocks.add_metric([*values, state], count)
    if blocks.samples:
        yield blocks
    if r.capacity_blocks is not None:
        yield gauge("headroom_kv_blocks_capacity", "Total blocks in the KV pool", r.capacity_blocks)
    if cfg.planned_blocks is not None:  # beside the capacity, so the two share their labels
        yield gauge(
            names_.KV_BLOCKS_PLANNED,
            "KV pool blocks planned for this pod (--planned-blocks)",
            cfg.planned_blocks,
        )
    yield gauge(
        "headroom_kv_block_occupancy_ratio",
        "Used / capacity KV blocks (cached-but-evictable not counted as used)",
        r.occupancy,
    )
    if r.bytes_per_token is not None:
        yield gauge(
            "headroom_kv_bytes_per_token",
            "KV bytes per token from the budget model",
            r.bytes_per_token,
        )
    if r.prefix_queries_tokens_total is not None:
        yield counter(
            "headroom_prefix_cache_queries_tokens_total",
            "Prompt tokens looked up in the prefix cache",
            r.prefix_queries_tokens_total,
        )
    if r.prefix_hits_tokens_total is not None:
        yield counter(
            "headroom_prefix_cache_hits_tokens_total",
            "Prompt tokens found in the prefix cache",
            r.prefix_hits_tokens_total,
        )
    if r.prefix_cache_enabled is not None:
        yield gauge(
            "headroom_prefix_cache_enabled",
            "1 when the engine has prefix caching on",
            1.0 if r.prefix_cache_enabled else 0.0,
        )
    if fig.hit_ratio is not None:
        yield gauge(
            "headroom_prefix_cache_hit_ratio",
            f"Prefix-cache hit tokens / queried tokens over the last {cfg.window:g} s",
            fig.hit_ratio,
        )
    requests = GaugeMetricFamily(
        "headroom_requests", "Requests in each scheduler queue", labels=[*names, "state"]
    )
    for state, count in (("running", r.running), ("waiting", r.waiting), ("swapped", r.swapped)):
        if count is not None:
            requests.add_metric([*values, state], count)
    if requests.samples:
        yield requests
    if r.preemptions_total is not None:
        yield counter(
            "headroom_preemptions_total",
            "Sequences preempted for lack of KV blocks",
            r.preemptions_total,
        )
    for name, doc, total in (
        (names_.REQUESTS_ARRIVED, "Requests accepted by the engine (admitted or queued)",
         r.requests_arrived_total),
        (names_.PROMPT_TOKENS_ARRIVED, "Prompt tokens of the requests accepted",
         r.prompt_tokens_arrived_total),
        (names_.REQUESTS_DEPARTED, "Requests that left the engine: finished, aborted or failed",
         r.requests_departed_total),
        (names_.KV_BLOCK_SECONDS, "Integral of used KV blocks over time (block-seconds)",
         fig.block_seconds_total),
    ):  # fmt: skip
        if total is not None:
            yield counter(name, doc, total)
    # A gauge the contract keeps non-negative and finite: a product of two large rates can
    # overflow where each alone is fine.
    if (
        fig.demand is not None
        and fig.demand.demand_blocks is not None
        and math.isfinite(fig.demand.demand_blocks)
    ):
        yield gauge(
            names_.KV_DEMAND,
            # The configured window, not the span measured: HELP must not change per scrape.
            f"Arrival rate x block-seconds per departed request over the last {cfg.window:g} s "
            "(Little's law): the KV the current traffic holds at steady state",
            fig.demand.demand_blocks,
        )
    if fig.eta_seconds is not None:
        yield gauge(
            "headroom_kv_saturation_eta_seconds",
            "Forecast seconds until KV occupancy reaches 1.0 at the current growth "
            "(+Inf when not growing)",
            fig.eta_seconds,
        )
    for name, doc, hist in (
        ("headroom_time_to_first_token_seconds", "Time to first token", r.ttft),
        ("headroom_time_per_output_token_seconds", "Time per output token", r.tpot),
    ):
        if hist is not None:
            yield _histogram(name, doc, hist, names, values)


def _le(bound: float) -> str:
    # Prometheus's own spelling of a bound ("0.005", "1.0", "+Inf") keeps `le` values stable.
    return "+Inf" if math.isinf(bound) else repr(float(bound))


def _histogram(
    name: str, doc: str, h: HistogramReading, names: list[str], values: list[str]
) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(name, doc, labels=names)
    buckets = [(_le(b), c) for b, c in zip(h.bounds, h.counts, strict=True)]
    buckets.append(("+Inf", h.count))
    fam.add_metric(values, buckets, h.sum)
    return fam
