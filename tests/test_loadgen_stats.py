"""Load generator pure parts: workload schedule and prompts, percentiles, summaries, progress."""

from __future__ import annotations

import io
import math
import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from headroom.engine.loadgen.client import (
    LoadResult,
    RequestRecord,
    RunState,
    StatsSample,
    parse_stats,
)
from headroom.engine.loadgen.progress import ProgressBar, render_line
from headroom.engine.loadgen.stats import (
    Distribution,
    percentile,
    records_csv,
    render_summary,
    summarize,
    summarize_engine,
)
from headroom.engine.loadgen.workload import LengthDist, PromptFactory, WorkloadSpec


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_matches_numpy_linear(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-6)


def test_percentile_edge_cases() -> None:
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_spec_needs_exactly_one_bound_and_a_prefix_length() -> None:
    with pytest.raises(ValidationError, match="exactly one"):
        WorkloadSpec()
    with pytest.raises(ValidationError, match="exactly one"):
        WorkloadSpec(num_requests=3, duration_s=1.0)
    with pytest.raises(ValidationError, match="prefix_len"):
        WorkloadSpec(num_requests=3, shared_prefix_fraction=0.5)
    with pytest.raises(ValidationError, match="ramp_s"):
        WorkloadSpec(num_requests=3, ramp_to=8)


def test_ramp_schedule_steps_from_start_to_end() -> None:
    # The levels 1..5 each hold 2 s of the 10 s ramp, 5 included: with the ramp as long as the
    # run (the default), a schedule that reached 5 only at t = 10 would never dispatch at it.
    spec = WorkloadSpec(duration_s=10.0, concurrency=1, ramp_to=5)
    levels = [spec.concurrency_at(t) for t in (0, 1.99, 2.01, 5.0, 7.99, 8.01, 9.99, 10, 100)]
    assert levels == [1, 1, 2, 3, 4, 5, 5, 5, 5]
    assert spec.max_concurrency == 5
    down = WorkloadSpec(num_requests=10, concurrency=8, ramp_to=2, ramp_s=7.0)
    assert [down.concurrency_at(t) for t in (0, 0.99, 1.01, 3.5, 5.99, 6.01, 7)] == [
        8, 8, 7, 5, 3, 2, 2
    ]  # fmt: skip
    assert WorkloadSpec(num_requests=1, concurrency=3).concurrency_at(50) == 3


@pytest.mark.parametrize(("start", "end"), [(1, 32), (32, 1), (4, 5), (7, 7)])
def test_a_ramp_as_long_as_the_run_spends_an_equal_share_at_every_level(
    start: int, end: int
) -> None:
    # README's form: `-c 1 --ramp-to 32 --duration 60`, the ramp's length defaulting to the
    # run's. Sending stops at t = 60, so every level must be reached before it.
    spec = WorkloadSpec(duration_s=60.0, concurrency=start, ramp_to=end)
    ticks = [spec.concurrency_at(i / 100) for i in range(6000)]  # t in [0, 60)
    counts = {c: ticks.count(c) for c in set(ticks)}
    lo, hi = min(start, end), max(start, end)
    assert set(counts) == set(range(lo, hi + 1))
    share = 6000 / (hi - lo + 1)
    assert all(abs(n - share) <= 1 for n in counts.values()), counts
    assert ticks == sorted(ticks, reverse=end < start)


def test_length_distributions_stay_in_bounds_and_center() -> None:
    rng = random.Random(1)
    for kind in ("fixed", "uniform", "normal", "exponential"):
        d = LengthDist(kind=kind, mean=100, spread=0.5, max=400)
        xs = [d.sample(rng) for _ in range(2000)]
        assert all(1 <= x <= 400 for x in xs)
        assert 80 < sum(xs) / len(xs) < 120, kind
    assert {LengthDist(mean=7).sample(rng) for _ in range(10)} == {7}


