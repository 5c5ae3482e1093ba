"""The prefix cache: chained hashes, exact matches despite collisions, LRU, counters, off."""

from __future__ import annotations

import random

from test_kv_model_sim import VOCAB, KVSimulator, drive, random_prompts, sample

from headroom.engine.block_pool import BlockPool
from headroom.engine.config import EngineConfig
from headroom.engine.kv_manager import KVManager
from headroom.engine.prefix_cache import (
    ROOT_REF,
    PrefixCache,
    extend_block_hashes,
    hash_block_tokens,
)
from headroom.engine.scheduler import Scheduler
from headroom.engine.sequence import Sequence
from headroom.engine.stats import scheduler_stats


def chain(tokens: list[int], block_size: int, extra: str | None = None) -> list[int]:
    hashes: list[int] = []
    extend_block_hashes(hashes, tokens, block_size, len(tokens) // block_size, extra)
    return hashes


def fill(cache: PrefixCache, tokens: list[int], block_ids: list[int], bs: int) -> None:
    """Register `tokens` block by block in `block_ids`, as the scheduler does."""
    ref = ROOT_REF
    for i, (b, h) in enumerate(zip(block_ids, chain(tokens, bs), strict=False)):
        got = cache.insert(b, h, ref, tokens[i * bs : (i + 1) * bs], None)
        assert got is not None
        ref = got


def test_chained_hashes_cover_the_whole_prefix_and_the_extra_key() -> None:
    a = chain([1, 2, 3, 4, 5, 6], 2)
    assert len(a) == 3
    assert chain([1, 2, 3, 4, 9, 9], 2)[:2] == a[:2]
    # A change in the first block changes every later hash, even with equal later tokens.
    b = chain([0, 2, 3, 4, 5, 6], 2)
    assert all(x != y for x, y in zip(a, b, strict=True))
    assert chain([1, 2, 3, 4, 5, 6], 2, extra="adapter")[0] != a[0]
    # Partial trailing blocks are not hashed; extending later continues the same chain.
    hashes = chain([1, 2, 3], 2)
    extend_block_hashes(hashes, [1, 2, 3, 4, 5, 6], 2, 3, None)
    assert hashes == a


def test_match_returns_the_longest_prefix_in_whole_blocks() -> None:
    cache = PrefixCache(8)
    fill(cache, [1, 2, 3, 4, 5, 6], [5, 6, 7], 2)
    assert cache.match(chain([1, 2, 3, 4, 5, 6], 2), [1, 2, 3, 4, 5, 6], 2, None) == [5, 6, 7]
    assert cache.match(chain([1, 2, 3, 4, 0, 0], 2), [1, 2, 3, 4, 0, 0], 2, None) == [5, 6]
    assert cache.match(chain([9, 2, 3, 4], 2), [9, 2, 3, 4], 2, None) == []
    q = [1, 2, 3, 4, 5, 6]
    assert cache.match(chain(q, 2), q, 2, None, max_blocks=2) == [5, 6]
    assert cache.match(chain(q, 2), q, 2, "other-model") == []


def test_a_colliding_hash_never_returns_foreign_content() -> None:
    # Every block hashes to 0: the hash only indexes, the stored tokens and parent decide.
    cache = PrefixCache(8, hash_fn=lambda parent, tokens, extra: 0)
    tokens = [1, 1, 2, 2]
    hashes: list[int] = []
    extend_block_hashes(hashes, tokens, 2, 2, None, cache.hash_fn)
    assert cache.insert(0, hashes[0], ROOT_REF, [1, 1], None) is not None
    other: list[int] = []
    extend_block_hashes(other, [3, 3], 2, 1, None, cache.hash_fn)
    assert other == hashes[:1]  # a collision
    assert cache.match(other, [3, 3], 2, None) == []
    assert cache.match(hashes, tokens, 2, None) == [0]


def test_equal_blocks_under_different_prefixes_do_not_match() -> None:
    # A hash that ignores the parent makes block [5, 5] collide under any prefix.
    cache = PrefixCache(8, hash_fn=lambda parent, tokens, extra: hash(tokens))
    ref0 = cache.insert(0, hash((1, 1)), ROOT_REF, [1, 1], None)
    assert ref0 is not None
    assert cache.insert(1, hash((5, 5)), ref0, [5, 5], None) is not None
    query = [2, 2, 5, 5]
    hashes: list[int] = []
    extend_block_hashes(hashes, query, 2, 2, None, cache.hash_fn)
    cache.insert(2, hashes[0], ROOT_REF, [2, 2], None)
    assert cache.match(hashes, query, 2, None) == [2], "block 1 was computed after [1, 1]"


def test_a_parent_that_was_evicted_and_reused_invalidates_its_children() -> None:
    cache = PrefixCache(4)
    fill(cache, [1, 1, 2, 2], [0, 1], 2)
    cache.park(1)
    cache.park(0)
    assert cache.evict() == 1 and cache.evict() == 0
    assert cache.match(chain([1, 1, 2, 2], 2), [1, 1, 2, 2], 2, None) == []


def test_duplicate_content_is_not_cached_twice_but_keeps_the_chain() -> None:
    cache = PrefixCache(8)
    fill(cache, [1, 1, 2, 2], [0, 1], 2)
    h = chain([1, 1, 2, 2, 3, 3], 2)
    ref = cache.insert(4, h[0], ROOT_REF, [1, 1], None)  # same content as block 0
    assert ref == cache.ref(0) and not cache.is_cached(4)
    ref = cache.insert(5, h[1], ref, [2, 2], None)
    assert ref == cache.ref(1)
    # A block after the duplicates chains onto the cached originals and is found.
    assert ref is not None and cache.insert(6, h[2], ref, [3, 3], None) is not None
    assert cache.match(h, [1, 1, 2, 2, 3, 3], 2, None) == [0, 1, 6]


def _check_pool(pool: BlockPool) -> None:
    cache = pool.cache
    assert cache is not None
    assert len(set(pool._free)) == len(pool._free)
    assert all(not cache.is_cached(b) and pool.ref_counts[b] == 0 for b in pool._free)
    assert all(cache.is_cached(b) and pool.ref_counts[b] == 0 for b in cache._parked)
    assert pool.num_free + pool.num_used + pool.num_cached == pool.num_blocks


def test_an_orphan_whose_parent_was_evicted_gives_up_its_hash() -> None:
    # Block 2 is registered under parent 0; parent 0 is evicted and reused, so block 2 can never
    # be matched again. The same chain computed again (root 3, child 4) must take the hash.
    pool = BlockPool(6, PrefixCache(6))
    cache = pool.cache
    assert cache is not None
    h = chain([1, 1, 2, 2], 2)
    assert [pool.allocate() for _ in range(6)] == [0, 1, 2, 3, 4, 5]
    fill(cache, [1, 1, 2, 2], [0, 2], 2)
    pool.free(0)
    pool.free(2)  # the orphan-to-be, parked
    # No free block: the LRU parked one, parent 0, is evicted and reused; block 2's parent ref
    # is stale from here on.
    assert pool.allocate() == 0 and cache.evictions_total == 1
    assert cache.is_parked(2) and cache.match(h, [1, 1, 2, 2], 2, None) == []
    ref = cache.insert(3, h[0], ROOT_REF, [1, 1], None)
    assert ref == cache.ref(3)
    assert cache.insert(4, h[1], ref, [2, 2], None) == cache.ref(4), "refused as a collision"
    assert cache.match(h, [1, 1, 2, 2], 2, None) == [3, 4]
    # The orphan stays parked, unfindable, and is evicted in its turn.
    assert cache.is_parked(2) and cache.match(h, [1, 1, 2, 2], 2, None) == [3, 4]
    _check_pool(pool)
    for b in (3, 4):
        pool.free(b)
    assert pool.allocate() == 2 and cache.match(h, [1, 1, 2, 2], 2, None) == [3, 4]
    _check_pool(pool)


def test_an_orphan_still_in_use_gives_up_its_hash_and_parks_unfindable() -> None:
    pool = BlockPool(6, PrefixCache(6))
    cache = pool.cache
    assert cache is not None
    h = chain([1, 1, 2, 2], 2)
    assert [pool.allocate() for _ in range(6)] == [0, 1, 2, 3, 4, 5]
    fill(cache, [1, 1, 2, 2], [0, 2], 2)  # block 2 stays in use by its sequence
    pool.free(0)
    assert pool.allocate() == 0 and cache.evictions_total == 1  # parent 0 evicted, reused
    ref = cache.insert(3, h[0], ROOT_REF, [1, 1], None)
    assert ref is not None and cache.insert(4, h[1], ref, [2, 2], None) == cache.ref(4)
    assert pool.ref_counts[2] == 1
    pool.free(2)  # its sequence ends
    assert cache.match(h, [1, 1, 2, 2], 2, None) == [3, 4]
    _check_pool(pool)


def test_an_orphaned_chain_gives_way_block_by_block() -> None:
    # Blocks 1 and 2 hang under parent 0, which is evicted: the chain computed again takes the
    # hash of 1, and then of 2, whose parent (the orphan 1) is an orphan's content too.
    pool = BlockPool(8, PrefixCache(8))
    cache = pool.cache
    assert cache is not None
    tokens = [1, 1, 2, 2, 3, 3]
    h = chain(tokens, 2)
    assert [pool.allocate() for _ in range(8)] == list(range(8))
    fill(cache, tokens, [0, 1, 2], 2)
    pool.free(0)
    assert pool.allocate() == 0  # parent 0 evicted and reused
    ref = cache.insert(3, h[0], ROOT_REF, [1, 1], None)
    assert ref is not None and (ref := cache.insert(4, h[1], ref, [2, 2], None)) == cache.ref(4)
    assert cache.insert(5, h[2], ref, [3, 3], None) == cache.ref(5)
    assert cache.match(h, tokens, 2, None) == [3, 4, 5]
    _check_pool(pool)


def test_a_chain_computed_again_after_its_orphaned_copy_hits_in_full() -> None:
    # The reviewer's case through the KV manager: A and B compute [1, 2] in the same step, so
    # B's [5, 6] is registered under A's copy; A's blocks are evicted while B runs. C continues
    # B's conversation and D repeats C's: D must hit C's [1, 2] and [5, 6].
    def run(evict_parent: bool) -> int:
        kv = KVManager(6, 2, PrefixCache(6))

        def admit(seq: Sequence) -> None:
            prefix = kv.computed_blocks(seq)
            assert prefix is not None
            blocks, computed = prefix
            kv.admit(seq, blocks, computed, seq.num_tokens - computed, [])

        def computed(seq: Sequence, register: bool = True) -> None:
            seq.num_computed_tokens = seq.num_tokens
            if register:
                kv.cache_blocks(seq)

        a, b = Sequence("a", [1, 2, 3, 4, 9], 1), Sequence("b", [1, 2, 5, 6, 9], 1)
        admit(a)
        admit(b)
        computed(a)
        computed(b)
        kv.free(a)
        if evict_parent:
            e = Sequence("e", [100, 101, 102, 103, 104, 105], 1)
            admit(e)
            computed(e, register=False)
            kv.free(e)
        kv.free(b)
        c = Sequence("c", [1, 2, 5, 6, 7], 1)
        admit(c)
        computed(c)
        kv.free(c)
        _check_pool(kv.pool)
        prefix = kv.computed_blocks(Sequence("d", [1, 2, 5, 6, 8], 1))
        assert prefix is not None
        return prefix[1]

    assert run(evict_parent=False) == 4
    assert run(evict_parent=True) == 4


def _sched(**kw: object) -> Scheduler:
    values: dict[str, object] = {"num_blocks": 64, "block_size": 4, "max_model_len": 256}
    values.update(kw)
    return Scheduler(EngineConfig.model_validate(values))


def _run_one(
    sched: Scheduler, sim: KVSimulator, prompt: list[int], max_tokens: int = 3
) -> Sequence:
    seq = Sequence("r", prompt, max_tokens)
    sched.add(seq)
    drive(sched, sim)
    return seq


def test_a_repeated_prompt_hits_its_full_blocks_and_stops_one_token_short() -> None:
    sched = _sched()
    sim = KVSimulator(64, 4)
    prompt = list(range(13))  # 3 full blocks + 1 token
    first = _run_one(sched, sim, prompt)
    assert first.num_cached_tokens == 0
    stats = scheduler_stats(sched)
    assert stats.kv.cached >= 3 and stats.kv.used == 0
    second = _run_one(sched, sim, prompt)
    assert second.num_cached_tokens == 12
    assert second.output_token_ids == first.output_token_ids
    # An exact multiple of the block size still recomputes its last block's final token.
    third = _run_one(sched, sim, list(range(12)))
    assert third.num_cached_tokens == 8
    s = scheduler_stats(sched).prefix_cache
    assert (s.queries_tokens_total, s.hits_tokens_total) == (13 + 13 + 12, 12 + 8)


def test_hits_need_the_same_extra_key() -> None:
    sched = _sched()
    sim = KVSimulator(64, 4)
    prompt = list(range(9))
    a = Sequence("a", prompt, 2, extra_key="model-a")
    sched.add(a)
    drive(sched, sim)
    b = Sequence("b", prompt, 2, extra_key="model-b")
    sched.add(b)
    drive(sched, sim)
    assert b.num_cached_tokens == 0


def test_generated_tokens_are_cached_too() -> None:
    sched = _sched()
    sim = KVSimulator(64, 4)
    first = _run_one(sched, sim, [1, 2, 3], max_tokens=10)
    follow_up = [*first.all_token_ids[:12], 7]  # a chat turn repeating the reply
    assert _run_one(sched, sim, follow_up).num_cached_tokens == 12


def test_eviction_takes_only_unreferenced_blocks_lru_first() -> None:
    sched = _sched(num_blocks=8, max_num_batched_tokens=64, watermark=0.0)
    sim = KVSimulator(8, 4)
    cache = sched.kv.cache
    assert cache is not None
    a = _run_one(sched, sim, list(range(16)), max_tokens=1)
    b = _run_one(sched, sim, list(range(100, 116)), max_tokens=1)
    assert scheduler_stats(sched).kv.cached == 8 and scheduler_stats(sched).kv.free == 0
    a_blocks = list(cache._parked)[:4]
    # `holder` revives a's 4 blocks (no copy) and needs a 5th: the LRU of b's is evicted.
    holder = Sequence("h", [*a.all_token_ids[:16], 99], 8)
    sched.add(holder)
    out = sched.schedule()
    sched.update(out, {k: sample(kv) for k, kv in sim.run(out).items()})
    assert holder.num_cached_tokens == 16 and set(holder.block_table[:4]) == set(a_blocks)
    assert cache.evictions_total == 1
    # A newcomer needing 3 blocks evicts the rest of b's; holder's blocks stay cached and held.
    other = Sequence("o", [50 + i for i in range(12)], 1)
    sched.add(other)
    sim.run(sched.schedule())
    assert cache.evictions_total == 4
    assert all(
        sched.kv.pool.ref_counts[x] >= 1 and cache.is_cached(x) for x in holder.block_table[:4]
    )
    again = Sequence("b2", [*b.prompt_token_ids, 1], 1)
    assert not cache.match(chain(again.all_token_ids, 4), again.all_token_ids, 4, None), (
        "b's blocks were evicted"
    )


def test_turning_prefix_caching_off_changes_no_output() -> None:
    rng = random.Random(7)
    system = [rng.randrange(VOCAB) for _ in range(20)]
    prompts = random_prompts(rng, 40, system, 30)
    max_tokens = [rng.randrange(1, 12) for _ in prompts]
    outputs = {}
    for caching in (True, False):
        sched = _sched(num_blocks=40, max_num_batched_tokens=48, enable_prefix_caching=caching)
        sim = KVSimulator(40, 4)
        seqs = [
            Sequence(f"r{i}", p, m)
            for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))
        ]
        for s in seqs:
            sched.add(s)
        drive(sched, sim)
        outputs[caching] = [s.output_token_ids for s in seqs]
        stats = scheduler_stats(sched)
        if caching:
            assert stats.prefix_cache.hits_tokens_total > 0
        else:
            assert stats.prefix_cache.queries_tokens_total == 0 and stats.kv.cached == 0
            assert not stats.prefix_cache.enabled
    assert outputs[True] == outputs[False]


