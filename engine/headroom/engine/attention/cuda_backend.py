"""The GPU attention backend: headroom's CUDA kernels launched through CuPy on torch tensors.

Tensors never leave torch: the launchers pass `data_ptr()` addresses to CuPy kernel
functions on torch's current stream (`cupy.cuda.ExternalStream`), so there are no copies and
no extra synchronisation. Kernels are compiled by NVRTC for the device's exact `sm_XY` on
first use and kept as CUBINs under `$HEADROOM_CACHE/kernels` (keyed by source, headers, flags
and NVRTC version) when that directory can be written.

Its rooms: cuda_validate (checks and launch geometry, pure), cuda_runtime (CuPy and the CUBIN
cache), cuda_launch (the launchers); this module is the `AttentionBackend` over them and
re-exports their public names.
"""

from __future__ import annotations

import os

import torch

from headroom.engine.attention.base import LayerKVCache
from headroom.engine.attention.cuda_launch import copy_blocks, paged_decode, write_kv
from headroom.engine.attention.cuda_runtime import (
    CupyRuntime,
    KernelRuntime,
    cuda_available,
    cuda_unavailable_reason,
    default_runtime,
)
from headroom.engine.attention.cuda_validate import (
    CACHE_THREADS,
    COPY_THREADS,
    DECODE_THREADS,
    HEADS_PER_CTA,
    MAX_GRID_Y,
    MAX_PARTITIONS,
    MIN_PARTITION_TOKENS,
    PARTITION_ROUNDING,
    TARGET_WAVES,
    TILE_TOKENS,
    DecodeGeometry,
    choose_partition_size,
    num_partitions,
    prefill_rows,
    validate_cache,
    validate_copy,
    validate_decode,
    validate_partition_size,
    validate_prefill,
    validate_write,
)

DEBUG_CHECKS_ENV = "HEADROOM_DEBUG_CHECKS"


def debug_checks() -> bool:
    """True when `HEADROOM_DEBUG_CHECKS` asks for the per-step value checks (1/true/yes)."""
    return os.environ.get(DEBUG_CHECKS_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class CudaBackend:
    """`AttentionBackend` on the GPU: CuPy-launched CUDA kernels, torch tensors throughout.

    Shape, dtype, stride and device checks always run: they read tensor metadata on the host.
    `check_values` also checks index *contents* (block ids, slots, lengths) on every call;
    each such check reads a GPU value back (a host-device sync), 2 per layer for the cache
    write and 4 per layer for decode, which stalls the launch queue ~190 times a step on a
    32-layer model. So it is off unless asked for (tests, or `HEADROOM_DEBUG_CHECKS=1`): the
    values are validated once, on the host, where they can first go wrong. Token ids and
    lengths at admission (`headroom.engine.validation`); positions against the block table
    when slots are built (`block_table.slot_mapping` raises), so every seq_len fits its
    table; block ids come only from `BlockPool`, which hands out ids in [0, num_blocks).
    `runtime` defaults to CuPy.
    """

    name = "cuda"

    def __init__(
        self, check_values: bool | None = None, runtime: KernelRuntime | None = None
    ) -> None:
        self.check_values = debug_checks() if check_values is None else check_values
        self.runtime = runtime

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: LayerKVCache,
        slot_mapping: torch.Tensor,
    ) -> None:
        write_kv(
            key, value, cache, slot_mapping, check_values=self.check_values, runtime=self.runtime
        )

    def prefill(
        self,
        query: torch.Tensor,
        cache: LayerKVCache,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        validate_prefill(
            query, cache, query_start_loc, seq_lens, block_tables, check_values=self.check_values
        )
        row_seq, row_lens = prefill_rows(query_start_loc, seq_lens, query.shape[0])
        return paged_decode(
            query,
            cache,
            row_lens,
            block_tables,
            scale,
            row_to_seq=row_seq,
            check_values=False,
            runtime=self.runtime,
        )

    def decode(
        self,
        query: torch.Tensor,
        cache: LayerKVCache,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        return paged_decode(
            query,
            cache,
            seq_lens,
            block_tables,
            scale,
            check_values=self.check_values,
            runtime=self.runtime,
        )

    def copy_blocks(self, caches: list[LayerKVCache], src: torch.Tensor, dst: torch.Tensor) -> None:
        copy_blocks(caches, src, dst, check_values=self.check_values, runtime=self.runtime)


__all__ = [
    "CACHE_THREADS",
    "COPY_THREADS",
    "DEBUG_CHECKS_ENV",
    "DECODE_THREADS",
    "HEADS_PER_CTA",
    "MAX_GRID_Y",
    "MAX_PARTITIONS",
    "MIN_PARTITION_TOKENS",
    "PARTITION_ROUNDING",
    "TARGET_WAVES",
    "TILE_TOKENS",
    "CudaBackend",
    "CupyRuntime",
    "DecodeGeometry",
    "KernelRuntime",
    "choose_partition_size",
    "copy_blocks",
    "cuda_available",
    "cuda_unavailable_reason",
    "debug_checks",
    "default_runtime",
    "num_partitions",
    "paged_decode",
    "prefill_rows",
    "validate_cache",
    "validate_copy",
    "validate_decode",
    "validate_partition_size",
    "validate_prefill",
    "validate_write",
    "write_kv",
]