def test_prompts_share_exactly_the_prefix_and_scale_with_the_ratio() -> None:
    spec = WorkloadSpec(
        num_requests=200, prompt_len=LengthDist(mean=20), shared_prefix_fraction=0.5,
        prefix_len=60, seed=3,
    )  # fmt: skip
    factory = PromptFactory(spec, tokens_per_word=2.0)
    reqs = [factory.make(i) for i in range(200)]
    shared = [r for r in reqs if r.shared_prefix]
    assert 60 < len(shared) < 140
    assert all(r.prompt.startswith(factory.prefix + " ") for r in shared)
    assert all(r.prompt_tokens == 80 for r in shared)
    assert len(factory.prefix.split()) == 30
    unique = [r for r in reqs if not r.shared_prefix]
    assert all(len(r.prompt.split()) == 10 for r in unique)
    # Unique prompts differ from each other early (else the prefix cache would hit on them).
    heads = {" ".join(r.prompt.split()[:5]) for r in unique}
    assert len(heads) == len(unique)
    again = PromptFactory(spec, tokens_per_word=2.0)
    assert [again.make(i) for i in range(200)] == reqs


def test_disconnects_are_seeded_and_leave_the_prompts_alone() -> None:
    spec = WorkloadSpec(num_requests=400, output_len=LengthDist(mean=16), seed=4)
    chaos = spec.model_copy(update={"disconnect_fraction": 0.25})
    plain_factory, chaos_factory = PromptFactory(spec, 1.5), PromptFactory(chaos, 1.5)
    plain = [plain_factory.make(i) for i in range(400)]
    hung = [chaos_factory.make(i) for i in range(400)]
    assert all(r.disconnect_after is None for r in plain)
    assert [(r.prompt, r.max_tokens) for r in hung] == [(r.prompt, r.max_tokens) for r in plain]
    cut = [r for r in hung if r.disconnect_after is not None]
    assert 60 < len(cut) < 140
    assert all(0 <= r.disconnect_after < r.max_tokens for r in cut)  # type: ignore[operator]
    again = PromptFactory(chaos, 1.5)
    assert [again.make(i) for i in range(400)] == hung


def _rec(i: int, ttft: float, tpot: float, out: int = 10, ok: bool = True, c: int = 1,
         err: str | None = None) -> RequestRecord:  # fmt: skip
    return RequestRecord(
        index=i, start=0.0, concurrency=c, shared_prefix=False, ok=ok, error=err,
        prompt_tokens=5 if ok else None, output_tokens=out if ok else 0, usage_reported=ok,
        ttft_s=ttft if ok else None, tpot_s=tpot if ok else None, e2e_s=ttft + tpot * 9,
    )  # fmt: skip


def _sample(t: float, used: int, q: int, h: int, p: int, c: int = 1,
            instance: str | None = None) -> StatsSample:  # fmt: skip
    return StatsSample(t=t, concurrency=c, used=used, capacity=100, queries_tokens=q,
                       hits_tokens=h, preemptions=p, running=used // 10, waiting=0,
                       instance_id=instance)  # fmt: skip


def test_engine_summary_uses_deltas_and_survives_a_restart() -> None:
    samples = [
        _sample(0, 0, 1000, 900, 5),  # traffic before the run must not count
        _sample(1, 50, 1100, 950, 6),
        _sample(2, 80, 1300, 1000, 6),
        _sample(3, 10, 40, 30, 1),  # engine restarted: counters went back
    ]
    e = summarize_engine(samples)
    assert e is not None
    assert (e.prefix_queries_tokens, e.prefix_hits_tokens, e.preemptions) == (340, 130, 2)
    assert e.hit_ratio == pytest.approx(130 / 340)
    assert e.peak_occupancy == pytest.approx(0.8)
    assert e.peak_used_blocks == 80
    assert summarize_engine([]) is None


def test_summary_counts_errors_by_type_and_levels() -> None:
    recs = [_rec(i, 0.1 * (i + 1), 0.01, c=1 if i < 4 else 2) for i in range(8)]
    recs.append(_rec(8, 0, 0, ok=False, err="http_400_invalid_request_error", c=2))
    recs.append(_rec(9, 0, 0, ok=False, err="timeout", c=2))
    recs.append(_rec(10, 0, 0, ok=False, err="timeout", c=2))
    samples = [_sample(0, 10, 0, 0, 0, c=1), _sample(1, 70, 100, 40, 0, c=2)]
    result = LoadResult(model="m", tokens_per_word=1.0, duration_s=2.0, records=recs,
                        samples=samples)  # fmt: skip
    s = summarize(result)
    assert (s.requests, s.ok, s.errors) == (11, 8, 3)
    assert s.errors_by_type == {"timeout": 2, "http_400_invalid_request_error": 1}
    assert s.requests_per_s == pytest.approx(4.0)
    assert s.output_tokens == 80 and s.output_tokens_per_s == pytest.approx(40.0)
    assert s.ttft.p50 == pytest.approx(0.45)
    assert [lv.concurrency for lv in s.levels] == [1, 2]
    assert [lv.requests for lv in s.levels] == [4, 7]
    assert s.levels[1].errors == 3
    assert s.levels[1].peak_occupancy == pytest.approx(0.7)
    text = render_summary(s)
    assert "timeout x2" in text and "peak occupancy 70.0%" in text and "hit ratio 40.0%" in text
    csv_text = records_csv(recs)
    assert csv_text.splitlines()[0].startswith("index,start,concurrency")
    assert len(csv_text.splitlines()) == 12


