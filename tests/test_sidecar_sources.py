"""Parsing the engine's `/stats` body (the `StatsSnapshot` contract) into a reading."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from synthetic_engine import SyntheticEngine

from headroom.contract.stats import STATS_SCHEMA_VERSION, TTFT_BUCKETS_S
from headroom.sidecar.poller import parse_body
from headroom.sidecar.sources import GarbageError, parse_headroom_stats


def _engine() -> SyntheticEngine:
    eng = SyntheticEngine(capacity=100, block_size=16, bytes_per_token=131072, model="tiny")
    eng.cached = 10
    eng.set_used(40)
    eng.queries_tokens_total, eng.hits_tokens_total = 500, 125
    eng.running, eng.waiting, eng.preemptions_total = 3, 2, 4
    eng.observe_ttft(0.02)
    eng.observe_ttft(3.0)
    return eng


def test_parses_a_snapshot() -> None:
    eng = _engine()
    r = parse_headroom_stats(eng.body())
    assert r.source == "headroom"
    assert r.model == "tiny" and r.instance_id == eng.instance_id
    assert (r.capacity_blocks, r.used_blocks, r.cached_blocks, r.free_blocks) == (100, 40, 10, 50)
    assert r.occupancy == pytest.approx(0.40)  # cached blocks are not "used"
    assert (r.block_size, r.bytes_per_token) == (16, 131072)
    assert r.prefix_cache_enabled is True
    assert (r.prefix_queries_tokens_total, r.prefix_hits_tokens_total) == (500, 125)
    assert (r.running, r.waiting, r.swapped, r.preemptions_total) == (3, 2, 0, 4)
    assert r.ttft is not None
    assert r.ttft.bounds == TTFT_BUCKETS_S
    assert r.ttft.count == 2 and r.ttft.sum == pytest.approx(3.02)
    assert r.ttft.counts[TTFT_BUCKETS_S.index(0.025)] == 1
    assert r.ttft.counts[-1] == 2


def test_demand_counters_are_the_engines_own() -> None:
    """headroom's /stats counts arrivals, their prompt tokens, block-seconds and departures
    itself: exact, read as they are."""
    eng = _engine()
    eng.requests_arrived_total, eng.prompt_tokens_arrived_total = 12, 5000
    eng.kv_block_seconds_total, eng.requests_finished_total = 812.5, 9
    r = parse_headroom_stats(eng.body())
    assert (r.requests_arrived_total, r.prompt_tokens_arrived_total) == (12, 5000)
    assert (r.kv_block_seconds_total, r.requests_departed_total) == (812.5, 9)


@pytest.mark.parametrize("total", [math.inf, 1e308, 2.0**53 * 2])
def test_block_seconds_no_engine_holds_are_garbage(total: float) -> None:
    # 1e308 passed as finite and made the Little's-law demand +Inf on /metrics.
    doc = {**_doc(), "kv_block_seconds_total": total}
    with pytest.raises(GarbageError, match="kv_block_seconds_total"):
        parse_headroom_stats(json.dumps(doc).encode())


def test_empty_pool_is_zero_occupancy() -> None:
    eng = SyntheticEngine(capacity=0)
    assert parse_headroom_stats(eng.body()).occupancy == 0.0


def _doc() -> dict[str, object]:
    doc: dict[str, object] = json.loads(_engine().body())
    return doc


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"", "not a StatsSnapshot"),
        (b"<html>502</html>", "not a StatsSnapshot"),
        (b"[1, 2, 3]", "not a StatsSnapshot"),
        (json.dumps({**_doc(), "version": STATS_SCHEMA_VERSION + 1}).encode(), "version"),
        (json.dumps({**_doc(), "surprise": 1}).encode(), "not a StatsSnapshot"),
        (json.dumps({k: v for k, v in _doc().items() if k != "kv"}).encode(), "kv"),
        (
            json.dumps({**_doc(), "kv": {**_doc()["kv"], "used": 99}}).encode(),  # type: ignore[dict-item]
            "do not add up",
        ),
        (
            json.dumps({**_doc(), "preemptions_total": -1}).encode(),
            "preemptions_total",
        ),
    ],
)
def test_garbage(body: bytes, why: str) -> None:
    with pytest.raises(GarbageError, match=why):
        parse_headroom_stats(body)


def test_histogram_that_is_not_cumulative_is_garbage() -> None:
    doc = _doc()
    hist = dict(doc["time_to_first_token_seconds"])  # type: ignore[call-overload]
    hist["counts"] = [5] + [0] * (len(TTFT_BUCKETS_S) - 1)
    doc["time_to_first_token_seconds"] = hist
    with pytest.raises(GarbageError, match="cumulative"):
        parse_headroom_stats(json.dumps(doc).encode())
    hist["counts"] = [0] * 3
    with pytest.raises(GarbageError, match="buckets but"):
        parse_headroom_stats(json.dumps(doc).encode())


@pytest.mark.parametrize("bound", [math.nan, math.inf, -math.inf])
def test_a_bucket_bound_that_is_not_finite_is_garbage(bound: float) -> None:
    # JSON's NaN and Infinity parse: they would be exported as le="nan" or a second +Inf bucket.
    doc = _doc()
    hist = dict(doc["time_to_first_token_seconds"])  # type: ignore[call-overload]
    bounds = list(hist["buckets"])
    bounds[-1 if bound > 0 else 1] = bound
    hist["buckets"] = bounds
    doc["time_to_first_token_seconds"] = hist
    with pytest.raises(GarbageError, match="a bucket bound is not a finite number"):
        parse_headroom_stats(json.dumps(doc).encode())


@pytest.mark.parametrize(
    ("source", "body", "reading_source"),
    [
        ("headroom", _engine().body(), "headroom"),
        ("vllm", b"vllm:kv_cache_usage_perc 0.5\n", "vllm"),
        ("sglang", b"sglang:token_usage 0.5\n", "sglang"),
    ],
)
def test_parse_body_dispatches_on_the_source(source: str, body: bytes, reading_source: str) -> None:
    assert parse_body(source, body).source == reading_source


def test_a_body_for_another_source_is_garbage() -> None:
    """`--source` set to the wrong engine type reads as garbage, naming what was missing."""
    with pytest.raises(GarbageError, match="no sglang:token_usage"):
        parse_body("sglang", b"vllm:kv_cache_usage_perc 0.5\n")
    with pytest.raises(GarbageError, match="vllm:kv_cache_usage_perc"):
        parse_body("vllm", b"sglang:token_usage 0.5\n")
    with pytest.raises(GarbageError, match="not a StatsSnapshot"):
        parse_body("headroom", b"sglang:token_usage 0.5\n")


@pytest.mark.parametrize("field", ["time_to_first_token_seconds", "time_per_output_token_seconds"])
@pytest.mark.parametrize("bad_sum", [math.nan, -5.0, math.inf])
def test_histogram_sum_that_is_not_a_non_negative_number_is_garbage(
    field: str, bad_sum: float
) -> None:
    """A `_sum` of NaN or -5 is as wrong as a negative count: the body is rejected, not passed
    on to Prometheus (json.dumps writes NaN and Infinity, which pydantic accepts)."""
    doc = _doc()
    doc[field] = {**doc[field], "sum": bad_sum}  # type: ignore[dict-item]
    with pytest.raises(GarbageError, match="sum"):
        parse_headroom_stats(json.dumps(doc).encode())


def test_block_seconds_up_to_2_to_the_53_are_read() -> None:
    """The block-seconds bound is the counts' own, 2**53 inclusive (test_counts_up_to_...)."""
    doc = {**_doc(), "kv_block_seconds_total": 2.0**53}
    assert parse_headroom_stats(json.dumps(doc).encode()).kv_block_seconds_total == 2.0**53


