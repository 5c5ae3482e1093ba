"""The CUDA launchers' input checks and the split-context heuristic, on CPU tensors."""

from __future__ import annotations

import pytest
import torch

from headroom.engine.attention import cuda_backend as cb
from headroom.engine.attention.base import LayerKVCache, allocate_layer_cache


def cache_of(
    kv_dtype: str = "auto",
    dtype: torch.dtype = torch.bfloat16,
    blocks: int = 8,
    block_size: int = 16,
    hkv: int = 2,
    d: int = 64,
) -> LayerKVCache:
    return allocate_layer_cache(blocks, block_size, hkv, d, dtype, kv_dtype)  # type: ignore[arg-type]


def decode_inputs(
    cache: LayerKVCache, seqs: int = 3, heads: int = 8, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, ...]:
    query = torch.zeros(seqs, heads, cache.head_dim, dtype=dtype)
    seq_lens = torch.full((seqs,), 20, dtype=torch.int32)
    tables = torch.arange(seqs * 2, dtype=torch.int32).view(seqs, 2) % cache.num_blocks
    return query, seq_lens, tables


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "int8"])
def test_valid_decode_returns_geometry(kv_dtype: str) -> None:
    cache = cache_of(kv_dtype)
    query, seq_lens, tables = decode_inputs(cache, heads=40)
    geo = cb.validate_decode(query, cache, seq_lens, tables)
    assert (geo.num_rows, geo.num_heads, geo.num_kv_heads, geo.group) == (3, 40, 2, 20)
    assert geo.head_chunks == 2  # 20 query heads per kv head -> two 16-head CTAs
    assert geo.ctas_per_partition == 3 * 2 * 2
    assert geo.max_context == 32 and geo.kv_dtype == kv_dtype


def test_query_dtype_and_cache_dtype_must_match() -> None:
    cache = cache_of("auto", torch.bfloat16)
    query, seq_lens, tables = decode_inputs(cache, dtype=torch.float16)
    with pytest.raises(TypeError, match="query is float16 but the auto cache is bfloat16"):
        cb.validate_decode(query, cache, seq_lens, tables)
    with pytest.raises(TypeError, match="query must be bfloat16, float16, got float32"):
        cb.validate_decode(query.float(), cache, seq_lens, tables)


def test_quantized_cache_storage_and_scales_are_checked() -> None:
    bad = cache_of("fp8")
    bad.key = bad.key.view(torch.int8)
    bad.value = bad.value.view(torch.int8)
    query, seq_lens, tables = decode_inputs(bad)
    with pytest.raises(TypeError, match=r"cache.key \(fp8\) must be float8_e4m3fn, got int8"):
        cb.validate_decode(query, bad, seq_lens, tables)
    int8 = cache_of("int8")
    int8.k_scale = torch.ones(int8.num_kv_heads)  # per-head, but int8 needs per token-head
    with pytest.raises(ValueError, match=r"cache.k_scale must have shape \(8, 16, 2\)"):
        cb.validate_cache(int8)
    missing = cache_of("fp8")
    missing.v_scale = None
    with pytest.raises(ValueError, match=r"needs cache\.v_scale"):
        cb.validate_cache(missing)
    wrong = cache_of("fp8")
    wrong.k_scale = torch.ones(2, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"cache\.k_scale must be float32"):
        cb.validate_cache(wrong)


def test_cache_layout_limits() -> None:
    with pytest.raises(ValueError, match="head_dim 96 is not compiled"):
        cb.validate_cache(cache_of(d=96))
    with pytest.raises(ValueError, match="block_size must be a positive multiple of 16"):
        cb.validate_cache(cache_of(block_size=8))
    c = cache_of()
    c.key = c.key.transpose(1, 2)
    c.value = c.value.transpose(1, 2)
    with pytest.raises(ValueError, match="must be contiguous"):
        cb.validate_cache(c)


def test_query_shape_and_strides() -> None:
    cache = cache_of()
    query, seq_lens, tables = decode_inputs(cache)
    with pytest.raises(ValueError, match="7 heads, not a multiple of num_kv_heads 2"):
        cb.validate_decode(query[:, :7], cache, seq_lens, tables)
    with pytest.raises(ValueError, match="must be contiguous in head_dim"):
        cb.validate_decode(
            query.transpose(1, 2).contiguous().transpose(1, 2), cache, seq_lens, tables
        )
    with pytest.raises(ValueError, match="head_dim 32 != cache head_dim 64"):
        cb.validate_decode(query[..., :32], cache, seq_lens, tables)
    strided = torch.zeros(3, 12, 64, dtype=torch.bfloat16)[:, :8]  # a view of fused QKV
    assert cb.validate_decode(strided, cache, seq_lens, tables).num_heads == 8