def test_hash_function_is_deterministic_for_token_ids() -> None:
    assert hash_block_tokens(None, (1, 2), None) == hash_block_tokens(None, (1, 2), None)
    assert hash_block_tokens(None, (1, 2), None) != hash_block_tokens(None, (2, 1), None)


def test_a_preempted_sequence_is_looked_up_once_not_again_at_readmission() -> None:
    # Two unrelated prompts in 8 blocks of 4: the second is preempted mid-decode and
    # recomputed. Its re-admission must not count its output tokens as looked up, nor its own
    # recomputed blocks as hits: the counters are "prompt tokens looked up / found cached".
    sched = _sched(num_blocks=8, max_model_len=32, watermark=0.0)
    sim = KVSimulator(8, 4)
    a = Sequence("a", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], 16)
    b = Sequence("b", [20, 21, 22, 23, 24, 25, 26, 27, 28, 29], 16)
    for s in (a, b):
        sched.add(s)
    drive(sched, sim)
    assert sched.preemptions_total > 0
    assert len(a.output_token_ids) == len(b.output_token_ids) == 16
    s = scheduler_stats(sched).prefix_cache
    assert (s.queries_tokens_total, s.hits_tokens_total) == (20, 0)


def test_prefix_counters_count_each_prompt_once_under_preemption() -> None:
    rng = random.Random(5)
    prompts = random_prompts(rng, 30, [rng.randrange(VOCAB) for _ in range(12)], 20)
    sched = _sched(num_blocks=14, max_num_batched_tokens=24)
    sim = KVSimulator(14, 4)
    seqs = [Sequence(f"r{i}", p, rng.randrange(1, 24)) for i, p in enumerate(prompts)]
    for seq in seqs:
        sched.add(seq)
    drive(sched, sim, max_steps=20_000)
    assert sched.preemptions_total > 0
    s = scheduler_stats(sched).prefix_cache
    assert s.queries_tokens_total == sum(len(p) for p in prompts)
    assert 0 < s.hits_tokens_total <= sum(len(p) - 1 for p in prompts)


