"""Profile a trace before sizing for it: how many requests are in flight, how long they are, how
bursty their arrivals, how much their prompts overlap, and what that means for the KV cache.

In-flight concurrency assumes no queueing: a request is in flight from its arrival through its
prefill (`prefill_tps`) and its decode (`decode_tps` tokens per second), the same service model
the simulator uses. The verdict follows the decision matrix: paging always; prefix caching when
prompts really overlap; KV quantization only if the deployment is still memory-bound, and only
after `headroom kv-check` has validated it on the user's own long-context prompts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain

import numpy as np

from headroom.operator.simulate.trace import Trace

PERCENTILES = (50, 90, 95, 99)
# Of the share of in-flight KV that requests in flight together hold once: the low one sizes.
SHARED_PERCENTILES = (10, 50, 90)
BURST_WINDOWS = (1.0, 10.0, 60.0)
# A window's dispersion needs this many whole windows of the trace: the variance of one count is
# 0 and would read as perfectly regular arrivals, whatever they were.
MIN_BURST_WINDOWS = 10
# Below this ideal hit ratio the prefix cache's bookkeeping buys little; above it, turn it on.
PREFIX_WORTHWHILE = 0.10


@dataclass(frozen=True)
class Burstiness:
    """Arrival counts per window: index of dispersion (variance / mean: 1 for Poisson) and the
    busiest window against the mean."""

    window: float
    dispersion: float
    peak_to_mean: float


@dataclass(frozen=True)
class Profile:
    """What `headroom profile` reports."""

    name: str
    requests: int
    duration: float
    rate: float | None  # requests/s on average; None when all arrive at one instant
    concurrency: dict[int, float]  # percentile -> requests in flight
    concurrency_max: int
    kv_tokens: dict[int, float]  # percentile -> tokens held in flight
    kv_tokens_max: float
    context: dict[int, float]  # percentile -> prompt + output tokens
    prompt: dict[int, float]
    output: dict[int, float]
    burstiness: tuple[Burstiness, ...]
    # An unlimited cache, from the block ids of the trace as recorded (not of a --rate copy);
    # None if it has none.
    ideal_hit_ratio: float | None
    # Percentile -> share of in-flight KV that a paged cache holds once for several requests in
    # flight (SHARED_PERCENTILES, over the seconds with two or more); None without block ids.
    shared_in_flight: dict[int, float] | None
    decode_tps: float
    prefill_tps: float


def _pct(values: np.ndarray) -> dict[int, float]:
    if len(values) == 0:
        return dict.fromkeys(PERCENTILES, 0.0)
    return {p: float(np.percentile(values, p)) for p in PERCENTILES}


def in_flight(
    trace: Trace, decode_tps: float, prefill_tps: float, step: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """(requests, KV tokens) in flight at every `step` seconds (t = 0, step, ...), with no
    queueing."""
    n = math.ceil(trace.duration / step) + 2
    ends = trace.arrival + trace.prompt / prefill_tps + trace.output / decode_tps
    n = max(n, math.ceil(float(ends.max()) / step) + 2) if len(trace) else n
    count = np.zeros(n + 1)
    tokens = np.zeros(n + 1)
    # Sampled at instants, a request counts at k * step for arrival <= k * step < end: on
    # average its lifetime / step samples, so the mean is Little's law's rate x lifetime.
    # (Counting every step a request touches would add rate x step to every sample.)
    start = np.ceil(trace.arrival / step).astype(np.int64)
    stop = np.ceil(ends / step).astype(np.int64)
    np.add.at(count, start, 1)
    np.add.at(count, stop, -1)
    # Tokens held: the prompt from arrival, plus the output as it is decoded (the average of the
    # two ends over the request's life is enough for percentiles of the total).
    held = trace.prompt + trace.output / 2
    np.add.at(tokens, start, held)
    np.add.at(tokens, stop, -held)
    return np.cumsum(count)[:n], np.cumsum(tokens)[:n]


def burstiness(trace: Trace, window: float) -> Burstiness:
    """Dispersion and peak-to-mean of the arrival counts per whole `window` seconds (a last,
    partial window is left out: folded into the one before, it would read as a burst)."""
    bins = max(1, int(trace.duration // window))
    idx = (trace.arrival / window).astype(np.int64)
    counts = np.bincount(idx[idx < bins], minlength=bins)
    mean = float(counts.mean())
    if mean <= 0:
        return Burstiness(window, 0.0, 0.0)
    return Burstiness(window, float(counts.var()) / mean, float(counts.max()) / mean)


def ideal_hit_ratio(trace: Trace) -> float | None:
    """Prompt tokens an unlimited prefix cache would find: a block id seen before is a hit
    (ids are prefix-chained, so a repeated id means the whole prefix up to it repeats), over all
    the trace's prompt tokens (a request without ids, or with fewer than its prompt's blocks,
    hits nothing past its ids)."""
    if trace.prefix_blocks is None:
        return None
    # One flat array of every block id in arrival order: a block is a hit unless it is its id's
    # first occurrence (numpy, so that a million requests take seconds, not minutes).
    lengths = np.fromiter(map(len, trace.prefix_blocks), dtype=np.int64, count=len(trace))
    flat = np.fromiter(chain.from_iterable(trace.prefix_blocks), dtype=np.int64)
    if len(flat) == 0:
        return None
    bt = trace.prefix_block_tokens
    position = np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    size = np.minimum(bt, np.repeat(trace.prompt, lengths) - position * bt)
    hit = np.ones(len(flat), dtype=bool)
    hit[np.unique(flat, return_index=True)[1]] = False
    total = int(trace.prompt.sum())
    return int(size[hit].sum()) / total if total else None


def shared_in_flight(
    trace: Trace, decode_tps: float, prefill_tps: float, step: float = 1.0
) -> np.ndarray | None:
    """The share of in-flight KV tokens (as `in_flight` counts them) that a paged cache stores
    once for several requests, at every `step` seconds with two or more in flight: a prompt block
    another request in flight also holds. None without block ids.

    This, not the ideal hit ratio, is what prefix sharing saves in memory: a block found cached
    from a request that has finished is held again, by its new owner, like any other."""
    if trace.prefix_blocks is None or not any(trace.prefix_blocks):
        return None
    ends = trace.arrival + trace.prompt / prefill_tps + trace.output / decode_tps
    start = np.ceil(trace.arrival / step).astype(np.int64)
    stop = np.ceil(ends / step).astype(np.int64)
    bt = trace.prefix_block_tokens
    # Each request's blocks with their token counts (the last may be partial).
    blocks = [
        [(h, min(bt, int(p) - j * bt)) for j, h in enumerate(ids) if int(p) > j * bt]
        for ids, p in zip(trace.prefix_blocks, trace.prompt, strict=True)
    ]
    held = trace.prompt + trace.output / 2
    by_start = np.argsort(start, kind="stable")
    by_stop = np.argsort(stop, kind="stable")
    holders: dict[int, int] = {}
    shared = 0.0  # tokens held by a second (third, ...) holder of a block
    total = 0.0
    count = 0
    i = j = 0
    out: list[float] = []
    for k in range(int(start.min()), int(stop.max()) + 1):
        # A request counts at k for start <= k < stop (as in in_flight): leave, then arrive.
        while j < len(by_stop) and stop[by_stop[j]] <= k:
            r = int(by_stop[j])
            j += 1
            if start[r] >= stop[r]:
                continue  # never sampled in flight
            for h, n in blocks[r]:
                c = holders[h] - 1
                if c:
                    holders[h] = c
                    shared -= n
                else:
                    del holders[h]
            total -= held[r]
            count -= 1
        while i < len(by_start) and start[by_start[i]] <= k:
            r = int(by_start[i])
            i += 1
            if start[r] >= stop[r]:
                continue
            for h, n in blocks[r]:
                c = holders.get(h, 0)
                holders[h] = c + 1
                if c:
                    shared += n
            total += held[r]
            count += 1
        if count >= 2 and total > 0:
            out.append(min(1.0, max(0.0, shared / total)))
    return np.asarray(out)


def profile(
    trace: Trace,
    decode_tps: float = 20.0,
    prefill_tps: float = 10_000.0,
    recorded: Trace | None = None,
) -> Profile:
    """Profile `trace` under the given service rates. `recorded`: the trace `trace` was scaled
    from (`--rate`), whose prompts give the prefix figures: a scaled copy replays each request
    several times, and its copies would find each other's whole prompts cached (and would share
    them in flight)."""
    count, tokens = in_flight(trace, decode_tps, prefill_tps)
    duration = max(trace.duration, 1e-9)
    source = recorded if recorded is not None else trace
    shared = shared_in_flight(source, decode_tps, prefill_tps)
    return Profile(
        name=trace.name,
        requests=len(trace),
        duration=trace.duration,
        rate=len(trace) / trace.duration if trace.duration > 0 else None,
        concurrency=_pct(count),
        concurrency_max=int(count.max()) if len(count) else 0,
        kv_tokens=_pct(tokens),
        kv_tokens_max=float(tokens.max()) if len(tokens) else 0.0,
        context=_pct(trace.prompt + trace.output),
        prompt=_pct(trace.prompt),
        output=_pct(trace.output),
        burstiness=tuple(
            burstiness(trace, w) for w in BURST_WINDOWS if w * MIN_BURST_WINDOWS <= duration
        ),
        ideal_hit_ratio=ideal_hit_ratio(source),
        shared_in_flight=(
            None
            if shared is None
            else {
                q: float(np.percentile(shared, q)) if len(shared) else 0.0
                for q in SHARED_PERCENTILES
            }
        ),
        decode_tps=decode_tps,
        prefill_tps=prefill_tps,
    )
