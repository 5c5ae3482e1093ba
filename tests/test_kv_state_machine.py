"""Random submit / step / finish sequences (n > 1 siblings among them) against the scheduler
and its pool, with every invariant checked after every operation. Tiny pools force preemption and
eviction; a 2-bit hash forces prefix-cache collisions; the KV simulator checks that every
sampled sequence sees exactly its own tokens' KV through its block table."""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from test_kv_model_sim import VOCAB, KVSimulator, sample

from headroom.engine.block_pool import BlockPool
from headroom.engine.config import EngineConfig
from headroom.engine.errors import RequestRejected
from headroom.engine.kv_manager import KVManager
from headroom.engine.prefix_cache import PrefixCache, hash_block_tokens
from headroom.engine.scheduler import Scheduler
from headroom.engine.sequence import Sequence, SequenceStatus
from headroom.engine.stats import scheduler_stats


def two_bit_hash(parent: int | None, tokens: tuple[int, ...], extra: str | None) -> int:
    """Collides all the time, across unrelated content."""
    return hash_block_tokens(parent, tokens, extra) & 3


def local_hash(parent: int | None, tokens: tuple[int, ...], extra: str | None) -> int:
    """Ignores the parent: equal blocks under different prefixes collide."""
    return hash(tokens)


HASHES = {"full": hash_block_tokens, "two-bit": two_bit_hash, "local": local_hash}


class CheckedPrefixCache(PrefixCache):
    """Asserts at the moment of eviction that the victim has no reference."""

    __slots__ = ("pool",)
    pool: BlockPool

    def evict(self) -> int | None:
        if self.num_parked:
            victim = next(iter(self._parked))
            assert self.pool.ref_counts[victim] == 0, f"evicting block {victim} while in use"
        return super().evict()


