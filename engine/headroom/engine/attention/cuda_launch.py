"""The launchers: paged decode (single pass or split context), the KV cache write and the
block copy, each validated (cuda_validate) and launched on a `KernelRuntime` with torch's
`data_ptr()` addresses, so tensors never leave torch."""

from __future__ import annotations

import numpy as np
import torch

from headroom.engine.attention.base import LayerKVCache
from headroom.engine.attention.cuda_runtime import KernelRuntime, default_runtime
from headroom.engine.attention.cuda_validate import (
    _QUERY_DTYPES,
    CACHE_THREADS,
    COPY_THREADS,
    DECODE_THREADS,
    MAX_GRID_Y,
    _dtype_name,
    _geometry,
    _require,
    _require_index_vector,
    _require_same_device,
    _validate_block_tables,
    _validate_query,
    _validate_seq_lens,
    choose_partition_size,
    validate_cache,
    validate_copy,
    validate_decode,
    validate_partition_size,
    validate_write,
)
from headroom.engine.kernels import compile as kc


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


# The per-layer address table of copy_blocks, uploaded once per set of caches: a host-to-device
# copy from pageable memory synchronises the stream, and the addresses never change.
_LAYER_TABLES: dict[tuple[str, tuple[tuple[int, int, int, int], ...]], torch.Tensor] = {}


def _layer_table(rows: tuple[tuple[int, int, int, int], ...], device: torch.device) -> torch.Tensor:
    key = (str(device), rows)
    table = _LAYER_TABLES.get(key)
    if table is None:
        if len(_LAYER_TABLES) >= 8:  # engines in one process are few; drop the oldest
            _LAYER_TABLES.pop(next(iter(_LAYER_TABLES)))
        table = torch.tensor(rows, dtype=torch.int64).to(device)
        _LAYER_TABLES[key] = table
    return table