def test_block_table_and_seq_len_values() -> None:
    cache = cache_of(blocks=8)
    query, seq_lens, tables = decode_inputs(cache)
    bad = tables.clone()
    bad[1, 1] = 8
    with pytest.raises(
        ValueError, match=r"block_tables values must be in \[0, 8\), found \[0, 8\]"
    ):
        cb.validate_decode(query, cache, seq_lens, bad)
    bad[1, 1] = -1
    with pytest.raises(ValueError, match="block_tables values"):
        cb.validate_decode(query, cache, seq_lens, bad)
    long = seq_lens.clone()
    long[0] = 33
    with pytest.raises(ValueError, match="seq_lens max 33 exceeds max_blocks_per_seq"):
        cb.validate_decode(query, cache, long, tables)
    # value checks can be turned off (they cost a device sync on a GPU)
    cb.validate_decode(query, cache, long, bad, check_values=False)
    with pytest.raises(TypeError, match="block_tables must be int32, got int64"):
        cb.validate_decode(query, cache, seq_lens, tables.long())
    with pytest.raises(ValueError, match="seq_lens must have 3 entries, got 2"):
        cb.validate_decode(query, cache, seq_lens[:2], tables)
    with pytest.raises(ValueError, match="block_tables has 2 rows, expected 3"):
        cb.validate_decode(query, cache, seq_lens, tables[:2])
    with pytest.raises(ValueError, match="block_tables must be contiguous"):
        cb.validate_decode(query, cache, seq_lens, tables.t().contiguous().t())


def test_prefill_start_locations() -> None:
    cache = cache_of()
    query = torch.zeros(10, 4, 64, dtype=torch.bfloat16)
    seq_lens = torch.tensor([12, 4], dtype=torch.int32)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    ok = torch.tensor([0, 6, 10], dtype=torch.int32)
    assert cb.validate_prefill(query, cache, ok, seq_lens, tables).num_rows == 10
    with pytest.raises(ValueError, match=r"query_start_loc\[-1\] = 9 != number of query rows 10"):
        cb.validate_prefill(
            query, cache, torch.tensor([0, 6, 9], dtype=torch.int32), seq_lens, tables
        )
    with pytest.raises(ValueError, match="non-decreasing"):
        cb.validate_prefill(
            query[:6], cache, torch.tensor([0, 7, 6], dtype=torch.int32), seq_lens, tables
        )
    with pytest.raises(ValueError, match="chunk is longer than its sequence"):
        cb.validate_prefill(
            query, cache, torch.tensor([0, 5, 10], dtype=torch.int32), seq_lens, tables
        )


def test_prefill_rows_are_causal_positions() -> None:
    qsl = torch.tensor([0, 3, 3, 5], dtype=torch.int32)  # the middle sequence has no new rows
    seq_lens = torch.tensor([10, 4, 2], dtype=torch.int32)
    row_seq, row_lens = cb.prefill_rows(qsl, seq_lens, 5)
    assert row_seq.tolist() == [0, 0, 0, 2, 2]
    assert row_lens.tolist() == [8, 9, 10, 1, 2]
    assert row_seq.dtype == row_lens.dtype == torch.int32


def test_write_checks() -> None:
    cache = cache_of("int8", torch.float16, hkv=2)
    key = torch.zeros(4, 2, 64, dtype=torch.float16)
    slots = torch.tensor([0, 5, -1, 127], dtype=torch.int64)
    cb.validate_write(key, key, cache, slots)
    with pytest.raises(ValueError, match=r"slot_mapping values must be -1 or in \[0, 128\)"):
        cb.validate_write(key, key, cache, torch.tensor([0, 5, -2, 1]))
    with pytest.raises(ValueError, match=r"slot_mapping values must be -1 or in \[0, 128\)"):
        cb.validate_write(key, key, cache, torch.tensor([0, 5, 128, 1]))
    with pytest.raises(TypeError, match="slot_mapping must be int64, got int32"):
        cb.validate_write(key, key, cache, slots.int())
    with pytest.raises(ValueError, match=r"key must be \[tokens, 2, 64\]"):
        cb.validate_write(key[:, :1], key, cache, slots)
    with pytest.raises(ValueError, match="key/value have 3/4 tokens, slot_mapping has 4"):
        cb.validate_write(key[:3], key, cache, slots)
    with pytest.raises(TypeError, match="value is bfloat16, key is float16"):
        cb.validate_write(key, key.bfloat16(), cache, slots)
    auto = cache_of("auto", torch.bfloat16)
    with pytest.raises(TypeError, match="key is float16 but the auto cache is bfloat16"):
        cb.validate_write(key, key, auto, slots)


