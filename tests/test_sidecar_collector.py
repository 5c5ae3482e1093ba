"""The exposition itself: the metric contract's names, types and labels, and what is left out."""

from __future__ import annotations

import math

import pytest
from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from synthetic_engine import SyntheticEngine

from headroom.contract import metric_names
from headroom.contract.demand import DemandRates
from headroom.contract.stats import TTFT_BUCKETS_S
from headroom.sidecar.collector import SidecarCollector, make_registry
from headroom.sidecar.config import IdentityLabels, SidecarConfig
from headroom.sidecar.saturation import build_report
from headroom.sidecar.sources import parse_headroom_stats
from headroom.sidecar.state import PollState, figures

# shared/DESIGN.md "Metric contract": family name (as the parser names it) -> type.
CONTRACT = {
    "headroom_engine_up": "gauge",
    "headroom_kv_blocks": "gauge",
    "headroom_kv_blocks_capacity": "gauge",
    "headroom_kv_block_occupancy_ratio": "gauge",
    "headroom_kv_bytes_per_token": "gauge",
    "headroom_prefix_cache_queries_tokens": "counter",
    "headroom_prefix_cache_hits_tokens": "counter",
    "headroom_prefix_cache_hit_ratio": "gauge",
    "headroom_requests": "gauge",
    "headroom_preemptions": "counter",
    "headroom_kv_saturation_eta_seconds": "gauge",
    "headroom_requests_arrived": "counter",
    "headroom_prompt_tokens_arrived": "counter",
    "headroom_kv_block_seconds": "counter",
    "headroom_kv_demand_blocks": "gauge",
    "headroom_time_to_first_token_seconds": "histogram",
    "headroom_time_per_output_token_seconds": "histogram",
}
# Beyond the contract, each justified in collector.py / README.md, "Alerts and runbook".
EXTRA = {
    "headroom_sidecar_poll_errors": "counter",
    "headroom_sidecar_engine_restarts": "counter",
    "headroom_prefix_cache_enabled": "gauge",
    # Departures: with arrivals and block-seconds, what a Prometheus-reading consumer needs
    # to compute the demand itself (the operator's `metricsSource: prometheus`).
    "headroom_requests_departed": "counter",
}
IDENTITY = {"model": "tiny", "namespace": "llm", "inferencedeployment": "chat", "pod": "chat-0"}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _setup() -> tuple[SyntheticEngine, PollState, SidecarConfig, Clock]:
    cfg = SidecarConfig(
        engine_url="http://127.0.0.1:1",
        labels=IdentityLabels(namespace="llm", inferencedeployment="chat", pod="chat-0"),
    )
    return SyntheticEngine(capacity=200, model="tiny"), PollState(horizon=61.0), cfg, Clock()


def _families(state: PollState, cfg: SidecarConfig, clock: Clock) -> dict[str, Metric]:
    text = generate_latest(make_registry(SidecarCollector(state, cfg, clock))).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _drive(eng: SyntheticEngine, state: PollState, clock: Clock, polls: int = 5) -> None:
    for _ in range(polls):
        eng.set_used(eng.used + 10)
        eng.queries_tokens_total += 64
        eng.hits_tokens_total += 16
        eng.running = 2
        # Two requests a second arrive and leave, each holding its blocks for a second.
        eng.requests_arrived_total += 2
        eng.prompt_tokens_arrived_total += 128
        eng.requests_finished_total += 2
        eng.kv_block_seconds_total += eng.used
        eng.observe_ttft(0.2)
        state.record_success(parse_headroom_stats(eng.body()), clock.t)
        clock.t += 1.0
    clock.t -= 1.0


