"""Block pool, prefix cache and scheduler overhead, in CPython, without a model.

Every figure is the best of several repeats (the least disturbed by other processes on a
shared machine). The scheduler figure is one `schedule()` plus one `update()` with 256 running
decodes whose sampled tokens come back at once, i.e. the engine's per-step bookkeeping.

Run: .venv/bin/python -m bench.kv_pool [--repeats R]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from bench.verdicts import Verdicts, positive_int
from headroom.engine.block_pool import BlockPool
from headroom.engine.config import EngineConfig
from headroom.engine.prefix_cache import ROOT_REF, PrefixCache, extend_block_hashes
from headroom.engine.scheduler import Scheduler
from headroom.engine.sequence import Sequence

BLOCK_SIZE = 16
TARGET_PAIRS_PER_S = 1_000_000
TARGET_STEP_MS = 1.0
RUNNING = 256


def best_rate(fn: Callable[[], int], repeats: int) -> float:
    """Operations per second of the fastest of `repeats` runs (`fn` returns its op count)."""
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        ops = fn()
        best = max(best, ops / (time.perf_counter() - t0))
    return best


def caching_pool(num_blocks: int = 4096) -> BlockPool:
    return BlockPool(num_blocks, PrefixCache(num_blocks))


def alloc_free_pairs(n: int = 500_000) -> Callable[[], int]:
    pool = caching_pool()
    allocate, free = pool.allocate, pool.free

    def run() -> int:
        for _ in range(n):
            free(allocate())
        return n

    return run


def alloc_free_batched(n: int = 20_000, batch: int = 16) -> Callable[[], int]:
    """A whole prompt's worth of blocks at a time, freed tail first as the scheduler does."""
    pool = caching_pool()
    allocate, free = pool.allocate, pool.free

    def run() -> int:
        for _ in range(n):
            blocks = [allocate() for _ in range(batch)]
            for b in reversed(blocks):
                free(b)
        return n * batch

    return run


def cached_revive_pairs(n: int = 200_000) -> Callable[[], int]:
    """A prefix hit on a parked block and its release: the LRU list's remove-from-the-middle."""
    pool = caching_pool()
    cache = pool.cache
    assert cache is not None
    blocks = [pool.allocate() for _ in range(1024)]
    for i, b in enumerate(blocks):
        cache.insert(b, i, ROOT_REF, [i] * BLOCK_SIZE, None)
    for b in blocks:
        pool.free(b)
    rng = random.Random(0)
    order = [rng.choice(blocks) for _ in range(n)]
    share, free = pool.share, pool.free

    def run() -> int:
        for b in order:
            share(b)
            free(b)
        return n

    return run


def prefix_setup(prompt_blocks: int) -> tuple[BlockPool, list[int], list[int]]:
    pool = caching_pool()
    cache = pool.cache
    assert cache is not None
    rng = random.Random(1)
    tokens = [rng.randrange(32000) for _ in range(prompt_blocks * BLOCK_SIZE + 1)]
    hashes: list[int] = []
    extend_block_hashes(hashes, tokens, BLOCK_SIZE, prompt_blocks, None)
    ref = ROOT_REF
    for i, h in enumerate(hashes):
        b = pool.allocate()
        got = cache.insert(b, h, ref, tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE], None)
        assert got is not None
        ref = got
    return pool, tokens, hashes


def prefix_lookups(prompt_blocks: int, hashing: bool, n: int) -> Callable[[], int]:
    """Full-hit lookups of a cached prompt; with `hashing`, chain-hash the prompt first (what a
    new request pays once)."""
    pool, tokens, hashes = prefix_setup(prompt_blocks)
    cache = pool.cache
    assert cache is not None
    match = cache.match

    def run() -> int:
        for _ in range(n):
            h = hashes
            if hashing:
                h = []
                extend_block_hashes(h, tokens, BLOCK_SIZE, prompt_blocks, None)
            hits = match(h, tokens, BLOCK_SIZE, None)
            assert len(hits) == prompt_blocks
        return n

    return run


