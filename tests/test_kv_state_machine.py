"""Random submit / step / fork / abort / finish sequences against the scheduler and its pool,
with every invariant checked after every operation. Tiny pools force preemption and
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
from headroom.engine.errors import RequestRejected
from headroom.engine.prefix_cache import PrefixCache, hash_block_tokens
from headroom.engine.scheduler import Scheduler, SchedulerConfig
from headroom.engine.sequence import Sequence


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
            victim = self.parked_lru()[0]
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
        self.cfg = SchedulerConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            max_model_len=40,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            enable_prefix_caching=caching,
            watermark=watermark,
        )
        hash_fn = HASHES[hash_name]
        self.sched = Scheduler(self.cfg, hash_fn=hash_fn)
        pool = self.sched.pool
        if caching:
            checked = CheckedPrefixCache(num_blocks, hash_fn)
            checked.pool = pool
            pool.prefix_cache = checked
        self.sim = KVSimulator(num_blocks, block_size)
        self.live: dict[int, Sequence] = {}
        self.stopped: set[int] = set()  # finished or aborted by the test, not by max_tokens
        self.done: list[Sequence] = []
        self.last_preemptions = 0
        self.last_evictions = 0
        self.seen: set[str] = set()
        self.broken = False
        self.forks = 0  # salts children's samples deterministically across replays

    # -- rules --------------------------------------------------------------------------

    @rule(
        requests=st.lists(
            st.tuples(
                st.integers(0, len(SYSTEM)),
                st.lists(st.integers(0, 4), max_size=8),
                st.integers(1, 8),
                st.sampled_from([None, None, "lora-a"]),
            ),
            min_size=1,
            max_size=6,
        )
    )
    def submit(self, requests: list[tuple[int, list[int], int, str | None]]) -> None:
        for shared, tail, max_tokens, extra in requests:
            prompt = SYSTEM[:shared] + tail
            seq = Sequence.new(f"r{seq_counter()}", prompt, max_tokens, extra_key=extra)
            total = len(prompt) + max_tokens
            should_fit = (
                bool(prompt)
                and total <= self.cfg.max_model_len
                and -(-total // self.cfg.block_size) <= self.cfg.num_blocks
            )
            try:
                self.sched.add(seq)
            except RequestRejected as e:
                assert not should_fit, f"rejected a request that fits: {e.reason}"
                assert e.reason
                continue
            assert should_fit, "accepted a request that can never fit"
            self.live[seq.seq_id] = seq

    @rule(data=st.data(), n=st.integers(1, 12))
    def steps(self, data: st.DataObject, n: int) -> None:
        for _ in range(n):
            self.step(data)
            self.check_pool()
            self.check_sequences()

    def step(self, data: st.DataObject | None) -> None:
        try:
            self._step(data)
        except BaseException:
            self.broken = True  # keeps teardown from masking the failure
            raise

    def _step(self, data: st.DataObject | None) -> None:
        sched, cfg = self.sched, self.cfg
        cache = sched.pool.prefix_cache
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
            assert src != dst and sched.pool.ref_counts[dst] == 1
        for e in out.scheduled:
            seq = e.seq
            assert e.start == seq.num_computed_tokens and e.num_new_tokens >= 1
            assert e.end <= seq.num_tokens
            assert len(seq.block_table) * cfg.block_size >= e.end
            # A prefix hit at this admission: its blocks hold exactly this sequence's tokens.
            if cache is not None and e.start == seq.num_cached_tokens and e.start:
                bs = cfg.block_size
                for i in range(e.start // bs):
                    stored = cache.token_ids_of(seq.block_table[i])
                    assert stored == seq.all_token_ids[i * bs : (i + 1) * bs]
        for name, happened in (
            ("preemption", bool(out.preempted)),
            ("copy-on-write", bool(out.blocks_to_copy)),
            (
                "prefix hit",
                any(e.start and e.start == e.seq.num_cached_tokens for e in out.prefills),
            ),
            ("eviction", cache is not None and cache.evictions_total > self.last_evictions),
            ("chunked prefill", any(not e.sample for e in out.prefills)),
        ):
            if happened:
                self.seen.add(name)
        self.last_evictions = cache.evictions_total if cache is not None else 0
        logits = self.sim.run(out)
        sampled = {sid: sample(kv) for sid, kv in logits.items()}
        # n > 1 sampling: fork some sequences whose prompt just finished prefill.
        for e in out.scheduled:
            if data is None or not e.sample or e.seq.output_token_ids:
                continue
            if data.draw(st.integers(0, 3)) == 0:
                for child in sched.fork(e.seq.seq_id, data.draw(st.integers(1, 2))):
                    self.forks += 1
                    sampled[child.seq_id] = sample(logits[e.seq.seq_id], salt=self.forks)
                    self.live[child.seq_id] = child
                self.seen.add("fork")
        finished = sched.update(out, sampled)
        for seq in finished:
            assert len(seq.output_token_ids) == seq.max_tokens and seq.is_finished
            self.done.append(seq)
            self.live.pop(seq.seq_id)
        assert sched.preemptions_total >= self.last_preemptions
        self.last_preemptions = sched.preemptions_total

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), how=st.sampled_from(["abort", "finish"]))
    def stop(self, data: st.DataObject, how: str) -> None:
        """The client went away (abort, waiting or running) or a stop string matched."""
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        assert getattr(self.sched, how)(seq_id)
        seq = self.live.pop(seq_id)
        assert seq.is_finished and not seq.block_table
        assert self.sched.get(seq_id) is None
        assert not self.sched.abort(seq_id), "a second abort is a no-op"
        self.stopped.add(seq_id)

    @precondition(lambda self: bool(self.sched.running))
    @rule(data=st.data())
    def fork_between_steps(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self.sched.running))
        for child in self.sched.fork(parent.seq_id, 1):
            assert child.block_table == parent.block_table
            self.live[child.seq_id] = child

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
            self.step(None)
            self.check_pool()
            self.check_sequences()
            steps += 1
            assert steps <= limit, f"no forward progress after {steps} steps"
        assert not self.live
        pool = sched.pool
        assert pool.num_used == 0 and pool.num_free + pool.num_cached == pool.num_blocks
        for seq in self.done:
            assert len(seq.output_token_ids) == seq.max_tokens

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def check_pool(self) -> None:
        sched = self.sched
        pool: BlockPool = sched.pool
        cache = pool.prefix_cache
        refs = Counter(b for s in sched.running for b in s.block_table)
        free = pool.free_block_ids()
        parked = cache.parked_lru() if cache is not None else []
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
        stats = sched.stats()
        assert (stats.kv.free, stats.kv.used, stats.kv.cached) == (
            pool.num_free,
            pool.num_used,
            pool.num_cached,
        )
        assert stats.prefix_cache.hits_tokens_total <= stats.prefix_cache.queries_tokens_total
        if cache is None:
            assert stats.prefix_cache.queries_tokens_total == 0 and pool.num_cached == 0
        assert stats.requests.running == len(sched.running)
        assert stats.requests.waiting == len(sched.waiting)

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
        assert set(self.live) == {s.seq_id for s in [*sched.waiting, *sched.running]}


SchedulerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_scheduler_state_machine = SchedulerMachine.TestCase