def _with_ttft(**edit: object) -> bytes:
    doc = _doc()
    doc["time_to_first_token_seconds"] = {**doc["time_to_first_token_seconds"], **edit}  # type: ignore[dict-item]
    return json.dumps(doc).encode()


def test_a_histogram_with_a_repeated_bound_is_garbage() -> None:
    """Two buckets with one `le` make a series given twice, which Prometheus refuses."""
    bounds = list(TTFT_BUCKETS_S)
    bounds[1] = bounds[0]
    with pytest.raises(GarbageError, match="bucket bounds are not increasing"):
        parse_headroom_stats(_with_ttft(buckets=bounds))


def test_a_histogram_with_negative_counts_is_garbage() -> None:
    """The contract types the counts as ints only: -1 everywhere is cumulative, yet no count."""
    n = len(TTFT_BUCKETS_S)
    with pytest.raises(GarbageError, match="a bucket count is not a non-negative number"):
        parse_headroom_stats(_with_ttft(counts=[-1] * n, count=-1))


def test_a_reading_is_immutable() -> None:
    """The state keeps readings across polls and scrapes read them: none may be edited."""
    reading = parse_headroom_stats(_engine().body())
    with pytest.raises(dataclasses.FrozenInstanceError):
        reading.occupancy = 0.0  # type: ignore[misc]
    assert reading.ttft is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        reading.ttft.count = 0.0  # type: ignore[misc]