def scheduler_steps(
    repeats: int, steps: int = 400, running: int = RUNNING
) -> tuple[Callable[[], int], Scheduler]:
    """`running` decodes past their prefill, and a run of `steps` steps of them; the pool and
    the lengths are sized for `repeats` runs (each adds `steps` tokens to every sequence), so
    no sequence finishes or is preempted however many runs are timed."""
    max_prompt = 511
    grown = 1 + steps * repeats  # the prefill's token, then one per step of every run
    max_tokens = max(3000, grown + BLOCK_SIZE)  # never reached: no sequence finishes
    max_model_len = max(4096, -(-(max_prompt + max_tokens) // BLOCK_SIZE) * BLOCK_SIZE)
    # Room for every sequence to grow: no preemption (the sizes of old, at most 5 x 400 steps).
    per_seq = max(192, -(-(max_prompt + grown) // BLOCK_SIZE) + 1)
    cfg = EngineConfig(
        num_blocks=running * per_seq,
        block_size=BLOCK_SIZE,
        max_model_len=max_model_len,
        max_num_seqs=running,
        max_num_batched_tokens=8192,
    )
    sched = Scheduler(cfg)
    rng = random.Random(2)
    for i in range(running):
        prompt = [rng.randrange(32000) for _ in range(rng.randrange(64, max_prompt + 1))]
        sched.add(Sequence(f"r{i}", prompt, max_tokens=max_tokens))
    while sched.waiting or any(not s.output_token_ids for s in sched.running):
        out = sched.schedule()
        sched.update(out, {e.seq.seq_id: 1 for e in out.scheduled if e.sample})

    def run() -> int:
        for _ in range(steps):
            out = sched.schedule()
            sched.update(out, {e.seq.seq_id: 7 for e in out.scheduled if e.sample})
        return steps

    return run, sched


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive_int, default=5)
    args = parser.parse_args(argv)
    r = args.repeats
    verdict = Verdicts()

    pairs = best_rate(alloc_free_pairs(), r)
    batched = best_rate(alloc_free_batched(), r)
    revive = best_rate(cached_revive_pairs(), r)
    look64 = best_rate(prefix_lookups(64, hashing=False, n=5_000), r)
    look64h = best_rate(prefix_lookups(64, hashing=True, n=2_000), r)
    look4 = best_rate(prefix_lookups(4, hashing=False, n=100_000), r)
    step_run, sched = scheduler_steps(r)
    steps_per_s = best_rate(step_run, r)
    step_ms = 1e3 / steps_per_s
    assert len(sched.running) == RUNNING

    pairs_ok = verdict(pairs >= TARGET_PAIRS_PER_S, "allocate + free rate")
    step_ok = verdict(step_ms <= TARGET_STEP_MS, "scheduler step time")
    rows = [
        ("allocate + free, one block", f"{pairs:,.0f} pairs/s",
         f">= {TARGET_PAIRS_PER_S:,} pairs/s: {pairs_ok}"),
        ("allocate 16 + free them", f"{batched:,.0f} pairs/s", ""),
        ("prefix hit revive + release", f"{revive:,.0f} pairs/s", "parked LRU, O(1) unlink"),
        ("prefix lookup, 4-block prompt", f"{look4:,.0f} lookups/s", f"{look4 * 4:,.0f} blocks/s"),
        ("prefix lookup, 64-block prompt", f"{look64:,.0f} lookups/s",
         f"{look64 * 64:,.0f} blocks/s"),
        ("  same, hashing the prompt too", f"{look64h:,.0f} lookups/s",
         f"{look64h * 64:,.0f} blocks/s"),
        (f"scheduler step, {RUNNING} decodes", f"{step_ms:.3f} ms/step",
         f"<= {TARGET_STEP_MS:g} ms: {step_ok}"),
    ]  # fmt: skip
    print(f"block size {BLOCK_SIZE}; best of {r} runs; CPython, no model")
    print()
    header = f"{'operation':<34}{'rate':>22}   target / note"
    print(header)
    print("-" * (len(header) + 20))
    for name, value, note in rows:
        print(f"{name:<34}{value:>22}   {note}".rstrip())
    print()
    return verdict.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