def test_progress_line_and_non_tty_throttling() -> None:
    state = RunState(started=5, done=4, errors=1, in_flight=1, concurrency=2, output_tokens=400)
    line = render_line(state, 2.0, total=8, duration=None, width=10)
    assert line.startswith("[#####-----] 4/8 done")
    assert "200 tok/s" in line
    buf = io.StringIO()
    bar = ProgressBar(total=8, stream=buf, line_interval_s=3600)
    for _ in range(50):
        bar.update(state, 1.0)
    bar.close(state, 2.0)
    assert len(buf.getvalue().splitlines()) == 2  # one throttled line, one final line
    assert "\r" not in buf.getvalue()


def test_a_burst_between_polls_still_shows_in_peak_and_mean_occupancy() -> None:
    # Every poll sees an idle cache; the engine's blocks integral says 40 block-seconds were
    # held over the 4 s between the first poll and the last, so the peak was at least 10 blocks.
    def idle(t: float, block_seconds: float) -> StatsSample:
        return _sample(t, 0, 0, 0, 0).model_copy(
            update={"block_seconds": block_seconds, "snapshot_time": 100.0 + t}
        )

    run = [idle(0, 500.0), idle(2, 540.0), idle(4, 540.0)]
    e = summarize_engine(run)
    assert e is not None
    assert (e.peak_used_blocks, e.peak_occupancy, e.mean_occupancy) == (10, 0.1, 0.1)
    # A restart in between (the integral went back) proves nothing; an engine without the
    # fields falls back to the polls themselves.
    restarted = [run[0], run[1].model_copy(update={"block_seconds": 3.0}), run[2]]
    old = [s.model_copy(update={"block_seconds": None}) for s in run]
    for samples in (restarted, old):
        e = summarize_engine(samples)
        assert e is not None and (e.peak_used_blocks, e.peak_occupancy) == (0, 0.0)


def test_a_new_instance_id_is_a_restart_even_when_its_counters_are_higher() -> None:
    # /stats: a changed instance_id means the counters reset. Instance B restarted between the
    # 2nd and 3rd poll and its own counters are already past A's: all of B's count, from 0.
    def poll(t: float, inst: str, q: int, h: int, p: int, bs: float) -> StatsSample:
        return _sample(t, 10, q, h, p, instance=inst).model_copy(
            update={"block_seconds": bs, "snapshot_time": 100.0 + t}
        )

    samples = [
        poll(0, "A", 1000, 500, 5, 1000.0),
        poll(1, "A", 1010, 505, 5, 1010.0),
        poll(2, "B", 5000, 4000, 9, 5000.0),
        poll(3, "B", 5000, 4000, 9, 5010.0),
    ]
    e = summarize_engine(samples)
    assert e is not None
    assert (e.prefix_queries_tokens, e.prefix_hits_tokens, e.preemptions) == (5010, 4005, 9)
    assert e.hit_ratio == pytest.approx(4005 / 5010)
    # B's block-seconds integral started again at its start: across the restart it proves
    # nothing, so the mean comes from the polls (10 of 100 blocks in each).
    assert e.mean_occupancy == pytest.approx(0.1) and e.peak_used_blocks == 10
    # One instance throughout: the integral holds (10 block-seconds a second).
    same = [s.model_copy(update={"instance_id": "A"}) for s in samples]
    same = [same[0], same[1], same[1].model_copy(update={"block_seconds": 1030.0,
                                                         "snapshot_time": 103.0})]  # fmt: skip
    e = summarize_engine(same)
    assert e is not None and e.mean_occupancy == pytest.approx(0.1)
    assert (e.prefix_queries_tokens, e.preemptions) == (10, 0)


