"""Summaries of a load run: latency percentiles, throughput, errors, and what the engine's
`/stats` said about the KV cache meanwhile. Pure functions over the client's records."""

from __future__ import annotations

import csv
import io
import itertools
import math
from collections import Counter
from collections.abc import Sequence

from pydantic import BaseModel

from headroom.engine.loadgen.client import LoadResult, RequestRecord, StatsSample

PERCENTILES = (50, 95, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class Distribution(BaseModel):
    """Mean and p50/p95/p99 of one latency, in seconds (NaN when nothing was measured)."""

    count: int
    mean: float
    p50: float
    p95: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        mean = sum(values) / len(values) if values else math.nan
        p50, p95, p99 = (percentile(values, q) for q in PERCENTILES)
        return cls(count=len(values), mean=mean, p50=p50, p95=p95, p99=p99)


class EngineSummary(BaseModel):
    """The KV cache during the run, from the `/stats` samples (counters as deltas)."""

    samples: int
    capacity_blocks: int
    peak_used_blocks: int
    peak_occupancy: float
    mean_occupancy: float
    hit_ratio: float | None
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    preemptions: int
    peak_running: int
    peak_waiting: int


class LevelSummary(BaseModel):
    """Requests dispatched at one concurrency level of a ramp."""

    concurrency: int
    requests: int
    errors: int
    ttft_p50_s: float
    ttft_p95_s: float
    tpot_p50_s: float
    peak_occupancy: float | None


class LoadSummary(BaseModel):
    """A run's report. When some ok request's stream had no `usage` chunk
    (`requests_without_usage` > 0), `prompt_tokens` and `total_tokens_per_s` are None (unknown,
    not 0), and `output_tokens`, its rate and TPOT count text chunks as tokens (an estimate:
    `output_tokens_estimated`); `warnings` says so in words."""

    model: str
    duration_s: float
    requests: int
    ok: int
    errors: int
    errors_by_type: dict[str, int]
    requests_per_s: float
    output_tokens: int
    prompt_tokens: int | None
    output_tokens_per_s: float
    total_tokens_per_s: float | None
    requests_without_usage: int = 0
    output_tokens_estimated: bool = False
    warnings: list[str] = []
    ttft: Distribution
    tpot: Distribution
    e2e: Distribution
    engine: EngineSummary | None = None
    levels: list[LevelSummary] = []


def summarize_engine(samples: Sequence[StatsSample]) -> EngineSummary | None:
    """Peak/mean occupancy and the run's hit ratio and preemptions, or None without samples.
    Counters are differenced between the first and last sample, so traffic before the run does
    not count; a restart in between (see `_restarted`) restarts the difference: the new
    instance's counters count from 0."""
    if not samples:
        return None
    queries = hits = preempt = 0
    for prev, cur in itertools.pairwise(samples):
        restarted = _restarted(prev, cur)
        base_q, base_h, base_p = (
            (0, 0, 0) if restarted else (prev.queries_tokens, prev.hits_tokens, prev.preemptions)
        )
        queries += cur.queries_tokens - base_q
        hits += cur.hits_tokens - base_h
        preempt += cur.preemptions - base_p
    capacity = samples[-1].capacity
    if any(s.capacity != capacity for s in samples):
        # A restart resized the pool: each poll is read against its own, and the peak is
        # reported as the blocks of the fullest poll.
        fullest = max(reversed(samples), key=lambda s: s.occupancy)  # the latest on a tie
        capacity, peak_used, peak = fullest.capacity, fullest.used, fullest.occupancy
        mean = sum(s.occupancy for s in samples) / len(samples)
    else:
        peak_used = max(s.used for s in samples)
        mean_used = _run_mean_used(samples)
        if mean_used is None:
            mean_used = sum(s.used for s in samples) / len(samples)
        else:
            # Polls can all fall between short requests; the run's mean is a floor on its peak.
            peak_used = max(peak_used, min(math.ceil(mean_used - 1e-6), capacity))
        peak = min(1.0, peak_used / capacity) if capacity else 0.0
        mean = min(1.0, mean_used / capacity) if capacity else 0.0
    return EngineSummary(
        samples=len(samples),
        capacity_blocks=capacity,
        peak_used_blocks=peak_used,
        peak_occupancy=peak,
        mean_occupancy=mean,
        hit_ratio=hits / queries if queries else None,
        prefix_queries_tokens=queries,
        prefix_hits_tokens=hits,
        preemptions=preempt,
        peak_running=max(s.running for s in samples),
        peak_waiting=max(s.waiting for s in samples),
    )


def _restarted(prev: StatsSample, cur: StatsSample) -> bool:
    """Whether the engine restarted between two polls: `/stats` says so by a new `instance_id`
    (its counters may already be past the old ones), an engine without one by a counter going
    backwards."""
    return (
        prev.instance_id != cur.instance_id
        or cur.queries_tokens < prev.queries_tokens
        or cur.hits_tokens < prev.hits_tokens
        or cur.preemptions < prev.preemptions
    )


def _run_mean_used(samples: Sequence[StatsSample]) -> float | None:
    """Mean used blocks from the first poll to the last, from the engine's block-seconds integral
    and its own clock; None without the fields or across a restart. Only the whole run is exact:
    a snapshot is published after each step, so one interval can carry a long step's share."""
    bs = [s.block_seconds for s in samples if s.block_seconds is not None]
    clock = [s.snapshot_time for s in samples if s.snapshot_time is not None]
    if len(bs) < len(samples) or len(clock) < len(samples):
        return None  # an engine without the fields
    if any(b < a for a, b in itertools.pairwise(bs)) or any(
        _restarted(p, c) for p, c in itertools.pairwise(samples)
    ):
        return None  # the engine restarted during the run: its integral started again
    span = clock[-1] - clock[0]
    return (bs[-1] - bs[0]) / span if span > 0 else None


def summarize_levels(
    records: Sequence[RequestRecord], samples: Sequence[StatsSample]
) -> list[LevelSummary]:
    """One row per concurrency level the run dispatched at (a ramp's steps)."""
    levels = sorted({r.concurrency for r in records})
    out = []
    for c in levels:
        rs = [r for r in records if r.concurrency == c]
        ttft = [r.ttft_s for r in rs if r.ttft_s is not None]
        tpot = [r.tpot_s for r in rs if r.tpot_s is not None]
        occ = [s.occupancy for s in samples if s.concurrency == c]
        out.append(
            LevelSummary(
                concurrency=c,
                requests=len(rs),
                errors=sum(not r.ok for r in rs),
                ttft_p50_s=percentile(ttft, 50),
                ttft_p95_s=percentile(ttft, 95),
                tpot_p50_s=percentile(tpot, 50),
                peak_occupancy=max(occ) if occ else None,
            )
        )
    return out


def summarize(result: LoadResult) -> LoadSummary:
    """Everything `headroom load` prints, from the records and samples of one run."""
    recs = result.records
    ok = [r for r in recs if r.ok]
    errors = Counter(r.error or "unknown" for r in recs if not r.ok)
    dur = result.duration_s if result.duration_s > 0 else math.nan
    out_tokens = sum(r.output_tokens for r in ok)
    no_usage = sum(not r.usage_reported for r in ok)
    prompt_tokens = None if no_usage else sum(r.prompt_tokens or 0 for r in ok)
    warnings = []
    if no_usage:
        warnings.append(
            f"{no_usage} of {len(ok)} ok requests streamed no usage counts (the server ignored "
            "stream_options.include_usage): prompt tokens and total tok/s are unknown; output "
            "tokens, output tok/s and time per output token count text chunks as tokens (an "
            "estimate, low if the server sends several tokens per chunk)"
        )
    return LoadSummary(
        model=result.model,
        duration_s=result.duration_s,
        requests=len(recs),
        ok=len(ok),
        errors=len(recs) - len(ok),
        errors_by_type=dict(errors.most_common()),
        requests_per_s=len(ok) / dur,
        output_tokens=out_tokens,
        prompt_tokens=prompt_tokens,
        output_tokens_per_s=out_tokens / dur,
        total_tokens_per_s=None if prompt_tokens is None else (out_tokens + prompt_tokens) / dur,
        requests_without_usage=no_usage,
        output_tokens_estimated=no_usage > 0,
        warnings=warnings,
        ttft=Distribution.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot=Distribution.of([r.tpot_s for r in ok if r.tpot_s is not None]),
        e2e=Distribution.of([r.e2e_s for r in ok if r.e2e_s is not None]),
        engine=summarize_engine(result.samples),
        levels=summarize_levels(recs, result.samples) if len({r.concurrency for r in recs}) > 1
        else [],
    )  # fmt: skip


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:,.1f}"


