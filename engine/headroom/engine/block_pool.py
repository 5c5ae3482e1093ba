"""The KV block pool: fixed-size blocks, reference counts, O(1) allocate and free.

Every block is in exactly one state: free (refcount 0, no content), used (refcount >= 1) or
cached (refcount 0, parked in the prefix cache for hits, evictable). Free blocks sit on a plain
list used as a stack, so allocate and free are a pop and an append with no scan; allocation
takes a free block first and evicts the least recently used cached block only when no free
block is left, so prefix-cache content survives as long as the pool allows.
"""

from __future__ import annotations

from headroom.engine.prefix_cache import PrefixCache


class NoFreeBlocks(RuntimeError):
    """Raised by `allocate` when the pool is exhausted; the KV manager checks first, so a
    serving engine never sees it."""


class BlockPool:
    """Blocks `0..num_blocks-1`, shared by reference count; `cache` keeps released content."""

    __slots__ = ("_free", "_num_used", "cache", "num_blocks", "ref_counts")

    def __init__(self, num_blocks: int, cache: PrefixCache | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.cache = cache
        self.ref_counts: list[int] = [0] * num_blocks
        # Reversed so that a fresh pool hands out block 0 first (readable tests and traces).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._num_used = 0

    @property
    def num_free(self) -> int:
        """Blocks holding nothing."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Refcount-0 blocks kept for prefix hits (evictable)."""
        return self.cache.num_parked if self.cache is not None else 0

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self._num_used

    @property
    def num_available(self) -> int:
        """Blocks an allocation may take: free ones plus evictable cached ones."""
        return self.num_blocks - self._num_used

    def allocate(self) -> int:
        """Take one block (refcount 1), evicting the LRU cached block if none is free."""
        if self._free:
            block_id = self._free.pop()
        elif self.cache is not None and (evicted := self.cache.evict()) is not None:
            block_id = evicted
        else:
            raise NoFreeBlocks(f"all {self.num_blocks} KV blocks are in use")
        self.ref_counts[block_id] = 1
        self._num_used += 1
        return block_id

    def free(self, block_id: int) -> None:
        """Drop one reference; at zero the cache parks the block (if it holds content) or it
        goes back on the free list."""
        rc = self.ref_counts[block_id] - 1
        if rc < 0:
            raise ValueError(f"block {block_id} freed more times than it was referenced")
        self.ref_counts[block_id] = rc
        if rc == 0:
            self._num_used -= 1
            if self.cache is None or not self.cache.park(block_id):
                self._free.append(block_id)

    def share(self, block_id: int) -> None:
        """Add a reference (a sibling, a prefix hit); a parked block is revived, not copied."""
        rc = self.ref_counts[block_id]
        if rc == 0:
            if self.cache is None or not self.cache.is_parked(block_id):
                raise ValueError(f"block {block_id} is free; allocate it instead of sharing")
            self.cache.unpark(block_id)
            self._num_used += 1
        self.ref_counts[block_id] = rc + 1

    def copy_on_write(self, block_id: int) -> int:
        """A private copy target for a shared block; the caller copies the KV `block_id ->
        returned id` before writing. Returns `block_id` itself when it is not shared."""
        if self.ref_counts[block_id] <= 1:
            return block_id
        new_id = self.allocate()
        self.free(block_id)
        return new_id