def test_parse_stats_reads_the_instance_id() -> None:
    body = {
        "instance_id": "b7",
        "time": 12.5,
        "kv": {"used": 3, "capacity": 8},
        "prefix_cache": {"queries_tokens_total": 7, "hits_tokens_total": 2},
        "requests": {"running": 1, "waiting": 0},
        "preemptions_total": 0,
        "kv_block_seconds_total": 4.0,
    }
    s = parse_stats(body, t=1.0, concurrency=2)
    assert (s.instance_id, s.used, s.snapshot_time, s.block_seconds) == ("b7", 3, 12.5, 4.0)
    del body["instance_id"]
    assert parse_stats(body, t=1.0, concurrency=2).instance_id is None


def test_a_run_without_usage_counts_says_so_instead_of_reporting_zero_prompt_tokens() -> None:
    with_usage = _rec(0, 0.1, 0.01)
    chunks_only = _rec(1, 0.1, 0.01).model_copy(
        update={"prompt_tokens": None, "usage_reported": False}
    )
    result = LoadResult(model="m", tokens_per_word=1.0, duration_s=2.0,
                        records=[with_usage, chunks_only], samples=[])  # fmt: skip
    s = summarize(result)
    assert (s.prompt_tokens, s.total_tokens_per_s) == (None, None)
    assert (s.requests_without_usage, s.output_tokens_estimated) == (1, True)
    assert s.output_tokens == 20  # the chunk count kept, as an estimate
    assert len(s.warnings) == 1 and "1 of 2 ok requests streamed no usage" in s.warnings[0]
    text = render_summary(s)
    assert "output tok/s (estimated)   - total tok/s" in text
    assert "WARNING: 1 of 2 ok requests streamed no usage counts" in text
    full = summarize(result.model_copy(update={"records": [with_usage]}))
    assert full.prompt_tokens == 5 and full.total_tokens_per_s == pytest.approx(7.5)
    assert (full.requests_without_usage, full.output_tokens_estimated, full.warnings) == (
        0, False, []
    )  # fmt: skip
    assert "WARNING" not in render_summary(full) and "(estimated)" not in render_summary(full)


def test_percentile_0_and_100_are_the_extremes() -> None:
    """q is in [0, 100] inclusive: 0 is the smallest value and 100 the largest."""
    assert (percentile([3.0, 1.0, 2.0], 0), percentile([3.0, 1.0, 2.0], 100)) == (1.0, 3.0)
    with pytest.raises(ValueError):
        percentile([1.0], -0.5)


def test_distribution_is_the_mean_and_the_50th_95th_and_99th_percentiles() -> None:
    """Distribution.of reports count, the arithmetic mean and p50/p95/p99 (NaN when empty)."""
    d = Distribution.of([float(i) for i in range(101)])
    assert (d.count, d.mean, d.p50, d.p95, d.p99) == (101, 50.0, 50.0, 95.0, 99.0)
    assert Distribution.of([1.0, 2.0, 3.0, 10.0]).mean == 4.0
    empty = Distribution.of([])
    assert empty.count == 0 and all(math.isnan(x) for x in (empty.mean, empty.p50, empty.p99))


def test_engine_summary_edges_one_poll_short_runs_capacity_and_peaks() -> None:
    """The integral is used over any positive span (a half-second run) and skipped over none
    (one poll); capacity is the last poll's, and none is 0% full; running and waiting report
    their peaks."""

    def timed(t: float, used: int, block_seconds: float) -> StatsSample:
        return _sample(t, used, 0, 0, 0).model_copy(
            update={"block_seconds": block_seconds, "snapshot_time": 100.0 + t}
        )

    one = summarize_engine([timed(0, 30, 5.0)])
    assert one is not None and (one.peak_used_blocks, one.mean_occupancy) == (30, 0.3)
    short = summarize_engine([timed(0, 0, 100.0), timed(0.5, 0, 105.0)])
    assert short is not None
    assert (short.peak_used_blocks, short.peak_occupancy, short.mean_occupancy) == (10, 0.1, 0.1)
    # Restarted with twice the cache, half full before and after: the cache is the new one.
    grown = [_sample(0, 50, 0, 0, 0), _sample(1, 100, 0, 0, 0).model_copy(update={"capacity": 200})]
    e = summarize_engine(grown)
    assert e is not None and (e.capacity_blocks, e.peak_occupancy) == (200, 0.5)
    none = summarize_engine([_sample(0, 0, 0, 0, 0).model_copy(update={"capacity": 0})])
    assert none is not None and (none.peak_occupancy, none.mean_occupancy) == (0.0, 0.0)
    polls = [_sample(t, 0, 0, 0, 0).model_copy(update={"running": r, "waiting": w})
             for t, r, w in [(0, 3, 0), (1, 7, 4), (2, 2, 1)]]  # fmt: skip
    e = summarize_engine(polls)
    assert e is not None and (e.peak_running, e.peak_waiting) == (7, 4)


