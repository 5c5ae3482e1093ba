"""The KV manager: the only layer between the scheduler and the block pool.

The scheduler asks it five things (nano-vllm's block-manager verbs, vLLM v1's KVCacheManager):
the computed prefix of a waiting sequence (`computed_blocks`), how many blocks admitting it
takes (`blocks_to_admit`), to admit it (`admit`), to make room for a running sequence's next
tokens (`allocate_slots`) and to release a sequence (`free`); after a step it registers newly
full blocks in the prefix cache (`cache_blocks`). Reference counts, copy-on-write and prefix
matching stay in here.

A computed prefix comes from the prefix cache, in whole blocks and one token short of the end
(so the last token's logits are computed), or, for the second and later completions of an
n > 1 request, from the first completion's blocks, partly filled last block included: that
shared block is copied before either writes to it (copy-on-write). Both count as prefix hits
in the cache's counters: either way those prompt tokens take no new KV.

It also integrates the pool's used blocks over wall-clock time (`block_seconds`): every pool
change here is preceded by a tick that adds used x elapsed, so the integral is exact whatever
the step cadence.
"""

from __future__ import annotations

from collections.abc import Callable
from time import monotonic

from headroom.engine.block_pool import BlockPool
from headroom.engine.prefix_cache import ROOT_REF, PrefixCache, extend_block_hashes
from headroom.engine.sequence import Sequence, SequenceStatus

Clock = Callable[[], float]


class KVManager:
    """Allocates, shares and frees the blocks of sequences (see the module docstring)."""

    def __init__(
        self, num_blocks: int, block_size: int, cache: PrefixCache | None, clock: Clock = monotonic
    ) -> None:
        self.block_size = block_size
        self.cache = cache
        self.pool = BlockPool(num_blocks, cache)
        self._clock = clock
        self._last = clock()
        self._block_seconds = 0.0

    @property
    def num_available(self) -> int:
        return self.pool.num_available

    def block_seconds(self) -> float:
        """Integral of used blocks over time since the manager was built, in block-seconds."""
        self._tick()
        return self._block_seconds

    def _tick(self) -> None:
        now = self._clock()
        self._block_seconds += self.pool.num_used * (now - self._last)
        self._last = now

    def computed_blocks(self, seq: Sequence) -> tuple[list[int], int] | None:
        """Blocks holding an already computed prefix of a waiting `seq`, and its length in
        tokens; None while its first sibling is still computing the shared prompt."""
        first = seq.sibling_of
        if first is not None and first.status is SequenceStatus.RUNNING:
            shared = seq.num_prompt_tokens - 1
            if first.num_computed_tokens < shared:
                return None
            return first.block_table[: -(-shared // self.block_size)], shared
        cache, bs = self.cache, self.block_size
        if cache is None:
            return [], 0
        # Stop one token short: the last token must be computed to sample from it.
        max_blocks = (seq.num_tokens - 1) // bs
        hashes = seq.block_hashes
        if len(hashes) < max_blocks:
            extend_block_hashes(
                hashes, seq.all_token_ids, bs, max_blocks, seq.extra_key, cache.hash_fn
            )
        hits = cache.match(hashes, seq.all_token_ids, bs, seq.extra_key, max_blocks)
        return hits, len(hits) * bs

    def blocks_to_admit(self, blocks: list[int], computed: int, n: int) -> int:
        """Blocks admitting a sequence with this computed prefix and `n` new tokens takes:
        revived cached blocks, a private copy of a shared partial block, new blocks."""
        bs, ref_counts = self.block_size, self.pool.ref_counts
        revived = sum(1 for b in blocks if ref_counts[b] == 0)
        return revived + (computed % bs != 0) + -(-(computed + n) // bs) - len(blocks)

    def admit(
        self, seq: Sequence, blocks: list[int], computed: int, n: int, copies: list[tuple[int, int]]
    ) -> None:
        """Give `seq` the computed prefix `blocks` and room for `n` more tokens."""
        self._tick()
        for b in blocks:  # revive before allocating, so allocation cannot evict a hit
            self.pool.share(b)
        seq.block_table[:] = blocks
        seq.num_computed_tokens = seq.num_cached_tokens = computed
        if self.cache is not None and not seq.prefix_counted:
            # "Prompt tokens looked up / found cached": once per sequence, at its first
            # admission. A re-admission after preemption would count its output tokens and
            # its own recomputed blocks.
            seq.prefix_counted = True
            self.cache.queries_tokens_total += seq.num_prompt_tokens
            self.cache.hits_tokens_total += min(computed, seq.num_prompt_tokens)
        self.allocate_slots(seq, n, copies)

    def allocate_slots(self, seq: Sequence, n: int, copies: list[tuple[int, int]]) -> int:
        """Make room for up to `n` more tokens of `seq`, copying a shared last block first
        (its `(src, dst)` pair goes to `copies`); returns the tokens that fit, 0 for none."""
        bs, pool = self.block_size, self.pool
        table, computed = seq.block_table, seq.num_computed_tokens
        cow = computed % bs != 0 and pool.ref_counts[table[-1]] > 1
        if not cow and computed + n <= len(table) * bs:
            return n  # room in an unshared last block: nearly every decode
        n = min(n, (len(table) + pool.num_available - cow) * bs - computed)
        if n <= 0:
            return 0
        need = -(-(computed + n) // bs) - len(table)
        if cow or need:
            self._tick()
        if cow:
            old = table[-1]
            table[-1] = pool.copy_on_write(old)
            copies.append((old, table[-1]))
        for _ in range(need):
            table.append(pool.allocate())
        return n

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`, tail first: the end of a sequence is evicted before the
        prefix others may share; full registered blocks stay cached."""
        self._tick()
        for b in reversed(seq.block_table):
            self.pool.free(b)
        seq.block_table.clear()
        seq.num_registered_blocks = 0
        seq.cache_parent_ref = ROOT_REF

    def cache_blocks(self, seq: Sequence) -> None:
        """Make the full computed blocks of `seq` findable in the prefix cache."""
        cache, bs = self.cache, self.block_size
        full = seq.num_computed_tokens // bs
        if cache is None or full <= seq.num_registered_blocks:
            return
        hashes, tokens, table = seq.block_hashes, seq.all_token_ids, seq.block_table
        if len(hashes) < full:
            extend_block_hashes(hashes, tokens, bs, full, seq.extra_key, cache.hash_fn)
        ref = seq.cache_parent_ref
        for i in range(seq.num_registered_blocks, full):
            if ref is None:  # after a collision nothing further down this chain is findable
                break
            ref = cache.insert(
                table[i], hashes[i], ref, tokens[i * bs : (i + 1) * bs], seq.extra_key
            )
        seq.cache_parent_ref = ref
        seq.num_registered_blocks = full