def paged_decode(
    query: torch.Tensor,
    cache: LayerKVCache,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    partition_size: int | None = None,
    row_to_seq: torch.Tensor | None = None,
    check_values: bool = True,
    runtime: KernelRuntime | None = None,
) -> torch.Tensor:
    """Launch paged decode attention; `partition_size` None picks v1/v2 by the heuristic.

    `row_to_seq` (int32 per query row) maps rows to block-table rows, which is how prefill
    reuses this kernel; then `seq_lens` is per row.
    """
    if row_to_seq is None:
        geo = validate_decode(query, cache, seq_lens, block_tables, check_values=check_values)
    else:
        validate_cache(cache)
        _validate_query(query, cache)
        _require_same_device(
            cache.key.device,
            query=query,
            seq_lens=seq_lens,
            block_tables=block_tables,
            row_to_seq=row_to_seq,
        )
        _validate_block_tables(block_tables, cache, None, check_values)
        _require_index_vector(row_to_seq, "row_to_seq", query.shape[0])
        _validate_seq_lens(
            seq_lens, query.shape[0], block_tables.shape[1] * cache.block_size, check_values
        )
        geo = _geometry(query, cache, block_tables, num_rows=query.shape[0])
    rt = runtime or default_runtime()
    device = query.device
    shape = (geo.num_rows, geo.num_heads, geo.head_dim)
    if out is None:
        out = torch.empty(shape, dtype=query.dtype, device=device)
    else:
        _require(
            tuple(out.shape) == shape
            and out.dtype == query.dtype
            and out.is_contiguous()
            and out.device == device,
            f"out must be a contiguous {shape} {_dtype_name(query.dtype)} tensor on {device}",
        )
    if geo.num_rows == 0:
        return out
    fn = rt.function(kc.decode_variant(geo.query_dtype, geo.kv_dtype, geo.head_dim), device)
    if partition_size is None:
        slots = rt.resident_slots(fn, device)
        partition_size = choose_partition_size(geo.ctas_per_partition, geo.max_context, slots)
    parts = validate_partition_size(partition_size, geo.max_context)
    part_out = part_max = part_sum = None
    if partition_size > 0:
        part_out = torch.empty(
            (geo.num_rows, geo.num_heads, parts, geo.head_dim), dtype=torch.float32, device=device
        )
        part_max = torch.empty(
            (geo.num_rows, geo.num_heads, parts), dtype=torch.float32, device=device
        )
        part_sum = torch.empty_like(part_max)
        reduce_fn = rt.function(kc.reduce_variant(geo.query_dtype), device)
    qs0, qs1 = query.stride(0), query.stride(1)
    for r0 in range(0, geo.num_rows, MAX_GRID_Y):
        r1 = min(geo.num_rows, r0 + MAX_GRID_Y)
        rows = r1 - r0
        sub = (
            None if part_out is None else part_out[r0:r1],
            None if part_max is None else part_max[r0:r1],
            None if part_sum is None else part_sum[r0:r1],
        )
        # Without row_to_seq, block-table rows follow query rows, so they shift with the chunk.
        table = block_tables if row_to_seq is not None else block_tables[r0:r1]
        args = (
            _ptr(out[r0:r1]),
            _ptr(sub[0]),
            _ptr(sub[1]),
            _ptr(sub[2]),
            _ptr(query[r0:r1]),
            _ptr(cache.key),
            _ptr(cache.value),
            _ptr(cache.k_scale),
            _ptr(cache.v_scale),
            _ptr(table),
            _ptr(seq_lens[r0:r1]),
            _ptr(None if row_to_seq is None else row_to_seq[r0:r1]),
            np.int32(geo.num_heads),
            np.int32(geo.num_kv_heads),
            np.int32(geo.block_size),
            np.int32(geo.max_blocks_per_seq),
            np.int64(qs0),
            np.int64(qs1),
            np.int32(partition_size),
            np.int32(parts),
            np.float32(scale),
        )
        grid = (geo.num_kv_heads * geo.head_chunks, rows, parts)
        rt.launch(fn, device, grid, (DECODE_THREADS, 1, 1), args)
        if partition_size > 0:
            rt.launch(
                reduce_fn,
                device,
                (geo.num_heads, rows, 1),
                (DECODE_THREADS, 1, 1),
                (
                    _ptr(out[r0:r1]),
                    _ptr(sub[0]),
                    _ptr(sub[1]),
                    _ptr(sub[2]),
                    _ptr(seq_lens[r0:r1]),
                    np.int32(geo.num_heads),
                    np.int32(geo.head_dim),
                    np.int32(partition_size),
                    np.int32(parts),
                ),
                shared_mem=4 * parts,
            )
    return out


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: LayerKVCache,
    slot_mapping: torch.Tensor,
    *,
    check_values: bool = True,
    runtime: KernelRuntime | None = None,
) -> None:
    """Launch `reshape_and_cache`: store (and quantise) K/V rows at their slots."""
    validate_write(key, value, cache, slot_mapping, check_values=check_values)
    rt = runtime or default_runtime()
    if key.shape[0] == 0:
        return
    variant = kc.cache_write_variant(_QUERY_DTYPES[key.dtype], cache.kv_dtype)
    fn = rt.function(variant, key.device)
    args = (
        _ptr(key),
        _ptr(value),
        _ptr(cache.key),
        _ptr(cache.value),
        _ptr(cache.k_scale),
        _ptr(cache.v_scale),
        _ptr(slot_mapping),
        np.int32(cache.num_kv_heads),
        np.int32(cache.head_dim),
        np.int64(key.stride(0)),
        np.int64(key.stride(1)),
        np.int64(value.stride(0)),
        np.int64(value.stride(1)),
    )
    rt.launch(fn, key.device, (key.shape[0], 1, 1), (CACHE_THREADS, 1, 1), args)


def copy_blocks(
    caches: list[LayerKVCache],
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    check_values: bool = True,
    runtime: KernelRuntime | None = None,
) -> None:
    """Launch one `copy_blocks` kernel over every layer: blocks src[i] -> dst[i], scales too."""
    validate_copy(caches, src, dst, check_values=check_values)
    if src.numel() == 0:
        return
    rt = runtime or default_runtime()
    first = caches[0]
    device = first.key.device
    per_block_scales = first.kv_dtype == "int8"
    rows = tuple(
        (
            c.key.data_ptr(),
            c.value.data_ptr(),
            c.k_scale.data_ptr() if per_block_scales and c.k_scale is not None else 0,
            c.v_scale.data_ptr() if per_block_scales and c.v_scale is not None else 0,
        )
        for c in caches
    )
    layers = _layer_table(rows, device)
    pairs = torch.stack([src.to(torch.int64), dst.to(torch.int64)], dim=1).contiguous()
    block_bytes = first.block_size * first.num_kv_heads * first.head_dim * first.key.element_size()
    scale_bytes = first.block_size * first.num_kv_heads * 4 if per_block_scales else 0
    _require(block_bytes % 16 == 0 and scale_bytes % 16 == 0, "block bytes must be 16-aligned")
    fn = rt.function(kc.copy_blocks_variant(), device)
    for l0 in range(0, len(caches), MAX_GRID_Y):
        l1 = min(len(caches), l0 + MAX_GRID_Y)
        rt.launch(
            fn,
            device,
            (pairs.shape[0], l1 - l0, 1),
            (COPY_THREADS, 1, 1),
            (_ptr(layers[l0:l1]), _ptr(pairs), np.int64(block_bytes), np.int64(scale_bytes)),
        )