def test_every_contract_metric_with_its_type_and_labels() -> None:
    eng, state, cfg, clock = _setup()
    _drive(eng, state, clock)
    fams = _families(state, cfg, clock)
    assert {n: f.type for n, f in fams.items()} == CONTRACT | EXTRA
    for fam in fams.values():
        for s in fam.samples:
            extra = set(s.labels) - set(IDENTITY)
            assert {k: s.labels[k] for k in IDENTITY} == IDENTITY, s
            allowed = {"state", "le", "reason"}
            assert extra <= allowed, s
    states = {s.labels["state"]: s.value for s in fams["headroom_kv_blocks"].samples}
    assert states == {"free": 150.0, "used": 50.0, "cached": 0.0}
    assert fams["headroom_kv_block_occupancy_ratio"].samples[0].value == pytest.approx(0.25)
    assert fams["headroom_prefix_cache_hit_ratio"].samples[0].value == pytest.approx(0.25)
    queues = {s.labels["state"]: s.value for s in fams["headroom_requests"].samples}
    assert queues == {"running": 2.0, "waiting": 0.0, "swapped": 0.0}
    assert fams["headroom_kv_saturation_eta_seconds"].samples[0].value == pytest.approx(15.0)
    reasons = {s.labels["reason"] for s in fams["headroom_sidecar_poll_errors"].samples}
    assert reasons == {"unreachable", "timeout", "http_status", "garbage", "internal"}


def test_counter_and_histogram_sample_names() -> None:
    eng, state, cfg, clock = _setup()
    _drive(eng, state, clock)
    fams = _families(state, cfg, clock)
    names = {s.name for f in fams.values() for s in f.samples}
    assert {
        "headroom_prefix_cache_queries_tokens_total",
        "headroom_prefix_cache_hits_tokens_total",
        "headroom_preemptions_total",
        "headroom_sidecar_poll_errors_total",
    } <= names
    ttft = fams["headroom_time_to_first_token_seconds"].samples
    buckets = [s for s in ttft if s.name.endswith("_bucket")]
    assert [s.labels["le"] for s in buckets] == [repr(b) for b in TTFT_BUCKETS_S] + ["+Inf"]
    le = {s.labels["le"]: s.value for s in buckets}
    assert le["0.1"] == 0 and le["0.25"] == 5 and le["+Inf"] == 5
    by_name = {s.name: s.value for s in ttft}
    assert by_name["headroom_time_to_first_token_seconds_count"] == 5
    assert by_name["headroom_time_to_first_token_seconds_sum"] == pytest.approx(1.0)


def test_down_engine_exports_only_up_and_sidecar_counters() -> None:
    eng, state, cfg, clock = _setup()
    _drive(eng, state, clock)
    state.record_error("unreachable", "connection refused")
    fams = _families(state, cfg, clock)
    assert set(fams) == {"headroom_engine_up", *EXTRA} - {
        "headroom_prefix_cache_enabled",
        "headroom_requests_departed",
    }
    assert fams["headroom_engine_up"].samples[0].value == 0.0
    assert fams["headroom_engine_up"].samples[0].labels["model"] == "tiny"


def test_stale_values_are_not_exported() -> None:
    eng, state, cfg, clock = _setup()
    _drive(eng, state, clock)
    clock.t += cfg.stale_after + 1  # no poll recorded since: the poller is wedged
    fams = _families(state, cfg, clock)
    assert fams["headroom_engine_up"].samples[0].value == 0.0
    assert "headroom_kv_block_occupancy_ratio" not in fams


def test_infinite_eta_is_exported_as_inf() -> None:
    eng, state, cfg, clock = _setup()
    for _ in range(4):
        state.record_success(parse_headroom_stats(eng.body()), clock.t)
        clock.t += 1
    text = generate_latest(make_registry(SidecarCollector(state, cfg, clock))).decode()
    assert 'headroom_kv_saturation_eta_seconds{inferencedeployment="chat",model="tiny",' in text
    line = next(x for x in text.splitlines() if x.startswith("headroom_kv_saturation_eta_seconds{"))
    assert line.endswith(" +Inf")


