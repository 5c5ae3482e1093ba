"""Edges of the CUDA launchers' pure-Python checks: what they accept as well as what they refuse."""

from __future__ import annotations

import pytest
import torch

from headroom.engine.attention import cuda_validate as cv
from headroom.engine.attention.base import LayerKVCache, allocate_layer_cache


def _cache(hkv: int = 2, kv_dtype: str = "auto") -> LayerKVCache:
    """An 8-block, 16-token-block bf16 cache with head_dim 64."""
    return allocate_layer_cache(8, 16, hkv, 64, torch.bfloat16, kv_dtype)  # type: ignore[arg-type]


def test_a_cache_with_only_its_value_non_contiguous_is_refused() -> None:
    """Both K and V must be contiguous: the kernels address either by slot arithmetic."""
    cache = _cache()
    cache.value = cache.value.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match="must be contiguous"):
        cv.validate_cache(cache)


def test_zero_strides_are_accepted_and_one_query_head_is_enough() -> None:
    """Only negative strides are refused (a broadcast row is fine), and MQA's 1 head is valid."""
    cache = _cache(hkv=1)
    query = torch.zeros(1, 1, 64, dtype=torch.bfloat16).expand(3, 4, 64)  # strides (0, 0, 1)
    seq_lens = torch.full((3,), 20, dtype=torch.int32)
    tables = torch.zeros(3, 2, dtype=torch.int32)
    assert cv.validate_decode(query, cache, seq_lens, tables).num_heads == 4
    assert cv.validate_decode(query[:, :1], cache, seq_lens, tables).group == 1
    row = torch.zeros(64, dtype=torch.bfloat16).expand(3, 2, 64)  # strides (0, 0, 1)
    cv.validate_write(row, row, _cache(hkv=2), torch.tensor([0, 1, -1]))


def test_decode_geometry_counts_table_rows_and_columns() -> None:
    """num_seqs is the block table's rows and max_blocks_per_seq its columns."""
    cache = _cache()
    query = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    tables = torch.zeros(3, 2, dtype=torch.int32)
    geo = cv.validate_decode(query, cache, torch.full((3,), 20, dtype=torch.int32), tables)
    assert (geo.num_seqs, geo.max_blocks_per_seq, geo.num_blocks) == (3, 2, 8)


def test_prefill_accepts_empty_chunks_and_an_empty_batch() -> None:
    """A sequence with no new rows, or no sequences at all, is valid; no start locations is not."""
    cache = _cache()
    query = torch.zeros(10, 4, 64, dtype=torch.bfloat16)
    seq_lens = torch.tensor([12, 3, 4], dtype=torch.int32)
    tables = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    qsl = torch.tensor([0, 6, 6, 10], dtype=torch.int32)
    assert cv.validate_prefill(query, cache, qsl, seq_lens, tables).num_rows == 10
    empty = cv.validate_prefill(query[:0], cache, qsl[:1], seq_lens[:0], tables[:0].contiguous())
    assert (empty.num_rows, empty.num_seqs) == (0, 0)
    with pytest.raises(ValueError, match="needs num_seqs \\+ 1 entries"):
        cv.validate_prefill(query[:0], cache, qsl[:0], seq_lens[:0], tables[:0].contiguous())


def test_a_strided_slot_mapping_is_refused() -> None:
    """slot_mapping must be contiguous as well as 1-D: the cache kernel indexes it densely."""
    cache = _cache()
    key = torch.zeros(2, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous 1-D"):
        cv.validate_write(key, key, cache, torch.tensor([0, 9, 1, 9])[::2])


def test_partition_sizes_are_exact() -> None:
    """ceil(waves x slots / ctas) partitions, each rounded up to 256 tokens; edges accepted."""
    slots = 264
    # 512 CTAs fill 264 slots under 8 times: ceil(2112 / 512) = 5 partitions
    assert cv.choose_partition_size(num_ctas=512, max_context=4096, slots=slots) == 1024
    assert cv.choose_partition_size(num_ctas=512, max_context=8192, slots=slots) == 1792
    assert cv.choose_partition_size(num_ctas=4, max_context=0, slots=1) == 0
    assert cv.choose_partition_size(num_ctas=1, max_context=4096, slots=1) == 512
    for bad in ((0, 10, 1), (1, 10, 0), (1, -1, 1)):
        with pytest.raises(ValueError, match="must be positive"):
            cv.choose_partition_size(*bad)
