"""Prefix cache: full KV blocks found again by a chained hash of their tokens.

A block's hash covers its parent block's hash, its own token ids and an extra key (model or
adapter id), and a lookup walks block by block from the start. Hashes can collide, so a hash
is only an index: every hit re-checks the stored token ids and extra key, and that the stored
parent is the very block matched one step earlier. Parents are named by a ref (block id plus
a generation bumped whenever the block forgets its content), so by induction a hit is an exact
prefix match whatever the hash quality, and a ref to a since-evicted parent matches nothing.

A cached block may be in use (refcount >= 1) or parked (refcount 0, evictable). Parked blocks
sit in an OrderedDict, which is CPython's C doubly linked list keyed by block id: parking
appends at the most-recently-used end, a prefix hit pulls a block out of the middle in O(1)
(a deque would need an O(n) `remove`), and eviction pops the least-recently-used end.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

HashFn = Callable[[int | None, tuple[int, ...], str | None], int]
# What a cached block holds: its hash, its parent's ref, its token ids and its extra key.
Content = tuple[int, int, list[int], str | None]

ROOT_REF = -1
"""The parent ref of a sequence's first block."""


def hash_block_tokens(parent: int | None, tokens: tuple[int, ...], extra: str | None) -> int:
    """The chained hash of one full block (Python's tuple hash: fast and in-process only)."""
    return hash((parent, extra, tokens))


def extend_block_hashes(
    hashes: list[int],
    token_ids: list[int],
    block_size: int,
    num_blocks: int,
    extra_key: str | None,
    hash_fn: HashFn = hash_block_tokens,
) -> None:
    """Append to `hashes` the chained hashes of full blocks `len(hashes)..num_blocks-1`."""
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_blocks):
        parent = hash_fn(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]), extra_key)
        hashes.append(parent)


class PrefixCache:
    """Hash -> block map, per-block stored content, the LRU of parked blocks and hit counters.

    The pool owns reference counts; this class only learns when a block's last reference drops
    (`park`), when a hit revives it (`unpark`) and when the pool needs it back (`evict`).
    """

    def __init__(self, num_blocks: int, hash_fn: HashFn = hash_block_tokens) -> None:
        self.hash_fn = hash_fn
        self._num_blocks = num_blocks
        self._by_hash: dict[int, int] = {}
        self._content: list[Content | None] = [None] * num_blocks
        self._gen = [0] * num_blocks  # bumped when a block forgets: old refs match nothing
        self._parked: OrderedDict[int, None] = OrderedDict()
        self.queries_tokens_total = self.hits_tokens_total = self.evictions_total = 0

    @property
    def num_parked(self) -> int:
        """Refcount-0 blocks holding content (the `cached` state)."""
        return len(self._parked)

    def is_cached(self, block_id: int) -> bool:
        """The block holds findable content (in use or parked)."""
        return self._content[block_id] is not None

    def is_parked(self, block_id: int) -> bool:
        return block_id in self._parked

    def ref(self, block_id: int) -> int:
        """This block's identity in its current content, for its children's parent ref."""
        return self._gen[block_id] * self._num_blocks + block_id

    def insert(
        self,
        block_id: int,
        block_hash: int,
        parent_ref: int,
        token_ids: list[int],
        extra: str | None,
    ) -> int | None:
        """Make a full, in-use block findable; returns the ref that now stands for its content
        (the parent ref of the next block), or None when a colliding entry holds the hash.

        An identical block already cached is not merged: block tables stay append-only, its
        ref is returned, and this copy simply goes back to the free list when released.
        An entry holding the hash whose parent ref is stale (that parent was evicted since) is
        an orphan no walk from the root reaches: this block takes the hash, and the orphan keeps
        its content, unfindable, until it is evicted.
        """
        if self._content[block_id] is not None:  # shared with a sibling or a prefix hit
            return self.ref(block_id)
        content = (block_hash, parent_ref, token_ids, extra)
        other = self._by_hash.get(block_hash)
        if other is not None and (held := self._content[other]) is not None:
            if held == content:
                return self.ref(other)
            live = held[1] == ROOT_REF or self.ref(held[1] % self._num_blocks) == held[1]
            if live:
                return None  # a colliding entry keeps the hash
            self._gen[other] += 1  # the orphan's own children go stale: each gives way in turn
        self._by_hash[block_hash] = block_id
        self._content[block_id] = content
        return self.ref(block_id)

    def match(
        self,
        hashes: list[int],
        token_ids: list[int],
        block_size: int,
        extra: str | None,
        max_blocks: int | None = None,
    ) -> list[int]:
        """Block ids of the longest cached prefix of `token_ids`, in whole blocks, given the
        chain `hashes` of its full blocks (at most `max_blocks` of them)."""
        hits: list[int] = []
        parent = ROOT_REF
        for i, h in enumerate(hashes[:max_blocks]):
            block_id = self._by_hash.get(h)
            tokens = token_ids[i * block_size : (i + 1) * block_size]
            if block_id is None or self._content[block_id] != (h, parent, tokens, extra):
                break
            hits.append(block_id)
            parent = self.ref(block_id)
        return hits

    def park(self, block_id: int) -> bool:
        """A block lost its last reference: keep it, evictable, at the MRU end if it holds
        findable content (True); False leaves it to the pool's free list."""
        if self._content[block_id] is None:
            return False
        self._parked[block_id] = None
        return True

    def unpark(self, block_id: int) -> None:
        """A prefix hit revived a parked block: it is in use again, not evictable."""
        del self._parked[block_id]

    def evict(self) -> int | None:
        """Forget the least recently used parked block and return its id (None if none)."""
        if not self._parked:
            return None
        block_id, _ = self._parked.popitem(last=False)
        content = self._content[block_id]
        if content is not None and self._by_hash.get(content[0]) == block_id:
            del self._by_hash[content[0]]
        self._content[block_id] = None
        self._gen[block_id] += 1
        self.evictions_total += 1
        return block_id
