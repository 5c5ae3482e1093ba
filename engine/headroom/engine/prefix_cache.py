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

ROOT_REF = -1
"""The parent ref of a sequence's first block."""


def hash_block_tokens(
    parent_hash: int | None, token_ids: tuple[int, ...], extra_key: str | None
) -> int:
    """The chained hash of one full block (Python's tuple hash: fast and in-process only)."""
    return hash((parent_hash, extra_key, token_ids))


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

    The pool owns reference counts; this class only learns when a block is parked (its last
    reference dropped), unparked (a hit revived it) or evicted (reused for new content).
    """

    __slots__ = (
        "_by_hash",
        "_extra",
        "_gen",
        "_num_blocks",
        "_parent",
        "_parked",
        "_tokens",
        "block_hashes",
        "evictions_total",
        "hash_fn",
        "hits_tokens_total",
        "queries_tokens_total",
    )

    def __init__(self, num_blocks: int, hash_fn: HashFn = hash_block_tokens) -> None:
        self.hash_fn = hash_fn
        self._by_hash: dict[int, int] = {}
        self._num_blocks = num_blocks
        # Public for the pool's hot free path; only this class writes it.
        self.block_hashes: list[int | None] = [None] * num_blocks
        self._gen: list[int] = [0] * num_blocks
        self._parent: list[int] = [ROOT_REF] * num_blocks
        self._tokens: list[list[int] | None] = [None] * num_blocks
        self._extra: list[str | None] = [None] * num_blocks
        self._parked: OrderedDict[int, None] = OrderedDict()
        self.queries_tokens_total = 0
        self.hits_tokens_total = 0
        self.evictions_total = 0

    @property
    def num_parked(self) -> int:
        """Refcount-0 blocks holding a hash (the `cached` state)."""
        return len(self._parked)

    def is_cached(self, block_id: int) -> bool:
        return self.block_hashes[block_id] is not None

    def is_parked(self, block_id: int) -> bool:
        return block_id in self._parked

    def hash_of(self, block_id: int) -> int | None:
        return self.block_hashes[block_id]

    def token_ids_of(self, block_id: int) -> list[int] | None:
        """The token ids stored with a cached block (None when it holds no hash)."""
        return self._tokens[block_id]

    def parked_lru(self) -> list[int]:
        """Parked block ids, least recently used first (for tests and debugging)."""
        return list(self._parked)

    def ref(self, block_id: int) -> int:
        """This block's identity in its current content, for its children's parent ref."""
        return self._gen[block_id] * self._num_blocks + block_id

    def insert(
        self,
        block_id: int,
        block_hash: int,
        parent_ref: int,
        token_ids: list[int],
        extra_key: str | None,
    ) -> int | None:
        """Make a full, in-use block findable; returns the ref that now stands for its content
        (the parent ref of the next block), or None when a colliding entry holds the hash.

        An identical block already cached is not merged: block tables stay append-only, its
        ref is returned, and this copy simply goes back to the free list when released.
        """
        if self.block_hashes[block_id] is not None:  # shared with a fork or a prefix hit
            return self.ref(block_id)
        other = self._by_hash.get(block_hash)
        if other is not None:
            if (
                self._parent[other] == parent_ref
                and self._extra[other] == extra_key
                and self._tokens[other] == token_ids
            ):
                return self.ref(other)
            return None
        self._by_hash[block_hash] = block_id
        self.block_hashes[block_id] = block_hash
        self._parent[block_id] = parent_ref
        self._tokens[block_id] = token_ids
        self._extra[block_id] = extra_key
        return self.ref(block_id)

    def match(
        self,
        hashes: list[int],
        token_ids: list[int],
        block_size: int,
        extra_key: str | None,
        max_blocks: int | None = None,
    ) -> list[int]:
        """Block ids of the longest cached prefix of `token_ids`, in whole blocks, given the
        chain `hashes` of its full blocks (at most `max_blocks` of them)."""
        hits: list[int] = []
        by_hash = self._by_hash
        parent = ROOT_REF
        limit = len(hashes) if max_blocks is None else min(max_blocks, len(hashes))
        for i in range(limit):
            block_id = by_hash.get(hashes[i])
            if (
                block_id is None
                or self._parent[block_id] != parent
                or self._extra[block_id] != extra_key
                or self._tokens[block_id] != token_ids[i * block_size : (i + 1) * block_size]
            ):
                break
            hits.append(block_id)
            parent = self._gen[block_id] * self._num_blocks + block_id
        return hits

    def park(self, block_id: int) -> None:
        """A cached block lost its last reference: keep it, evictable, at the MRU end."""
        self._parked[block_id] = None

    def unpark(self, block_id: int) -> None:
        """A prefix hit revived a parked block: it is in use again, not evictable."""
        del self._parked[block_id]

    def evict(self) -> int | None:
        """Forget the least recently used parked block and return its id (None if none)."""
        if not self._parked:
            return None
        block_id, _ = self._parked.popitem(last=False)
        self._forget(block_id)
        self.evictions_total += 1
        return block_id

    def _forget(self, block_id: int) -> None:
        h = self.block_hashes[block_id]
        if h is not None and self._by_hash.get(h) == block_id:
            del self._by_hash[h]
        self._gen[block_id] += 1  # refs to the old content now match nothing
        self.block_hashes[block_id] = None
        self._parent[block_id] = ROOT_REF
        self._tokens[block_id] = None
        self._extra[block_id] = None

    def record(self, queried_tokens: int, hit_tokens: int) -> None:
        """Count one admission's lookup, in tokens."""
        self.queries_tokens_total += queried_tokens
        self.hits_tokens_total += hit_tokens
