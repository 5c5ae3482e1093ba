"""The GPU attention backend: headroom's CUDA kernels launched through CuPy on torch tensors.

Tensors never leave torch: the launchers pass `data_ptr()` addresses to `cupy.RawModule`
functions on torch's current stream (`cupy.cuda.ExternalStream`), so there are no copies and
no extra synchronisation. Kernels are compiled by NVRTC for the device's exact `sm_XY` on
first use and kept as CUBINs under `$HEADROOM_CACHE/kernels` (keyed by source, flags and
NVRTC version).

Its rooms: cuda_validate (checks and launch geometry, pure), cuda_runtime (CuPy and the CUBIN
cache), cuda_launch (the launchers); this module is the `AttentionBackend` over them and
re-exports their public names.
"""

from __future__ import annotations

import torch

from headroom.engine.attention.base import LayerKVCache
from headroom.engine.attention.cuda_launch import copy_blocks, paged_decode, write_kv
from headroom.engine.attention.cuda_runtime import (
    CupyRuntime,
    KernelRuntime,
    cuda_available,
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
    validate_prefill,
    validate_write,
)


class CudaBackend:
    """`AttentionBackend` on the GPU: CuPy-launched CUDA kernels, torch tensors throughout.

    `check_values` (default on) also checks index *contents* (block ids, slots, lengths),
    which costs a device sync per call; the engine may turn it off once its scheduler is
    trusted. Shape, dtype and stride checks always run. `runtime` defaults to CuPy.
    """

    name = "cuda"

    def __init__(self, check_values: bool = True, runtime: KernelRuntime | None = None) -> None:
        self.check_values = check_values
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
    "default_runtime",
    "num_partitions",
    "paged_decode",
    "prefill_rows",
    "validate_cache",
    "validate_copy",
    "validate_decode",
    "validate_prefill",
    "validate_write",
    "write_kv",
]