def test_summary_rates_over_a_short_or_zero_duration_and_zero_prompt_tokens() -> None:
    """Rates divide by any positive duration (half a second doubles them) and are NaN for none;
    a usage count of 0 prompt tokens adds 0."""
    zero_prompt = _rec(1, 0.1, 0.01).model_copy(update={"prompt_tokens": 0})
    result = LoadResult(model="m", tokens_per_word=1.0, duration_s=0.5,
                        records=[_rec(0, 0.1, 0.01), zero_prompt], samples=[])  # fmt: skip
    s = summarize(result)
    assert (s.requests_per_s, s.output_tokens_per_s, s.prompt_tokens) == (4.0, 40.0, 5)
    assert s.total_tokens_per_s == 50.0
    instant = summarize(result.model_copy(update={"duration_s": 0.0}))
    assert all(math.isnan(x) for x in (instant.requests_per_s, instant.output_tokens_per_s))


def test_a_ramp_reports_each_levels_percentiles_and_peak_occupancy_in_ms_and_percent() -> None:
    """Per level: TTFT p50/p95, TPOT p50 and the highest occupancy polled at it ("-" where no
    poll fell); the latency table and rows are in milliseconds; a one-level run has no rows."""
    recs = [_rec(i, 0.1 * (i + 1), 0.01 * (i + 1)) for i in range(5)]
    recs.append(_rec(5, 1.0, 0.1, c=2))
    samples = [_sample(0, 20, 0, 0, 0), _sample(1, 60, 0, 0, 0), _sample(2, 40, 0, 0, 0)]
    result = LoadResult(model="m", tokens_per_word=1.0, duration_s=3.0, records=recs,
                        samples=samples)  # fmt: skip
    s = summarize(result)
    one, two = s.levels
    assert (one.ttft_p50_s, one.ttft_p95_s, one.tpot_p50_s) == pytest.approx((0.3, 0.48, 0.03))
    assert (one.peak_occupancy, two.peak_occupancy) == (0.6, None)
    assert (s.tpot.count, s.tpot.mean) == (6, pytest.approx(0.25 / 6))
    assert (s.e2e.count, s.e2e.mean) == (6, pytest.approx((2.5 + 9 * 0.25) / 6))
    lines = render_summary(s).splitlines()
    ttft = next(line for line in lines if line.startswith("TTFT"))
    assert ttft.split()[1:] == ["416.7", "350.0", "875.0", "975.0"]
    assert lines[lines.index(next(x for x in lines if "concurrency" in x)) + 1 :][:2] == [
        f"{1:>11}{5:>10}{'300.0':>10}{'480.0':>10}{'30.0':>10}{'60%':>9}",
        f"{2:>11}{1:>10}{'1,000.0':>10}{'1,000.0':>10}{'100.0':>10}{'-':>9}",
    ]
    flat = summarize(result.model_copy(update={"records": recs[:5]}))
    assert flat.levels == [] and "concurrency" not in render_summary(flat)


def test_an_engine_restarted_with_another_pool_size_is_read_poll_by_poll() -> None:
    """150 of 200 blocks, then a restart with 100 blocks holding 10: the peak is the first
    poll's 75 % (150/200), not 150 of the last poll's 100 clamped to 100 %, and the mean is
    the polls' own occupancies averaged."""
    polls = [
        StatsSample(t=0, concurrency=1, used=150, capacity=200, queries_tokens=0,
                    hits_tokens=0, preemptions=0, running=0, waiting=0, instance_id="a"),
        StatsSample(t=1, concurrency=1, used=10, capacity=100, queries_tokens=0,
                    hits_tokens=0, preemptions=0, running=0, waiting=0, instance_id="b"),
    ]  # fmt: skip
    e = summarize_engine(polls)
    assert e is not None
    assert (e.peak_used_blocks, e.capacity_blocks, e.peak_occupancy) == (150, 200, 0.75)
    assert e.mean_occupancy == pytest.approx((0.75 + 0.1) / 2)