def test_a_colliding_block_never_takes_the_hash_from_a_live_entry() -> None:
    # Hashes are given by hand: a collision is any two contents under one hash. The entry
    # holding the hash keeps it while its parent is live (the root, or a block not evicted
    # since), whichever block that parent is; the newcomer is refused and stays unfindable.
    cache = PrefixCache(8)
    assert cache.insert(0, 5, ROOT_REF, [1, 1], None) == cache.ref(0)
    assert cache.insert(1, 5, ROOT_REF, [3, 3], None) is None, "a live root entry keeps it"
    assert cache.match([5], [1, 1], 2, None) == [0] and cache.match([5], [3, 3], 2, None) == []
    ref3 = cache.insert(3, 11, ROOT_REF, [1, 1], None)  # a parent in a block other than 0
    assert ref3 is not None and cache.insert(4, 55, ref3, [5, 5], None) == cache.ref(4)
    ref5 = cache.insert(5, 22, ROOT_REF, [2, 2], None)
    assert ref5 is not None and cache.insert(6, 55, ref5, [5, 5], None) is None
    assert cache.match([11, 55], [1, 1, 5, 5], 2, None) == [3, 4]
    assert cache.match([22, 55], [2, 2, 5, 5], 2, None) == [5]


def test_an_evicted_blocks_hash_is_forgotten_so_its_content_can_be_cached_again() -> None:
    # Block 0 forgets [1, 1] and is reused for [2, 2]: [1, 1] computed again in block 1 must
    # take the hash, not be refused as colliding with what block 0 holds now.
    cache = PrefixCache(4)
    assert cache.insert(0, 7, ROOT_REF, [1, 1], None) is not None
    assert cache.park(0) and cache.evict() == 0
    assert cache.insert(0, 8, ROOT_REF, [2, 2], None) == cache.ref(0)
    assert cache.insert(1, 7, ROOT_REF, [1, 1], None) == cache.ref(1)
    assert cache.match([7], [1, 1], 2, None) == [1] and cache.match([8], [2, 2], 2, None) == [0]


