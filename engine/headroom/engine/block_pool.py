"""The KV block pool: fixed-size blocks, reference counts, O(1) allocate and free.

Every block is in exactly one state: free (refcount 0, no hash), used (refcount >= 1) or
cached (refcount 0 with a hash: kept for prefix hits, evictable). Free blocks sit on a plain
list used as a stack, so allocate and free are a pop and an append with no scan; allocation
takes a free block first and evicts the least recently used cached block only when no free
block is left, so prefix-cache content survives as long as the pool allows.
"""

from __future__ import annotations

from collections.abc import Iterable

from headroom.engine.prefix_cache import HashFn, PrefixCache, hash_block_tokens


class NoFreeBlocks(RuntimeError):
    """Raised by `allocate` when the pool is exhausted; the scheduler checks first, so a
    serving engine never sees it."""


class BlockPool:
    """Blocks `0..num_blocks-1` of `block_size` tokens each, shared by reference count."""

    __slots__ = ("_free", "_num_used", "block_size", "num_blocks", "prefix_cache", "ref_counts")

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn = hash_block_tokens,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least 1 block, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block size must be >= 1 token, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts: list[int] = [0] * num_blocks
        # Reversed so that a fresh pool hands out block 0 first (readable tests and traces).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._num_used = 0
        self.prefix_cache: PrefixCache | None = (
            PrefixCache(num_blocks, hash_fn) if enable_prefix_caching else None
        )

    @property
    def num_free(self) -> int:
        """Blocks holding nothing."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Refcount-0 blocks kept for prefix hits (evictable)."""
        return self.prefix_cache.num_parked if self.prefix_cache is not None else 0

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self._num_used

    @property
    def num_available(self) -> int:
        """Blocks an allocation may take: free ones plus evictable cached ones."""
        return self.num_blocks - self._num_used

    def free_block_ids(self) -> list[int]:
        """The free stack, next-allocated last (for tests and debugging)."""
        return list(self._free)

    def allocate(self) -> int:
        """Take one block (refcount 1), evicting the LRU cached block if none is free."""
        free = self._free
        if free:
            block_id = free.pop()
        else:
            evicted = self.prefix_cache.evict() if self.prefix_cache is not None else None
            if evicted is None:
                raise NoFreeBlocks(f"all {self.num_blocks} KV blocks are in use")
            block_id = evicted
        self.ref_counts[block_id] = 1
        self._num_used += 1
        return block_id

    def allocate_many(self, n: int) -> list[int]:
        """Take `n` blocks at once; raises `NoFreeBlocks`, taking none, if fewer are available."""
        if n > self.num_blocks - self._num_used:
            raise NoFreeBlocks(f"need {n} KV blocks, {self.num_available} available")
        return [self.allocate() for _ in range(n)]

    def free(self, block_id: int) -> None:
        """Drop one reference; at zero the block becomes cached (if hashed) or free."""
        ref_counts = self.ref_counts
        rc = ref_counts[block_id] - 1
        if rc > 0:
            ref_counts[block_id] = rc
            return
        if rc < 0:
            raise ValueError(f"block {block_id} freed more times than it was referenced")
        ref_counts[block_id] = 0
        self._num_used -= 1
        cache = self.prefix_cache
        if cache is not None and cache.block_hashes[block_id] is not None:
            cache.park(block_id)
        else:
            self._free.append(block_id)

    def free_many(self, block_ids: Iterable[int]) -> None:
        """Free blocks in eviction priority order: the first one parked is evicted first.

        Pass a sequence's table reversed, so its tail goes before the prefix others share.
        """
        for block_id in block_ids:
            self.free(block_id)

    def share(self, block_id: int) -> None:
        """Add a reference (fork, prefix hit); a parked cached block is revived, not copied."""
        rc = self.ref_counts[block_id]
        if rc == 0:
            cache = self.prefix_cache
            if cache is None or not cache.is_parked(block_id):
                raise ValueError(f"block {block_id} is free; allocate it instead of sharing")
            cache.unpark(block_id)
            self._num_used += 1
        self.ref_counts[block_id] = rc + 1

    def is_shared(self, block_id: int) -> bool:
        """True when writing to the block needs a copy first (more than one reference)."""
        return self.ref_counts[block_id] > 1

    def copy_on_write(self, block_id: int) -> int:
        """Give the caller a private copy target for a shared block; the caller copies the KV
        `block_id -> returned id` before writing. Returns `block_id` itself if not shared."""
        if self.ref_counts[block_id] <= 1:
            return block_id
        new_id = self.allocate()
        self.free(block_id)
        return new_id