def render_summary(s: LoadSummary) -> str:
    """The human-readable report."""
    estimated = " (estimated)" if s.output_tokens_estimated else ""
    total = "-" if s.total_tokens_per_s is None else f"{s.total_tokens_per_s:,.1f}"
    lines = [
        f"model {s.model}: {s.requests} requests in {s.duration_s:.1f} s, "
        f"{s.ok} ok, {s.errors} errors",
        f"throughput  {s.requests_per_s:.2f} req/s   {s.output_tokens_per_s:,.1f} output tok/s"
        f"{estimated}   {total} total tok/s",
        *(f"WARNING: {w}" for w in s.warnings),
        "",
        f"{'latency (ms)':<22}{'mean':>10}{'p50':>10}{'p95':>10}{'p99':>10}",
    ]
    for name, d in (("TTFT", s.ttft), ("time per output token", s.tpot), ("end to end", s.e2e)):
        lines.append(f"{name:<22}{_ms(d.mean):>10}{_ms(d.p50):>10}{_ms(d.p95):>10}{_ms(d.p99):>10}")
    if s.errors_by_type:
        lines.append("")
        lines.append("errors: " + ", ".join(f"{k} x{v}" for k, v in s.errors_by_type.items()))
    if s.levels:
        lines += ["", f"{'concurrency':>11}{'requests':>10}{'TTFT p50':>10}{'TTFT p95':>10}"
                  f"{'TPOT p50':>10}{'peak KV':>9}"]  # fmt: skip
        for lv in s.levels:
            occ = "-" if lv.peak_occupancy is None else f"{lv.peak_occupancy:.0%}"
            lines.append(
                f"{lv.concurrency:>11}{lv.requests:>10}{_ms(lv.ttft_p50_s):>10}"
                f"{_ms(lv.ttft_p95_s):>10}{_ms(lv.tpot_p50_s):>10}{occ:>9}"
            )
    e = s.engine
    lines.append("")
    if e is None:
        lines.append("engine /stats: not sampled")
    else:
        hit = "-" if e.hit_ratio is None else f"{e.hit_ratio:.1%}"
        lines.append(
            f"engine KV: peak occupancy {e.peak_occupancy:.1%} ({e.peak_used_blocks}/"
            f"{e.capacity_blocks} blocks), mean {e.mean_occupancy:.1%}; prefix hit ratio {hit} "
            f"({e.prefix_hits_tokens:,}/{e.prefix_queries_tokens:,} tokens); "
            f"preemptions {e.preemptions}; peak running {e.peak_running}, waiting {e.peak_waiting}"
        )
    return "\n".join(lines)


CSV_FIELDS = tuple(RequestRecord.model_fields)


def records_csv(records: Sequence[RequestRecord]) -> str:
    """Per-request records as CSV (one header row, one row per request)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    w.writeheader()
    for r in records:
        w.writerow(r.model_dump())
    return buf.getvalue()
