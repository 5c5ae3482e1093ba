"""Everything the CUDA launchers decide or check before a launch, as pure functions of tensor
metadata (and, with `check_values`, of tensor contents), so it is tested on the CPU:
`validate_*` raise `TypeError` for a wrong dtype and `ValueError` for a wrong shape, stride,
device or index; `choose_partition_size` is the split-context heuristic."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headroom.engine.attention.base import KVDtype, LayerKVCache
from headroom.engine.kernels import compile as kc

DECODE_THREADS = 128
CACHE_THREADS = 128
COPY_THREADS = 256
TILE_TOKENS = 16  # tokens per warp iteration; block sizes and partitions are multiples
HEADS_PER_CTA = 16  # query heads sharing one pass over a kv head's blocks
MIN_PARTITION_TOKENS = 512
PARTITION_ROUNDING = 256
MAX_PARTITIONS = 1024  # grid.z, and one fp32 weight each in the reduce's shared memory
TARGET_WAVES = 8  # split a context until the grid fills the GPU this many times over
MAX_GRID_Y = 65535
MAX_GRID_Z = 65535
MAX_DYNAMIC_SHARED_BYTES = 48 * 1024  # without opting in to more per kernel
assert MAX_PARTITIONS <= MAX_GRID_Z and 4 * MAX_PARTITIONS <= MAX_DYNAMIC_SHARED_BYTES

_QUERY_DTYPES: dict[torch.dtype, str] = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_QUANT_STORAGE: dict[str, torch.dtype] = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}


@dataclass(frozen=True, slots=True)
class DecodeGeometry:
    """The launch-relevant sizes of one validated decode (or prefill-as-decode) call."""

    num_rows: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    num_seqs: int
    max_blocks_per_seq: int
    query_dtype: str
    kv_dtype: KVDtype

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def head_chunks(self) -> int:
        return -(-self.group // HEADS_PER_CTA)

    @property
    def max_context(self) -> int:
        return self.max_blocks_per_seq * self.block_size

    @property
    def ctas_per_partition(self) -> int:
        return self.num_rows * self.num_kv_heads * self.head_chunks


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _require_dtype(t: torch.Tensor, allowed: tuple[torch.dtype, ...], what: str) -> None:
    if t.dtype not in allowed:
        names = ", ".join(_dtype_name(d) for d in allowed)
        raise TypeError(f"{what} must be {names}, got {_dtype_name(t.dtype)}")


def _require_same_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        _require(t.device == device, f"{name} is on {t.device}, the cache is on {device}")


def _require_index_vector(t: torch.Tensor, what: str, length: int | None = None) -> None:
    _require_dtype(t, (torch.int32,), what)
    _require(t.dim() == 1, f"{what} must be 1-D, got shape {tuple(t.shape)}")
    _require(t.is_contiguous(), f"{what} must be contiguous")
    if length is not None:
        _require(t.shape[0] == length, f"{what} must have {length} entries, got {t.shape[0]}")


def validate_cache(cache: LayerKVCache) -> None:
    """Check one layer's cache against base.py's layout and what the kernels were built for."""
    key, value = cache.key, cache.value
    _require(
        key.dim() == 4,
        f"cache.key must be [blocks, block_size, kv_heads, head_dim], got shape {tuple(key.shape)}",
    )
    _require(
        value.shape == key.shape,
        f"cache.value shape {tuple(value.shape)} differs from cache.key {tuple(key.shape)}",
    )
    if cache.kv_dtype == "auto":
        _require_dtype(key, tuple(_QUERY_DTYPES), "cache.key (kv_dtype auto)")
    elif cache.kv_dtype in _QUANT_STORAGE:
        _require_dtype(key, (_QUANT_STORAGE[cache.kv_dtype],), f"cache.key ({cache.kv_dtype})")
    else:
        raise ValueError(f"unknown kv_dtype {cache.kv_dtype!r}; use auto, fp8 or int8")
    if value.dtype != key.dtype:
        raise TypeError(
            f"cache.value is {_dtype_name(value.dtype)}, cache.key is {_dtype_name(key.dtype)}"
        )
    _require(value.device == key.device, "cache.key and cache.value are on different devices")
    _require(
        key.is_contiguous() and value.is_contiguous(),
        "cache.key and cache.value must be contiguous (the kernels address slots by arithmetic)",
    )
    _require(
        key.data_ptr() % 16 == 0 and value.data_ptr() % 16 == 0,
        "cache.key and cache.value must be 16-byte aligned",
    )
    _require(
        cache.head_dim in kc.HEAD_DIMS,
        f"head_dim {cache.head_dim} is not compiled; supported: {kc.HEAD_DIMS}",
    )
    _require(
        cache.block_size % TILE_TOKENS == 0 and cache.block_size > 0,
        f"block_size must be a positive multiple of {TILE_TOKENS}, got {cache.block_size}",
    )
    if cache.kv_dtype == "auto":
        _require(cache.k_scale is None and cache.v_scale is None, "kv_dtype auto takes no scales")
        return
    want = (
        (cache.num_kv_heads,)
        if cache.kv_dtype == "fp8"
        else (cache.num_blocks, cache.block_size, cache.num_kv_heads)
    )
    for name, s in (("k_scale", cache.k_scale), ("v_scale", cache.v_scale)):
        if s is None:
            raise ValueError(f"kv_dtype {cache.kv_dtype} needs cache.{name}")
        _require_dtype(s, (torch.float32,), f"cache.{name}")
        _require(
            tuple(s.shape) == want,
            f"cache.{name} must have shape {want} for {cache.kv_dtype}, got {tuple(s.shape)}",
        )
        _require(s.is_contiguous(), f"cache.{name} must be contiguous")
        _require(s.device == key.device, f"cache.{name} is not on the cache's device")


def _validate_query(query: torch.Tensor, cache: LayerKVCache, what: str = "query") -> None:
    _require_dtype(query, tuple(_QUERY_DTYPES), what)
    if cache.kv_dtype == "auto" and cache.key.dtype != query.dtype:
        raise TypeError(
            f"{what} is {_dtype_name(query.dtype)} but the auto cache is "
            f"{_dtype_name(cache.key.dtype)}; they must match"
        )
    _require(
        query.dim() == 3,
        f"{what} must be [tokens, heads, head_dim], got shape {tuple(query.shape)}",
    )
    _require(
        query.shape[2] == cache.head_dim,
        f"{what} head_dim {query.shape[2]} != cache head_dim {cache.head_dim}",
    )
    _require(query.stride(2) == 1, f"{what} must be contiguous in head_dim (stride(2) == 1)")
    _require(query.stride(0) >= 0 and query.stride(1) >= 0, f"{what} has negative strides")
    heads = query.shape[1]
    _require(
        heads > 0 and heads % cache.num_kv_heads == 0,
        f"{what} has {heads} heads, not a multiple of num_kv_heads {cache.num_kv_heads}",
    )


def _validate_block_tables(
    block_tables: torch.Tensor, cache: LayerKVCache, num_seqs: int | None, check_values: bool
) -> None:
    _require_dtype(block_tables, (torch.int32,), "block_tables")
    _require(
        block_tables.dim() == 2,
        f"block_tables must be [num_seqs, max_blocks_per_seq], "
        f"got shape {tuple(block_tables.shape)}",
    )
    if num_seqs is not None:
        _require(
            block_tables.shape[0] == num_seqs,
            f"block_tables has {block_tables.shape[0]} rows, expected {num_seqs}",
        )
    _require(block_tables.shape[1] > 0, "block_tables has no columns")
    _require(block_tables.is_contiguous(), "block_tables must be contiguous")
    if check_values and block_tables.numel() > 0:
        lo, hi = int(block_tables.min()), int(block_tables.max())
        _require(
            lo >= 0 and hi < cache.num_blocks,
            f"block_tables values must be in [0, {cache.num_blocks}), found [{lo}, {hi}]",
        )


def _validate_seq_lens(
    seq_lens: torch.Tensor, length: int, max_context: int, check_values: bool
) -> None:
    _require_index_vector(seq_lens, "seq_lens", length)
    if check_values and seq_lens.numel() > 0:
        smin, smax = int(seq_lens.min()), int(seq_lens.max())
        _require(smin >= 0, f"seq_lens must be >= 0, found {smin}")
        _require(
            smax <= max_context,
            f"seq_lens max {smax} exceeds max_blocks_per_seq * block_size = {max_context}",
        )


def _validate_tables(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cache: LayerKVCache,
    num_seqs: int,
    check_values: bool,
) -> None:
    _validate_block_tables(block_tables, cache, num_seqs, check_values)
    _validate_seq_lens(seq_lens, num_seqs, block_tables.shape[1] * cache.block_size, check_values)


def validate_decode(
    query: torch.Tensor,
    cache: LayerKVCache,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    check_values: bool = True,
) -> DecodeGeometry:
    """Check a decode call (one query row per sequence) and return its geometry."""
    validate_cache(cache)
    _validate_query(query, cache)
    _require_same_device(
        cache.key.device, query=query, seq_lens=seq_lens, block_tables=block_tables
    )
    num_seqs = query.shape[0]
    _validate_tables(block_tables, seq_lens, cache, num_seqs, check_values)
    return _geometry(query, cache, block_tables, num_rows=num_seqs)


def validate_prefill(
    query: torch.Tensor,
    cache: LayerKVCache,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    check_values: bool = True,
) -> DecodeGeometry:
    """Check a prefill call (variable-length chunks, causal) and return its geometry."""
    validate_cache(cache)
    _validate_query(query, cache)
    _require_same_device(
        cache.key.device,
        query=query,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
    )
    _require_index_vector(query_start_loc, "query_start_loc")
    num_seqs = query_start_loc.shape[0] - 1
    _require(num_seqs >= 0, "query_start_loc needs num_seqs + 1 entries")
    _validate_tables(block_tables, seq_lens, cache, num_seqs, check_values)
    if check_values and num_seqs > 0:
        starts = query_start_loc.to(torch.int64)
        _require(int(starts[0]) == 0, f"query_start_loc[0] must be 0, got {int(starts[0])}")
        _require(
            int(starts[-1]) == query.shape[0],
            f"query_start_loc[-1] = {int(starts[-1])} != number of query rows {query.shape[0]}",
        )
        counts = starts[1:] - starts[:-1]
        _require(bool((counts >= 0).all()), "query_start_loc must be non-decreasing")
        _require(
            bool((counts <= seq_lens.to(torch.int64)).all()),
            "a chunk is longer than its sequence's seq_lens (which include the chunk)",
        )
    return _geometry(query, cache, block_tables, num_rows=query.shape[0])


def _geometry(
    query: torch.Tensor, cache: LayerKVCache, block_tables: torch.Tensor, num_rows: int
) -> DecodeGeometry:
    return DecodeGeometry(
        num_rows=num_rows,
        num_heads=query.shape[1],
        num_kv_heads=cache.num_kv_heads,
        head_dim=cache.head_dim,
        block_size=cache.block_size,
        num_blocks=cache.num_blocks,
        num_seqs=block_tables.shape[0],
        max_blocks_per_seq=block_tables.shape[1],
        query_dtype=_QUERY_DTYPES[query.dtype],
        kv_dtype=cache.kv_dtype,
    )


def validate_write(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: LayerKVCache,
    slot_mapping: torch.Tensor,
    *,
    check_values: bool = True,
) -> None:
    """Check a cache write: `[tokens, kv_heads, head_dim]` rows and int64 slots (-1 skips)."""
    validate_cache(cache)
    for name, t in (("key", key), ("value", value)):
        _require_dtype(t, tuple(_QUERY_DTYPES), name)
        want = (
            slot_mapping.shape[0] if slot_mapping.dim() == 1 else -1,
            cache.num_kv_heads,
            cache.head_dim,
        )
        _require(
            t.dim() == 3 and tuple(t.shape[1:]) == want[1:],
            f"{name} must be [tokens, {cache.num_kv_heads}, {cache.head_dim}], got "
            f"{tuple(t.shape)}",
        )
        _require(t.stride(2) == 1, f"{name} must be contiguous in head_dim (stride(2) == 1)")
        _require(t.stride(0) >= 0 and t.stride(1) >= 0, f"{name} has negative strides")
    if value.dtype != key.dtype:
        raise TypeError(f"value is {_dtype_name(value.dtype)}, key is {_dtype_name(key.dtype)}")
    if cache.kv_dtype == "auto" and cache.key.dtype != key.dtype:
        raise TypeError(
            f"key is {_dtype_name(key.dtype)} but the auto cache is {_dtype_name(cache.key.dtype)}"
        )
    _require_dtype(slot_mapping, (torch.int64,), "slot_mapping")
    _require(
        slot_mapping.dim() == 1 and slot_mapping.is_contiguous(),
        "slot_mapping must be a contiguous 1-D tensor",
    )
    _require(
        key.shape[0] == slot_mapping.shape[0] and value.shape[0] == slot_mapping.shape[0],
        f"key/value have {key.shape[0]}/{value.shape[0]} tokens, slot_mapping has "
        f"{slot_mapping.shape[0]}",
    )
    _require_same_device(cache.key.device, key=key, value=value, slot_mapping=slot_mapping)
    if check_values and slot_mapping.numel() > 0:
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        slots = cache.num_blocks * cache.block_size
        _require(
            lo >= -1 and hi < slots,
            f"slot_mapping values must be -1 or in [0, {slots}), found [{lo}, {hi}]",
        )


def validate_copy(
    caches: list[LayerKVCache], src: torch.Tensor, dst: torch.Tensor, *, check_values: bool = True
) -> None:
    """Check a copy-on-write request: same-layout layers, disjoint in-range block ids."""
    _require(len(caches) > 0, "copy_blocks needs at least one layer")
    first = caches[0]
    for i, c in enumerate(caches):
        validate_cache(c)
        _require(
            c.key.shape == first.key.shape
            and c.key.dtype == first.key.dtype
            and c.kv_dtype == first.kv_dtype
            and c.key.device == first.key.device,
            f"layer {i} cache differs from layer 0 in shape, dtype, kv_dtype or device",
        )
    for name, t in (("src", src), ("dst", dst)):
        _require_dtype(t, (torch.int32, torch.int64), name)
        _require(t.dim() == 1, f"{name} must be 1-D, got shape {tuple(t.shape)}")
    _require(src.shape == dst.shape, f"src has {src.numel()} ids, dst has {dst.numel()}")
    _require_same_device(first.key.device, src=src, dst=dst)
    if not check_values or src.numel() == 0:
        return
    both = torch.cat([src.to(torch.int64), dst.to(torch.int64)])
    lo, hi = int(both.min()), int(both.max())
    _require(
        lo >= 0 and hi < first.num_blocks,
        f"block ids must be in [0, {first.num_blocks}), found [{lo}, {hi}]",
    )
    _require(torch.unique(dst).numel() == dst.numel(), "dst has repeated block ids")
    _require(
        not bool(torch.isin(dst, src).any()),
        "a block is both a source and a destination; copies run concurrently",
    )


def choose_partition_size(num_ctas: int, max_context: int, slots: int) -> int:
    """Tokens per context partition for split-context decode, or 0 for a single pass.

    Split only when the single-pass grid (`num_ctas` CTAs) would fill the GPU's `slots`
    resident CTAs fewer than TARGET_WAVES times: long contexts with small batches. Partitions
    are at least MIN_PARTITION_TOKENS so each warp keeps a useful pipeline depth.
    """
    _require(
        num_ctas > 0 and slots > 0 and max_context >= 0,
        "num_ctas and slots must be positive, max_context non-negative",
    )
    if max_context <= MIN_PARTITION_TOKENS or num_ctas >= TARGET_WAVES * slots:
        return 0
    parts = -(-TARGET_WAVES * slots // num_ctas)
    size = -(-max_context // parts)
    size = max(MIN_PARTITION_TOKENS, -(-size // PARTITION_ROUNDING) * PARTITION_ROUNDING)
    size = max(size, -(-max_context // MAX_PARTITIONS))
    size = -(-size // TILE_TOKENS) * TILE_TOKENS
    return 0 if size >= max_context else size


def num_partitions(max_context: int, partition_size: int) -> int:
    """Grid depth of a split-context launch (1 for a single pass)."""
    return 1 if partition_size == 0 else max(1, -(-max_context // partition_size))


def validate_partition_size(partition_size: int, max_context: int) -> int:
    """The partition count (grid depth) of a decode with `partition_size` tokens per partition
    (0: a single pass), refused unless it is a multiple of TILE_TOKENS that splits
    `max_context` into at most MAX_PARTITIONS partitions."""
    _require(
        partition_size >= 0 and partition_size % TILE_TOKENS == 0,
        f"partition_size must be 0 or a positive multiple of {TILE_TOKENS}",
    )
    parts = num_partitions(max_context, partition_size)
    smallest = -(-max_context // (MAX_PARTITIONS * TILE_TOKENS)) * TILE_TOKENS
    _require(
        parts <= MAX_PARTITIONS,
        f"partition_size {partition_size} splits a {max_context}-token context into {parts} "
        f"partitions, more than the {MAX_PARTITIONS} the reduce kernel takes; use 0 or at "
        f"least {smallest}",
    )
    return parts


def prefill_rows(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row: its sequence and its causal context length (int32, on-device ops only).

    Row k of chunk i sits at position seq_lens[i] - chunk_len + k and so sees that many + 1
    tokens; the decode kernel then runs one query row at a time.
    """
    device = query_start_loc.device
    counts = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int64)
    seq_ids = torch.arange(counts.shape[0], device=device, dtype=torch.int64)
    row_seq = torch.repeat_interleave(seq_ids, counts, output_size=num_rows)
    pos = (
        torch.arange(num_rows, device=device, dtype=torch.int64)
        - query_start_loc[:-1].to(torch.int64)[row_seq]
    )
    lens = seq_lens.to(torch.int64)[row_seq] - counts[row_seq] + pos + 1
    return row_seq.to(torch.int32), lens.to(torch.int32)
