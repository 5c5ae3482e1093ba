"""The contract every attention backend implements (torch on CPU, CuPy CUDA kernels on GPU).

Cache layout, per layer: `key` and `value` are `[num_blocks, block_size, num_kv_heads,
head_dim]`, so one token's K for all heads is contiguous and a block is one slab that
`copy_blocks` can move. A token at logical position p of a sequence lives in physical slot
`block_table[p // block_size] * block_size + p % block_size`.

Quantized KV (`kv_dtype` fp8 or int8) stores `key`/`value` as float8_e4m3fn / int8 and keeps
fp32 scales beside them (dequantized value = stored * scale):
- fp8: one scale per (layer, kv head), shape `[num_kv_heads]`, fixed at cache creation (1.0
  unless calibrated). e4m3 is a float format, so its relative precision does not depend on the
  scale; the scale only guards the +-448 range, and a static per-head scale keeps fp8 at exactly
  half the bytes of bf16 per token.
- int8: one scale per (token, kv head), shape `[num_blocks, block_size, num_kv_heads]`, computed
  at write time as absmax/127. int8 is a uniform grid, so a static scale would waste most of its
  256 levels on tokens far below the outlier range; per-token scales cost 4 bytes per head-token.
Softmax and accumulation are fp32 in every backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from headroom.engine import quant

KVDtype = Literal["auto", "fp8", "int8"]


@dataclass(slots=True)
class LayerKVCache:
    """One layer's paged K/V storage and, for quantized KV, its scales."""

    key: torch.Tensor
    value: torch.Tensor
    kv_dtype: KVDtype = "auto"
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def num_blocks(self) -> int:
        return int(self.key.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.key.shape[1])

    @property
    def num_kv_heads(self) -> int:
        return int(self.key.shape[2])

    @property
    def head_dim(self) -> int:
        return int(self.key.shape[3])

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cache as fp32 (K, V): stored value * scale, as every backend reads it."""
        return (
            quant.dequantize(self.key, self.kv_dtype, self.k_scale),
            quant.dequantize(self.value, self.kv_dtype, self.v_scale),
        )


def storage_dtype(kv_dtype: KVDtype, model_dtype: torch.dtype) -> torch.dtype:
    """The element type the cache tensors are allocated with."""
    if kv_dtype == "fp8":
        return torch.float8_e4m3fn
    if kv_dtype == "int8":
        return torch.int8
    return model_dtype


def allocate_layer_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    model_dtype: torch.dtype,
    kv_dtype: KVDtype = "auto",
    device: torch.device | str = "cpu",
) -> LayerKVCache:
    """Allocate one layer's cache (zeroed) with the scale tensors its `kv_dtype` needs."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    dtype = storage_dtype(kv_dtype, model_dtype)
    key = torch.zeros(shape, dtype=dtype, device=device)
    value = torch.zeros(shape, dtype=dtype, device=device)
    k_scale = v_scale = None
    if kv_dtype == "fp8":
        k_scale = torch.ones(num_kv_heads, dtype=torch.float32, device=device)
        v_scale = torch.ones(num_kv_heads, dtype=torch.float32, device=device)
    elif kv_dtype == "int8":
        k_scale = torch.zeros(shape[:3], dtype=torch.float32, device=device)
        v_scale = torch.zeros(shape[:3], dtype=torch.float32, device=device)
    return LayerKVCache(key, value, kv_dtype, k_scale, v_scale)


class AttentionBackend(Protocol):
    """Paged attention. Tensors are on the cache's device; ids and lengths are int32.

    - `query`: `[num_tokens, num_heads, head_dim]`, model dtype; `num_heads` is a multiple of
      `num_kv_heads` (GQA: query head h reads kv head h // (num_heads // num_kv_heads)).
    - `block_tables`: `[num_seqs, max_blocks_per_seq]`, padded with 0 past each sequence's end.
    - `seq_lens`: `[num_seqs]`, tokens of context per sequence *including* the new ones.
    - returns `[num_tokens, num_heads, head_dim]` in the query's dtype.
    """

    name: str

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: LayerKVCache,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store new K/V (`[num_tokens, num_kv_heads, head_dim]`) at `slot_mapping`
        (`[num_tokens]`, int64 physical slots; -1 means skip), quantizing when asked."""
        ...

    def prefill(
        self,
        query: torch.Tensor,
        cache: LayerKVCache,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention for variable-length chunks: sequence i owns query rows
        `query_start_loc[i]:query_start_loc[i+1]`, which are its last positions, so a chunk
        after a cached prefix attends to the prefix blocks too. K/V must already be written."""
        ...

    def decode(
        self,
        query: torch.Tensor,
        cache: LayerKVCache,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """One query token per sequence (`query` is `[num_seqs, num_heads, head_dim]`)
        attending to its whole context."""
        ...

    def copy_blocks(self, caches: list[LayerKVCache], src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks `src[i] -> dst[i]` in every layer (copy-on-write), scales too."""
        ...