def test_unknown_labels_are_left_off() -> None:
    eng, state, _, clock = _setup()
    cfg = SidecarConfig(engine_url="http://127.0.0.1:1")
    eng.model = ""
    _drive(eng, state, clock)
    fams = _families(state, cfg, clock)
    sample = fams["headroom_kv_block_occupancy_ratio"].samples[0]
    assert sample.labels == {}


def test_the_demand_help_names_the_configured_window_and_stays_put_between_scrapes() -> None:
    eng, state, cfg, clock = _setup()
    helps = []
    for _ in range(2):  # the span measured grows from 4 s to 9 s between the scrapes
        _drive(eng, state, clock)
        clock.t += 1.0
        helps.append(_families(state, cfg, clock)["headroom_kv_demand_blocks"].documentation)
    assert helps[0] == helps[1]
    assert f"over the last {cfg.window:g} s" in helps[0]


def test_every_exported_family_is_a_contract_name() -> None:
    eng, state, _, clock = _setup()
    cfg = SidecarConfig(engine_url="http://127.0.0.1:1", planned_blocks=1024)
    _drive(eng, state, clock)
    exported = {m.name for m in SidecarCollector(state, cfg, clock).collect()}
    assert "headroom_kv_blocks_planned" in exported
    contract = {
        v.removesuffix("_total")
        for k, v in vars(metric_names).items()
        if k.isupper() and isinstance(v, str)
    }
    assert exported <= contract, exported - contract


def test_a_demand_that_overflows_is_left_off_not_exported_as_inf(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Little's law multiplies two rates: each within bounds, the product can overflow, and the
    # contract keeps the gauge finite (/saturation already sends null for it).
    eng, state, cfg, clock = _setup()
    _drive(eng, state, clock)
    assert "headroom_kv_demand_blocks" in _families(state, cfg, clock)
    monkeypatch.setattr(DemandRates, "demand_blocks", property(lambda _: math.inf))
    assert "headroom_kv_demand_blocks" not in _families(state, cfg, clock)


def test_engine_up_is_exactly_one_while_fresh() -> None:
    """`headroom_engine_up` is a 0/1 gauge: alerts and `sum()` over pods count it as such."""
    eng, state, cfg, clock = _setup()
    _drive(eng, state, clock)
    assert _families(state, cfg, clock)["headroom_engine_up"].samples[0].value == 1.0


@pytest.mark.parametrize(("enabled", "value"), [(True, 1.0), (False, 0.0)])
def test_prefix_cache_enabled_is_a_zero_or_one_gauge(enabled: bool, value: float) -> None:
    """HeadroomPrefixCacheIneffective skips engines with caching off by this 0/1 gauge."""
    eng, state, cfg, clock = _setup()
    eng.prefix_enabled = enabled
    _drive(eng, state, clock)
    fam = _families(state, cfg, clock)["headroom_prefix_cache_enabled"]
    assert [s.value for s in fam.samples] == [value]


def test_the_saturation_report_names_the_pod_as_the_metrics_do() -> None:
    """`/saturation` carries the identity labels `/metrics` does; an unset one is null."""
    eng, state, cfg, clock = _setup()
    _drive(eng, state, clock)
    report = build_report(figures(state, cfg, clock.t), cfg, now_unix=0.0)
    assert (report.pod, report.namespace, report.inferencedeployment) == ("chat-0", "llm", "chat")
    bare = SidecarConfig(engine_url="http://127.0.0.1:1")
    report = build_report(figures(state, bare, clock.t), bare, now_unix=0.0)
    assert (report.pod, report.namespace, report.inferencedeployment) == (None, None, None)


def test_the_saturation_report_counts_preemptions_as_a_whole_number() -> None:
    """The engine's preemption counter reaches `/saturation` as the int the contract types."""
    eng, state, cfg, clock = _setup()
    eng.preemptions_total = 3
    _drive(eng, state, clock)
    report = build_report(figures(state, cfg, clock.t), cfg, now_unix=0.0)
    assert report.preemptions_total == 3 and isinstance(report.preemptions_total, int)