def test_a_block_forgetting_content_twice_never_revives_an_old_ref() -> None:
    # Refs name a block in one content: generations only grow, so once the orphan 1 gave up its
    # hash and was evicted, block 1 holding [7, 7] is not the parent block 2 was computed after
    # (even when the hash of [3, 3] collides across the two prefixes).
    cache = PrefixCache(6)
    ref = cache.insert(0, 11, ROOT_REF, [1, 1], None)
    assert ref is not None and (ref := cache.insert(1, 22, ref, [2, 2], None)) is not None
    assert cache.insert(2, 33, ref, [3, 3], None) is not None
    assert cache.park(0) and cache.evict() == 0  # blocks 1 and 2 are orphans from here
    ref = cache.insert(3, 11, ROOT_REF, [1, 1], None)
    assert ref is not None and cache.insert(4, 22, ref, [2, 2], None) == cache.ref(4)
    assert cache.park(1) and cache.evict() == 1
    assert cache.insert(1, 77, ROOT_REF, [7, 7], None) == cache.ref(1)
    assert cache.ref(1) != ROOT_REF
    assert cache.match([77, 33], [7, 7, 3, 3], 2, None) == [1]
    assert cache.match([11, 22], [1, 1, 2, 2], 2, None) == [3, 4]


def test_a_freed_sequence_computed_again_registers_its_blocks_from_the_first() -> None:
    # Preemption frees a sequence's blocks; if they are evicted while it waits, it recomputes
    # from scratch and must register its chain again from block 0, not carry on from where the
    # freed table left off.
    kv = KVManager(4, 2, PrefixCache(4))
    s = Sequence("s", [1, 2, 3, 4, 5], 1)

    def admit_and_compute() -> None:
        prefix = kv.computed_blocks(s)
        assert prefix is not None
        blocks, computed = prefix
        kv.admit(s, blocks, computed, s.num_tokens - computed, [])
        s.num_computed_tokens = s.num_tokens
        kv.cache_blocks(s)

    admit_and_compute()
    kv.free(s)
    s.num_computed_tokens = 0
    filler = [kv.pool.allocate() for _ in range(4)]  # evicts both cached blocks
    for b in filler:
        kv.pool.free(b)
    assert kv.pool.num_cached == 0
    admit_and_compute()
    assert s.num_cached_tokens == 0
    kv.free(s)
    again = kv.computed_blocks(Sequence("t", [1, 2, 3, 4, 6], 1))
    assert again is not None and again[1] == 4