def test_copy_checks() -> None:
    caches = [cache_of("int8") for _ in range(2)]
    src, dst = torch.tensor([0, 1]), torch.tensor([2, 3])
    cb.validate_copy(caches, src, dst)
    with pytest.raises(ValueError, match="dst has repeated block ids"):
        cb.validate_copy(caches, src, torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="both a source and a destination"):
        cb.validate_copy(caches, src, torch.tensor([1, 3]))
    with pytest.raises(ValueError, match=r"block ids must be in \[0, 8\)"):
        cb.validate_copy(caches, src, torch.tensor([2, 8]))
    with pytest.raises(ValueError, match="layer 1 cache differs from layer 0"):
        cb.validate_copy([caches[0], cache_of("auto")], src, dst)
    with pytest.raises(ValueError, match="src has 2 ids, dst has 1"):
        cb.validate_copy(caches, src, dst[:1])
    with pytest.raises(TypeError, match="src must be int32, int64, got float32"):
        cb.validate_copy(caches, src.float(), dst)
    with pytest.raises(ValueError, match="at least one layer"):
        cb.validate_copy([], src, dst)


def test_partition_heuristic() -> None:
    slots = 264  # 132 SMs x 2 resident decode CTAs
    # plenty of CTAs: one pass
    assert cb.choose_partition_size(num_ctas=4096, max_context=4096, slots=slots) == 0
    # short contexts never split
    assert cb.choose_partition_size(num_ctas=8, max_context=512, slots=slots) == 0
    # batch 64, Llama-3.1-8B (8 kv heads), 4k: 512 CTAs -> split to ~8 waves
    size = cb.choose_partition_size(num_ctas=512, max_context=4096, slots=slots)
    assert size % 256 == 0 and 512 <= size < 4096
    assert 512 * cb.num_partitions(4096, size) >= 4 * slots
    # batch 1, 32k: many partitions, each at least the minimum
    size = cb.choose_partition_size(num_ctas=8, max_context=32768, slots=slots)
    assert size == cb.MIN_PARTITION_TOKENS
    assert cb.num_partitions(32768, size) == 64
    # a huge context caps the partition count
    size = cb.choose_partition_size(num_ctas=1, max_context=2**20, slots=slots)
    assert cb.num_partitions(2**20, size) <= cb.MAX_PARTITIONS
    assert size % cb.TILE_TOKENS == 0
    assert cb.num_partitions(4096, 0) == 1
    with pytest.raises(ValueError):
        cb.choose_partition_size(num_ctas=0, max_context=10, slots=slots)


class NoLaunches:
    """A `KernelRuntime` that must never launch (the call is refused before any launch)."""

    def function(self, variant: object, device: torch.device) -> object:
        return variant

    def launch(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("launched")

    def resident_slots(self, fn: object, device: torch.device) -> int:
        return 4


def test_an_explicit_partition_size_past_max_partitions_is_refused() -> None:
    # 16-token partitions of a 17,600-token context: 1,100 partitions, past the reduce kernel's
    # MAX_PARTITIONS (its shared weights; grid.z also stops at 65,535).
    cache = cache_of(blocks=1100)
    query = torch.zeros(1, 8, cache.head_dim, dtype=torch.bfloat16)
    seq_lens = torch.tensor([1100 * 16], dtype=torch.int32)
    tables = torch.arange(1100, dtype=torch.int32)[None]
    with pytest.raises(ValueError, match=r"1100 partitions, more than the 1024 .* at least 32"):
        cb.paged_decode(
            query, cache, seq_lens, tables, 0.125, partition_size=16, runtime=NoLaunches()
        )
    assert cb.validate_partition_size(32, 1100 * 16) == 550
    assert cb.validate_partition_size(16, 1024 * 16) == cb.MAX_PARTITIONS
    assert cb.validate_partition_size(0, 10**6) == 1
    with pytest.raises(ValueError, match="multiple of 16"):
        cb.validate_partition_size(24, 100)


def test_backend_names_itself_and_refuses_cpu_tensors() -> None:
    backend = cb.CudaBackend()
    assert backend.name == "cuda"
    cache = cache_of()
    query, seq_lens, tables = decode_inputs(cache)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        backend.decode(query, cache, seq_lens, tables, 0.125)


def test_cuda_available_is_false_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert cb.cuda_available() is False
