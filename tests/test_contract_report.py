"""The contract's wire models and the admission watermark, as their peers rely on them: the
sidecar's `SaturationReport`, the engine's `StatsSnapshot`, and `headroom.contract.admission`."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from headroom.contract.admission import DEFAULT_WATERMARK, watermark_blocks
from headroom.contract.report import SaturationReport
from headroom.contract.stats import (
    Histogram,
    KVBlockStats,
    PrefixCacheStats,
    RequestStats,
    SchedulerStats,
    StatsSnapshot,
)
from headroom.engine.config import EngineConfig


def stale_report(**kw: Any) -> SaturationReport:
    """A report of an engine that is down: `fresh` false and every figure None."""
    base: dict[str, Any] = dict(
        time=1000.0, source="headroom", pod="chat-0", namespace="llm", inferencedeployment="chat",
        model=None, engine_up=False, fresh=False, age_seconds=None, stale_after_seconds=10.0,
        last_error="connection refused", occupancy=None, used_blocks=None, capacity_blocks=None,
        cached_blocks=None, block_size=None, bytes_per_token=None, growth_blocks_per_second=None,
        growth_ratio_per_second=None, eta_seconds=None, forecast_ready=False, forecast_points=0,
        fit_points=0, hit_ratio=None, prefix_cache_enabled=None, running=None, waiting=None,
        preemptions_total=None, preemption_rate_per_second=None, window_seconds=60.0,
        forecast_window_seconds=30.0, engine_restarts_total=0,
    )  # fmt: skip
    base.update(kw)
    return SaturationReport(**base)


def kv(**kw: Any) -> KVBlockStats:
    base: dict[str, Any] = dict(
        block_size=16, capacity=100, free=60, used=30, cached=10, bytes_per_token=4096
    )
    base.update(kw)
    return KVBlockStats(**base)


def snapshot() -> StatsSnapshot:
    return StatsSnapshot(
        model="m",
        instance_id="i",
        started_at=1.0,
        time=2.0,
        kv=kv(),
        prefix_cache=PrefixCacheStats(enabled=True, queries_tokens_total=0, hits_tokens_total=0),
        requests=RequestStats(running=0, waiting=0),
        preemptions_total=0,
        steps_total=0,
    )


def test_both_bodies_are_schema_version_1_on_the_wire() -> None:
    """A bumped version makes every deployed sidecar (or operator) refuse the new peer's body."""
    assert snapshot().model_dump()["version"] == 1
    report = stale_report()
    assert report.model_dump()["version"] == 1
    body = report.model_dump()
    body["version"] = 2
    with pytest.raises(ValidationError, match="version"):
        SaturationReport.model_validate(body)


def test_a_fresh_engines_body_with_every_counter_zero_parses_back() -> None:
    """At startup the engine sends explicit zeros; the sidecar must read them, not reject them."""
    body = snapshot().model_dump_json()
    assert StatsSnapshot.model_validate_json(body) == snapshot()
    assert SchedulerStats.model_validate(
        snapshot().model_dump(include=set(SchedulerStats.model_fields))
    )


def test_counters_an_older_engine_does_not_send_read_as_zero() -> None:
    """The counters added after version 1 shipped default to zero, so older bodies still parse."""
    snap = snapshot()
    assert (
        snap.requests_finished_total,
        snap.prompt_tokens_total,
        snap.requests_arrived_total,
        snap.prompt_tokens_arrived_total,
        snap.generation_tokens_total,
    ) == (0, 0, 0, 0, 0)
    assert snap.kv_block_seconds_total == 0.0
    assert snap.requests.swapped == 0
    assert (snap.time_to_first_token_seconds, snap.time_per_output_token_seconds) == (None, None)


def test_a_saturation_report_cannot_be_changed_once_made() -> None:
    """The operator keeps reports it received; one changed in place would not be what was sent."""
    report = stale_report()
    with pytest.raises(ValidationError, match="frozen"):
        report.fresh = True  # type: ignore[misc]
    with pytest.raises(ValidationError, match="extra"):
        stale_report(occupancy_percent=42.0)


def test_a_stats_snapshot_cannot_be_changed_once_made() -> None:
    """A snapshot is one instant of the engine: its parts are frozen like the snapshot."""
    snap = snapshot()
    with pytest.raises(ValidationError, match="frozen"):
        snap.kv.used = 0  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        snap.steps_total = 1  # type: ignore[misc]


def test_a_pool_that_does_not_know_its_kv_bytes_reports_zero_not_an_error() -> None:
    """`scheduler_stats` reports 0 bytes per token when no budget model priced the pool."""
    assert kv(bytes_per_token=0).bytes_per_token == 0
    with pytest.raises(ValidationError, match="bytes_per_token"):
        kv(bytes_per_token=-1)


def test_a_scheduler_that_has_not_run_yet_reports_zeros() -> None:
    """A fresh engine has no preemptions and no step timed: zero is a valid count, and an
    empty histogram counts nothing."""
    fresh = SchedulerStats(
        kv=kv(),
        prefix_cache=PrefixCacheStats(enabled=False, queries_tokens_total=0, hits_tokens_total=0),
        requests=RequestStats(running=0, waiting=0),
        preemptions_total=0,
        steps_total=0,
        last_step_schedule_seconds=0.0,
    )
    assert (fresh.preemptions_total, fresh.last_step_schedule_seconds) == (0, 0.0)
    untimed = fresh.model_dump(exclude={"last_step_schedule_seconds"})
    assert SchedulerStats.model_validate(untimed).last_step_schedule_seconds == 0.0
    empty = Histogram(buckets=[0.1, 1.0], counts=[0, 0])
    assert (empty.count, empty.sum) == (0, 0.0)


def test_a_zero_watermark_which_the_engine_accepts_keeps_no_block_free() -> None:
    """`EngineConfig` takes watermark 0 (ge=0), so the rule must too, not raise at startup."""
    assert EngineConfig(watermark=0.0).watermark == 0.0
    assert watermark_blocks(0.0, 1000) == 0


def test_the_default_watermark_is_the_documented_five_percent() -> None:
    """The engine's default and the simulator's assumption: 5 % of the pool, not vLLM's 1 %."""
    assert DEFAULT_WATERMARK == 0.05
    assert EngineConfig().watermark == DEFAULT_WATERMARK
    assert watermark_blocks(DEFAULT_WATERMARK, 1000) == 50
