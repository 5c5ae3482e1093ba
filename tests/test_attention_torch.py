"""The torch paged-attention backend against a naive dense reference, and backend selection."""

from __future__ import annotations

import math
import re

import pytest
import torch

import headroom.engine.attention as attention
from headroom.engine.attention import (
    BackendUnavailable,
    TorchBackend,
    allocate_layer_cache,
    cuda_shape_reason,
    select_backend,
)
from headroom.engine.attention import torch_backend as tb
from headroom.engine.attention.base import LayerKVCache

BS, KV_HEADS, HEADS, DIM = 4, 2, 6, 8  # GQA: 3 query heads per KV head


def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """One query `[H, D]` over keys `lo..hi-1` of `k`/`v` `[n, Hkv, D]`, in float64."""
    groups = q.shape[0] // k.shape[1]
    kk = k[lo:hi].double().repeat_interleave(groups, 1)
    vv = v[lo:hi].double().repeat_interleave(groups, 1)
    s = torch.einsum("hd,nhd->hn", q.double(), kk) * DIM**-0.5
    return torch.einsum("hn,nhd->hd", s.softmax(-1), vv)


def _fill(
    lens: list[int], kv_dtype: str = "auto", dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[LayerKVCache, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """A cache holding sequences of `lens` tokens in shuffled blocks, with their block tables."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil(n / BS) for n in lens) + 3
    cache = allocate_layer_cache(num_blocks, BS, KV_HEADS, DIM, dtype, kv_dtype)  # type: ignore[arg-type]
    free = torch.randperm(num_blocks, generator=gen).tolist()
    backend = TorchBackend()
    tables, keys, values = [], [], []
    for n in lens:
        table = [free.pop() for _ in range(math.ceil(n / BS))]
        k = torch.randn(n, KV_HEADS, DIM, generator=gen).to(dtype)
        v = torch.randn(n, KV_HEADS, DIM, generator=gen).to(dtype)
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(n)])
        backend.write_kv(k, v, cache, slots)
        tables.append(table)
        keys.append(k)
        values.append(v)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return cache, block_tables, keys, values


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("chunk_bytes", [tb._CHUNK_BYTES, 1], ids=["one-chunk", "block-chunks"])
def test_decode_matches_naive_attention(
    monkeypatch: pytest.MonkeyPatch, window: int | None, chunk_bytes: int
) -> None:
    # A 1-byte chunk budget forces one block per chunk, exercising the active-row ranges.
    monkeypatch.setattr(tb, "_CHUNK_BYTES", chunk_bytes)
    lens = [5, 13, 1, 9, 16, 4, 30]
    cache, tables, keys, values = _fill(lens)
    q = torch.randn(len(lens), HEADS, DIM, generator=torch.Generator().manual_seed(1))
    out = TorchBackend().decode(
        q, cache, torch.tensor(lens, dtype=torch.int32), tables, DIM**-0.5, sliding_window=window
    )
    for i, n in enumerate(lens):
        lo = max(0, n - window) if window else 0
        ref = _naive(q[i], keys[i], values[i], lo, n)
        torch.testing.assert_close(out[i].double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "score_bytes,groups",
    [(1, [1, 1, 1]), (2 * HEADS * 4 * 12, [2, 1]), (tb._SCORE_BYTES, [3])],
    ids=["one-per-group", "two-per-group", "default-budget"],
)
def test_decode_splits_large_batches_into_score_groups(
    monkeypatch: pytest.MonkeyPatch, score_bytes: int, groups: list[int]
) -> None:
    """Rows per group is the score budget over one row's fp32 scores (heads x longest context)."""
    monkeypatch.setattr(tb, "_SCORE_BYTES", score_bytes)
    seen: list[int] = []
    real = TorchBackend._decode_group

    def spy(self: TorchBackend, q: torch.Tensor, *args: object) -> torch.Tensor:
        seen.append(q.shape[0])
        return real(self, q, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(TorchBackend, "_decode_group", spy)
    lens = [7, 3, 12]
    cache, tables, keys, values = _fill(lens, seed=4)
    q = torch.randn(len(lens), HEADS, DIM, generator=torch.Generator().manual_seed(2))
    out = TorchBackend().decode(q, cache, torch.tensor(lens, dtype=torch.int32), tables, DIM**-0.5)
    assert seen == groups
    for i, n in enumerate(lens):
        torch.testing.assert_close(
            out[i].double(), _naive(q[i], keys[i], values[i], 0, n), atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("tile", [tb._PREFILL_TILE, 4], ids=["one-tile", "4-row-tiles"])
def test_prefill_attends_to_cached_prefix(
    monkeypatch: pytest.MonkeyPatch, window: int | None, tile: int
) -> None:
    # 4-row tiles split the 13- and 4-token chunks, exercising each tile's key range and mask.
    monkeypatch.setattr(tb, "_PREFILL_TILE", tile)
    lens = [6, 13, 1, 9]
    new = [2, 13, 1, 4]  # the last `new` positions are queries; the rest is cached prefix
    cache, tables, keys, values = _fill(lens, seed=3)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(sum(new), HEADS, DIM, generator=gen)
    starts = torch.tensor([0, *torch.cumsum(torch.tensor(new), 0).tolist()], dtype=torch.int32)
    out = TorchBackend().prefill(
        q, cache, starts, torch.tensor(lens, dtype=torch.int32), tables, DIM**-0.5, window
    )
    for i, n in enumerate(lens):
        for r in range(new[i]):
            pos = n - new[i] + r
            lo = max(0, pos - window + 1) if window else 0
            ref = _naive(q[int(starts[i]) + r], keys[i], values[i], lo, pos + 1)
            torch.testing.assert_close(out[int(starts[i]) + r].double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype,tol", [("int8", 0.03), ("fp8", 0.15)])
def test_quantized_kv_is_dequantized_inside_attention(kv_dtype: str, tol: float) -> None:
    lens = [9, 17, 3]
    cache, tables, keys, values = _fill(lens, kv_dtype=kv_dtype, seed=6)
    assert cache.key.dtype == (torch.int8 if kv_dtype == "int8" else torch.float8_e4m3fn)
    q = torch.randn(len(lens), HEADS, DIM, generator=torch.Generator().manual_seed(7))
    out = TorchBackend().decode(q, cache, torch.tensor(lens, dtype=torch.int32), tables, DIM**-0.5)
    for i, n in enumerate(lens):
        ref = _naive(q[i], keys[i], values[i], 0, n).float()
        rel = (out[i] - ref).norm() / ref.norm()
        assert 0 < rel < tol, f"{kv_dtype}: relative error {rel:.3f}"


def test_bf16_cache_and_queries_accumulate_in_fp32() -> None:
    lens = [40, 7]
    cache, tables, keys, values = _fill(lens, dtype=torch.bfloat16, seed=8)
    q = torch.randn(len(lens), HEADS, DIM, generator=torch.Generator().manual_seed(9))
    out = TorchBackend().decode(
        q.bfloat16(), cache, torch.tensor(lens, dtype=torch.int32), tables, DIM**-0.5
    )
    assert out.dtype == torch.bfloat16
    for i, n in enumerate(lens):
        ref = _naive(q[i].bfloat16(), keys[i], values[i], 0, n)
        torch.testing.assert_close(out[i].double(), ref, atol=2e-2, rtol=2e-2)


def test_write_kv_skips_negative_slots() -> None:
    cache = allocate_layer_cache(2, BS, KV_HEADS, DIM, torch.float32)
    k = torch.ones(3, KV_HEADS, DIM)
    TorchBackend().write_kv(k, 2 * k, cache, torch.tensor([1, -1, 6]))
    flat_k = cache.key.view(-1, KV_HEADS, DIM)
    written = {i for i in range(2 * BS) if bool(flat_k[i].abs().sum() > 0)}
    assert written == {1, 6}
    assert torch.equal(cache.value.view(-1, KV_HEADS, DIM)[6], 2 * k[0])


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
def test_copy_blocks_moves_data_and_per_token_scales(kv_dtype: str) -> None:
    caches = [
        allocate_layer_cache(4, BS, KV_HEADS, DIM, torch.float32, kv_dtype)  # type: ignore[arg-type]
        for _ in range(2)
    ]
    backend = TorchBackend()
    x = torch.randn(BS, KV_HEADS, DIM) * 3
    for c in caches:
        backend.write_kv(x, -x, c, torch.arange(BS, 2 * BS))  # block 1
    backend.copy_blocks(caches, torch.tensor([1]), torch.tensor([3]))
    for c in caches:
        assert torch.equal(c.key[3].view(torch.uint8), c.key[1].view(torch.uint8))
        assert torch.equal(c.value[3].view(torch.uint8), c.value[1].view(torch.uint8))
        if kv_dtype == "int8":
            assert c.k_scale is not None and c.v_scale is not None
            assert torch.equal(c.k_scale[3], c.k_scale[1]) and bool(c.k_scale[3].gt(0).all())
            assert torch.equal(c.v_scale[3], c.v_scale[1])
        blocks = torch.tensor([3])
        torch.testing.assert_close(tb._gather(c, blocks, key=True)[0], x, atol=0.3, rtol=0.1)


@pytest.mark.parametrize(
    "chunk_bytes,chunks",
    [(tb._CHUNK_BYTES, 1), (2 * (2 * KV_HEADS * DIM * 4) * BS, 4)],
    ids=["default-budget", "two-blocks"],
)
def test_decode_gathers_as_many_blocks_per_chunk_as_the_budget_holds(
    monkeypatch: pytest.MonkeyPatch, chunk_bytes: int, chunks: int
) -> None:
    """Blocks per chunk is the chunk budget over one block's fp32 K (or V) for the active rows."""
    monkeypatch.setattr(tb, "_CHUNK_BYTES", chunk_bytes)
    calls: list[bool] = []
    real = TorchBackend._gather_into

    def spy(
        self: TorchBackend, cache: LayerKVCache, blocks: torch.Tensor, key: bool
    ) -> torch.Tensor:
        calls.append(key)
        return real(self, cache, blocks, key)

    monkeypatch.setattr(TorchBackend, "_gather_into", spy)
    lens = [30, 9]
    cache, tables, keys, values = _fill(lens, seed=10)
    q = torch.randn(len(lens), HEADS, DIM, generator=torch.Generator().manual_seed(11))
    out = TorchBackend().decode(q, cache, torch.tensor(lens, dtype=torch.int32), tables, DIM**-0.5)
    assert calls == [True] * chunks + [False] * chunks  # 8 blocks: one chunk, or 4 of 2 blocks
    for i, n in enumerate(lens):
        torch.testing.assert_close(
            out[i].double(), _naive(q[i], keys[i], values[i], 0, n), atol=1e-5, rtol=1e-5
        )


def test_decode_of_one_sequence_and_of_none() -> None:
    """A batch of one is attended like any other; an empty batch gives an empty result."""
    cache, tables, keys, values = _fill([10], seed=12)
    q = torch.randn(1, HEADS, DIM, generator=torch.Generator().manual_seed(13))
    lens = torch.tensor([10], dtype=torch.int32)
    out = TorchBackend().decode(q, cache, lens, tables, DIM**-0.5)
    torch.testing.assert_close(
        out[0].double(), _naive(q[0], keys[0], values[0], 0, 10), atol=1e-5, rtol=1e-5
    )
    none = TorchBackend().decode(q[:0], cache, lens[:0], tables[:0], DIM**-0.5)
    assert none.shape == (0, HEADS, DIM)


def test_torch_backend_declares_sliding_window_support() -> None:
    """The model passes its window only to backends declaring it; others attend to everything."""
    assert TorchBackend.supports_sliding_window is True


def test_select_backend() -> None:
    assert isinstance(select_backend("torch", "cpu"), TorchBackend)
    assert isinstance(select_backend("auto", "cpu"), TorchBackend)
    with pytest.raises(BackendUnavailable, match="CUDA device"):
        select_backend("cuda", "cpu")
    with pytest.raises(ValueError, match="auto, torch or cuda"):
        select_backend("triton", "cpu")  # type: ignore[arg-type]


def test_a_gpu_whose_kernels_do_not_fit_the_model_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Checked when the engine starts, not at the first request (which failed every request
    # while /ready said 200): head_dim 80 (h2o-danube, open_llama_3b) and 8-token blocks.
    monkeypatch.setattr(attention, "_cuda_backend_status", lambda dev: None)  # a GPU, CuPy
    assert cuda_shape_reason(128, 16) is None
    for head_dim, block_size, says in ((80, 16, "head_dim (64, 128), the model has 80"),
                                       (128, 8, "16k tokens, got 8")):  # fmt: skip
        with pytest.raises(BackendUnavailable, match=re.escape(says)):
            select_backend("cuda", "cuda", head_dim, block_size)
        assert isinstance(select_backend("auto", "cuda", head_dim, block_size), TorchBackend)


def test_a_float32_model_gets_torch_under_auto_and_a_clear_refusal_under_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The kernels take bf16/fp16 caches only; a float32 model (--dtype float32, or auto with a
    # float32 checkpoint) used to get CudaBackend and fail its first write_kv with TypeError.
    monkeypatch.setattr(attention, "_cuda_backend_status", lambda dev: None)  # a GPU, CuPy
    says = "take bfloat16 or float16 models, the model runs in float32; use --dtype bfloat16"
    assert cuda_shape_reason(128, 16, torch.float32) is not None
    with pytest.raises(BackendUnavailable, match=re.escape(says)):
        select_backend("cuda", "cuda", 128, 16, torch.float32)
    assert isinstance(select_backend("auto", "cuda", 128, 16, torch.float32), TorchBackend)
    for dtype in (torch.bfloat16, torch.float16):
        assert cuda_shape_reason(128, 16, dtype) is None


def test_the_engine_passes_the_models_dtype_when_it_picks_a_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A float32 model on a GPU must get torch under `auto`: the engine used to leave the
    # model's dtype out of the choice, so only the head size and block size were checked.
    import headroom.engine.engine as engine_module
    from headroom.engine.config import EngineConfig

    seen: list[torch.dtype | None] = []

    def spy(*args: object) -> attention.AttentionBackend:
        seen.append(args[4] if len(args) > 4 else None)  # type: ignore[arg-type]
        return TorchBackend()

    monkeypatch.setattr(engine_module, "select_backend", spy)
    cfg = EngineConfig(model="tiny", num_blocks=16, max_model_len=64, num_threads=1)
    engine = engine_module.Engine.from_config(cfg)
    assert seen == [torch.float32] and isinstance(engine.runner.backend, TorchBackend)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_stale_non_finite_value_outside_a_context_does_not_reach_decode(poison: float) -> None:
    """A slot past a row's length in its last block, and block 0 padding a shorter row's table,
    may hold anything a freed sequence left: masked, they must not turn the output NaN (0 x NaN
    in p.V), as the CUDA kernel and prefill never read them."""
    bs, hkv, heads, d = 4, 2, 6, 8
    k, v = torch.randn(6, hkv, d), torch.randn(6, hkv, d)
    k2, v2 = torch.randn(2, hkv, d), torch.randn(2, hkv, d)
    slots = torch.tensor([4, 5, 6, 7, 8, 9])  # blocks 1 and 2; slots 10, 11 past the end
    q = torch.randn(2, heads, d)
    lens, tables = torch.tensor([6, 2], dtype=torch.int32), torch.tensor([[1, 2], [3, 0]])
    outs = []
    for dirty in (False, True):
        cache = allocate_layer_cache(4, bs, hkv, d, torch.float32)
        TorchBackend().write_kv(k, v, cache, slots)
        TorchBackend().write_kv(k2, v2, cache, torch.tensor([12, 13]))
        if dirty:
            cache.value[2, 3] = cache.key[2, 3] = poison  # past row 0's 6 tokens
            cache.value[0] = cache.key[0] = poison  # row 1's padding entry
        outs.append(TorchBackend().decode(q, cache, lens, tables, d**-0.5))
    assert outs[1].isfinite().all()
    torch.testing.assert_close(outs[1], outs[0])


@pytest.mark.parametrize("lens", [[0, 0], [5, 0], [0, 3, 0]], ids=["all", "one", "two"])
def test_a_zero_length_context_decodes_to_zeros(lens: list[int]) -> None:
    """A row with no context attends to nothing: zeros, as the CUDA kernel gives (it was NaN
    beside a longer row and a ValueError alone), and the other rows are unchanged."""
    bs, hkv, heads, d = 4, 2, 4, 8
    cache = allocate_layer_cache(4, bs, hkv, d, torch.float32)
    TorchBackend().write_kv(torch.randn(8, hkv, d), torch.randn(8, hkv, d), cache, torch.arange(8))
    q = torch.randn(len(lens), heads, d)
    tables = torch.tensor([[0, 1]] * len(lens))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = TorchBackend().decode(q, cache, seq_lens, tables, d**-0.5)
    for i, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[i], torch.zeros(heads, d))
        else:
            alone = TorchBackend().decode(
                q[i : i + 1], cache, seq_lens[i : i + 1], tables[:1], d**-0.5
            )
            torch.testing.assert_close(out[i : i + 1], alone)