SYSTEM = [3, 1, 4, 1, 5, 9, 2, 6]
seq_counter = itertools.count().__next__


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(3, 12),
        block_size=st.sampled_from([1, 2, 4]),
        budget=st.integers(1, 24),
        max_num_seqs=st.integers(1, 8),
        caching=st.booleans(),
        watermark=st.sampled_from([0.0, 0.0, 0.1, 0.3]),
        hash_name=st.sampled_from(sorted(HASHES)),
    )
    def setup(
        self,
        num_blocks: int,
        block_size: int,
        budget: int,
        max_num_seqs: int,
        caching: bool,
        watermark: float,
        hash_name: str,
    ) -> None:
        self.cfg = EngineConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            max_model_len=40,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            enable_prefix_caching=caching,
            watermark=watermark,
        )
        hash_fn = HASHES[hash_name]
        checked = CheckedPrefixCache(num_blocks, hash_fn) if caching else None
        self.sched = Scheduler(self.cfg, KVManager(num_blocks, block_size, checked))
        if checked is not None:
            checked.pool = self.sched.kv.pool
        self.sim = KVSimulator(num_blocks, block_size)
        self.live: dict[int, Sequence] = {}
        self.stopped: set[int] = set()  # finished or aborted by the test, not by max_tokens
        self.done: list[Sequence] = []
        self.last_preemptions = 0
        self.last_evictions = 0
        self.seen: set[str] = set()
        self.broken = False
        self.salt: dict[int, int] = {}  # a sibling's index: its samples differ from the first's

    # -- rules --------------------------------------------------------------------------

    @rule(
        requests=st.lists(
            st.tuples(
                st.integers(0, len(SYSTEM)),
                st.lists(st.integers(0, 4), max_size=8),
                st.integers(1, 8),
                st.sampled_from([None, None, "lora-a"]),
                st.sampled_from([1, 1, 1, 2, 3]),
            ),
            min_size=1,
            max_size=6,
        )
    )
    def submit(self, requests: list[tuple[int, list[int], int, str | None, int]]) -> None:
        assert self.cfg.num_blocks is not None and self.cfg.max_model_len is not None
        for shared, tail, max_tokens, extra, n in requests:
            prompt = SYSTEM[:shared] + tail
            rid = f"r{seq_counter()}"
            first = Sequence(rid, prompt, max_tokens, extra_key=extra)
            total = len(prompt) + max_tokens
            # KV for all but the last sampled token, which is never fed back.
            should_fit = (
                bool(prompt)
                and total <= self.cfg.max_model_len
                and -(-(total - 1) // self.cfg.block_size) <= self.cfg.num_blocks
            )
            try:
                self.sched.add(first)
            except RequestRejected as e:
                assert not should_fit, f"rejected a request that fits: {e.reason}"
                assert e.reason
                continue
            assert should_fit, "accepted a request that can never fit"
            self.live[first.seq_id] = first
            for index in range(1, n):
                seq = Sequence(rid, prompt, max_tokens, extra_key=extra, sibling_of=first)
                self.sched.add(seq)
                self.live[seq.seq_id] = seq
                self.salt[seq.seq_id] = index

    @rule(n=st.integers(1, 12))
    def steps(self, n: int) -> None:
        for _ in range(n):
            self.step()
            self.check_pool()
            self.check_sequences()

    def step(self) -> None:
        try:
            self._step()
        except BaseException:
            self.broken = True  # keeps teardown from masking the failure
            raise

    def _step(self) -> None:
        sched, cfg = self.sched, self.cfg
        cache = sched.kv.cache
        out = sched.schedule()
        if not out.scheduled:
            assert not sched.has_unfinished() or out.preempted, "idle step with work queued"
            return
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs
        assert all(not e.is_decode for e in out.prefills)
        assert all(e.is_decode for e in out.decodes)
        assert len({id(e.seq) for e in out.scheduled}) == len(out.scheduled)
        for src, dst in out.blocks_to_copy:
            assert src != dst and sched.kv.pool.ref_counts[dst] == 1
        for e in out.scheduled:
            seq = e.seq
            assert e.start == seq.num_computed_tokens and e.num_new_tokens >= 1
            assert e.end <= seq.num_tokens
            assert len(seq.block_table) * cfg.block_size >= e.end
            # A prefix hit at this admission: its blocks hold exactly this sequence's tokens
            # (a sibling's shared blocks are checked through the simulator's KV instead).
            hit = e.start == seq.num_cached_tokens and seq.sibling_of is None
            if cache is not None and hit and e.start:
                bs = cfg.block_size
                for i in range(e.start // bs):
                    stored = cache._content[seq.block_table[i]]
                    assert stored is not None
                    assert stored[2] == seq.all_token_ids[i * bs : (i + 1) * bs]
        for name, happened in (
            ("preemption", bool(out.preempted)),
            ("copy-on-write", bool(out.blocks_to_copy)),
            (
                "prefix hit",
                any(e.start and e.start == e.seq.num_cached_tokens for e in out.prefills),
            ),
            (
                "sibling shares the prompt",
                any(e.seq.sibling_of is not None and e.start for e in out.scheduled),
            ),
            ("eviction", cache is not None and cache.evictions_total > self.last_evictions),
            ("chunked prefill", any(not e.sample for e in out.prefills)),
        ):
            if happened:
                self.seen.add(name)
        self.last_evictions = cache.evictions_total if cache is not None else 0
        logits = self.sim.run(out)
        sampled = {sid: sample(kv, self.salt.get(sid, 0)) for sid, kv in logits.items()}
        finished = sched.update(out, sampled)
        for seq in finished:
            assert (
                len(seq.output_token_ids) == seq.max_tokens
                and seq.status is SequenceStatus.FINISHED
            )
            self.done.append(seq)
            self.live.pop(seq.seq_id)
        assert sched.preemptions_total >= self.last_preemptions
        self.last_preemptions = sched.preemptions_total

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def stop(self, data: st.DataObject) -> None:
        """The client went away (waiting or running) or a stop string matched."""
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        assert self.sched.finish(seq_id)
        seq = self.live.pop(seq_id)
        assert seq.status is SequenceStatus.FINISHED and not seq.block_table
        assert seq_id not in self.sched.seqs
        assert not self.sched.finish(seq_id), "a second abort is a no-op"
        self.stopped.add(seq_id)

    def teardown(self) -> None:
        if not hasattr(self, "sched") or self.broken:
            return
        self.drain()
        for name in sorted(self.seen):
            event(name)

    def drain(self) -> None:
        """Forward progress: everything queued finishes in a bounded number of steps."""
        sched = self.sched
        limit = 50 + 10 * sum(s.num_tokens + s.max_tokens for s in self.live.values())
        steps = 0
        while sched.has_unfinished():
            self.step()
            self.check_pool()
            self.check_sequences()
            steps += 1
            assert steps <= limit, f"no forward progress after {steps} steps"
        assert not self.live
        pool = sched.kv.pool
        assert pool.num_used == 0 and pool.num_free + pool.num_cached == pool.num_blocks
        for seq in self.done:
            assert len(seq.output_token_ids) == seq.max_tokens

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def check_pool(self) -> None:
        sched = self.sched
        pool: BlockPool = sched.kv.pool
        cache = pool.cache
        refs = Counter(b for s in sched.running for b in s.block_table)
        free = list(pool._free)
        parked = list(cache._parked) if cache is not None else []
        assert len(set(free)) == len(free), "a block is on the free list twice"
        for b in range(pool.num_blocks):
            rc = pool.ref_counts[b]
            assert rc >= 0
            assert rc == refs[b], f"block {b}: refcount {rc}, referenced {refs[b]} times"
        for b in free:
            assert pool.ref_counts[b] == 0, f"block {b} is free and referenced"
            assert cache is None or not cache.is_cached(b)
        for b in parked:
            assert pool.ref_counts[b] == 0 and cache is not None and cache.is_cached(b)
        used = sum(1 for rc in pool.ref_counts if rc > 0)
        assert pool.num_used == used
        assert pool.num_free == len(free) and pool.num_cached == len(parked)
        assert pool.num_free + pool.num_used + pool.num_cached == pool.num_blocks
        stats = scheduler_stats(sched)
        assert (stats.kv.free, stats.kv.used, stats.kv.cached) == (
            pool.num_free,
            pool.num_used,
            pool.num_cached,
        )
        assert stats.prefix_cache.hits_tokens_total <= stats.prefix_cache.queries_tokens_total
        if cache is None:
            assert stats.prefix_cache.queries_tokens_total == 0 and pool.num_cached == 0
        assert stats.requests.running == len(sched.running)
        waiting = [s for s in sched.waiting if s.status is SequenceStatus.WAITING]
        assert stats.requests.waiting == len(waiting) == len(sched.seqs) - len(sched.running)

    @invariant()
    def check_sequences(self) -> None:
        sched, bs = self.sched, self.cfg.block_size
        for seq in sched.waiting:
            assert not seq.block_table and seq.num_computed_tokens == 0
        for seq in sched.running:
            assert seq.num_computed_tokens < seq.num_tokens
            assert len(seq.block_table) == -(-seq.num_computed_tokens // bs)
            assert all(0 <= t < VOCAB for t in seq.output_token_ids)
            # Every computed position holds this sequence's own KV.
            self.sim.check(seq, seq.num_computed_tokens)
        # Every decode, then at most one prefill, last: what lets `schedule()` give each
        # sequence in turn what the budget has left without starving a decode behind it.
        assert all(s.num_tokens - s.num_computed_tokens == 1 for s in sched.running[:-1])
        # A sequence finished while it waited stays in the queue until it reaches the front.
        waiting = [s for s in sched.waiting if s.status is SequenceStatus.WAITING]
        assert set(self.live) == {s.seq_id for s in [*waiting, *sched.running]} == set(sched.seqs)


SchedulerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_scheduler_state_machine = SchedulerMachine.TestCase
