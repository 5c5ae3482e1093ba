"""The torch attention backend: paged attention in plain torch ops, the CPU path and reference.

Decode never materialises a sequence's whole context. Sequences are sorted by context length
and the block tables are walked in chunks of a few blocks: each chunk's pages are gathered for
all sequences still active in it with one `index_select` (a chunk-sized buffer that stays in
cache), attended with torch's fused CPU attention kernel (which returns the log-sum-exp), and
merged into a running (output, lse) pair. Gathering the whole context first would copy every
K/V byte twice more than dense attention reads it, which alone costs 2-3x dense time.

Quantized K/V are dequantized to fp32 chunk by chunk and every softmax and accumulation is in
fp32 whatever the model dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from headroom.engine import quant
from headroom.engine.attention.base import LayerKVCache

# Bytes of gathered K+V (fp32) per decode chunk: small enough to stay in L2/L3, large enough
# that per-chunk op overhead is amortised.
_CHUNK_BYTES = 2 * 1024 * 1024
# Query rows per prefill tile: bounds the score matrix when the fused kernel falls back to math.
_PREFILL_TILE = 512
_NEG_INF = float("-inf")


def _fused_attention_op() -> Any:
    """torch's fused CPU attention returning (output, logsumexp), or None on builds without it."""
    ops = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    return getattr(ops, "default", None)


class TorchBackend:
    """Paged attention over `LayerKVCache` with torch ops; runs on any device torch supports."""

    name = "torch"
    supports_sliding_window = True

    def __init__(self, use_fused: bool | None = None) -> None:
        fused = _fused_attention_op()
        if use_fused is None:
            use_fused = fused is not None
        if use_fused and fused is None:
            raise RuntimeError("this torch build has no fused CPU attention kernel")
        self._fused = fused if use_fused else None

    # -- cache writes and copies --------------------------------------------------------------

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: LayerKVCache,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store new K/V at `slot_mapping` (-1 skips), quantizing to the cache's dtype."""
        slots = slot_mapping.to(device=cache.key.device, dtype=torch.long)
        valid = slots >= 0
        if not bool(valid.all()):
            slots, key, value = slots[valid], key[valid], value[valid]
        if slots.numel() == 0:
            return
        heads, dim = cache.num_kv_heads, cache.head_dim
        for src, dst, scale in (
            (key, cache.key, cache.k_scale),
            (value, cache.value, cache.v_scale),
        ):
            stored, token_scale = quant.quantize(src, cache.kv_dtype, scale)
            _as_bytes(dst).view(-1, heads, dim)[slots] = _as_bytes(stored.to(dst.dtype))
            if token_scale is not None:
                assert scale is not None
                scale.view(-1, heads)[slots] = token_scale

    def copy_blocks(self, caches: list[LayerKVCache], src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks `src[i] -> dst[i]` in every layer; per-token scales move with them."""
        if src.numel() == 0:
            return
        for cache in caches:
            s = src.to(device=cache.key.device, dtype=torch.long)
            d = dst.to(device=cache.key.device, dtype=torch.long)
            tensors = [cache.key, cache.value]
            if cache.kv_dtype == "int8":
                assert cache.k_scale is not None and cache.v_scale is not None
                tensors += [cache.k_scale, cache.v_scale]
            for t in tensors:
                raw = _as_bytes(t)
                raw[d] = raw[s]

    # -- attention ----------------------------------------------------------------------------

    def prefill(
        self,
        query: torch.Tensor,
        cache: LayerKVCache,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Causal attention of each sequence's chunk over its cached prefix plus the chunk."""
        out = torch.empty_like(query)
        starts = query_start_loc.tolist()
        lens = seq_lens.tolist()
        bs = cache.block_size
        for i, ctx in enumerate(lens):
            q0, q1 = starts[i], starts[i + 1]
            n = q1 - q0
            if n == 0:
                continue
            blocks = block_tables[i, : math.ceil(ctx / bs)].to(cache.key.device, torch.long)
            k = _gather(cache, blocks, key=True).flatten(0, 1)[:ctx]  # [ctx, Hkv, D] fp32
            v = _gather(cache, blocks, key=False).flatten(0, 1)[:ctx]
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            first_pos = ctx - n
            for t0 in range(0, n, _PREFILL_TILE):
                t1 = min(n, t0 + _PREFILL_TILE)
                q = query[q0 + t0 : q0 + t1].float().transpose(0, 1).unsqueeze(0)
                hi = first_pos + t1  # keys past the tile's last query are never visible
                lo = 0
                if sliding_window is not None:
                    lo = max(0, first_pos + t0 - sliding_window + 1)
                q_pos = torch.arange(first_pos + t0, first_pos + t1, device=q.device)
                k_pos = torch.arange(lo, hi, device=q.device)
                mask = k_pos[None, :] <= q_pos[:, None]
                if sliding_window is not None:
                    mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
                o = F.scaled_dot_product_attention(
                    q,
                    k[:, :, lo:hi],
                    v[:, :, lo:hi],
                    attn_mask=mask,
                    scale=scale,
                    enable_gqa=True,
                )
                out[q0 + t0 : q0 + t1] = o[0].transpose(0, 1).to(out.dtype)
        return out

    def decode(
        self,
        query: torch.Tensor,
        cache: LayerKVCache,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """One query per sequence over its paged context, chunk by chunk (see module doc)."""
        num_seqs, num_heads, head_dim = query.shape
        if num_seqs == 0:
            return torch.empty_like(query)
        device = cache.key.device
        bs, kv_heads = cache.block_size, cache.num_kv_heads
        lens_t = seq_lens.to(device=device, dtype=torch.long)
        order = torch.argsort(lens_t, descending=True, stable=True)
        lens = lens_t[order].tolist()
        tables = block_tables.to(device=device, dtype=torch.long).index_select(0, order)
        q = query.index_select(0, order).float().unsqueeze(2)  # [B, H, 1, D]
        out = torch.zeros(num_seqs, num_heads, head_dim, dtype=torch.float32, device=device)
        lse = torch.full((num_seqs, num_heads), _NEG_INF, dtype=torch.float32, device=device)
        window = sliding_window or 0
        lo_pos = [max(0, n - window) if window else 0 for n in lens]
        per_token = num_seqs * kv_heads * head_dim * 4 * 2
        chunk_blocks = max(1, _CHUNK_BYTES // max(1, per_token * bs))
        first_block = min(lo_pos) // bs
        last_block = math.ceil(lens[0] / bs)
        for b0 in range(first_block, last_block, chunk_blocks):
            b1 = min(last_block, b0 + chunk_blocks)
            c0, c1 = b0 * bs, b1 * bs
            # lens are sorted descending: rows reaching past c0 are a prefix, rows whose window
            # starts before c1 a suffix, so the active rows are one contiguous range.
            r1 = _count_true(lens, lambda n: n > c0)
            r0 = _count_true(lo_pos[:r1], lambda lo: lo >= c1)
            if r0 >= r1:
                continue
            rows = slice(r0, r1)
            blocks = tables[rows, b0:b1].reshape(-1)
            n_rows, n_tok = r1 - r0, (b1 - b0) * bs
            k = _gather(cache, blocks, key=True).view(n_rows, n_tok, kv_heads, head_dim)
            v = _gather(cache, blocks, key=False).view(n_rows, n_tok, kv_heads, head_dim)
            mask = None
            if any(n < c1 for n in lens[r0:r1]) or any(lo > c0 for lo in lo_pos[r0:r1]):
                pos = torch.arange(c0, c1, device=device)
                row_lens = torch.tensor(lens[r0:r1], device=device)
                row_lo = torch.tensor(lo_pos[r0:r1], device=device)
                valid = (pos[None, :] < row_lens[:, None]) & (pos[None, :] >= row_lo[:, None])
                mask = torch.zeros(n_rows, 1, 1, n_tok, device=device)
                mask.masked_fill_(~valid[:, None, None, :], _NEG_INF)
            o_c, lse_c = self._attend(q[rows], k.transpose(1, 2), v.transpose(1, 2), mask, scale)
            new_lse = torch.logaddexp(lse[rows], lse_c)
            w_old = torch.exp(lse[rows] - new_lse).unsqueeze(-1)
            w_new = torch.exp(lse_c - new_lse).unsqueeze(-1)
            out[rows] = out[rows] * w_old + o_c * w_new
            lse[rows] = new_lse
        result = torch.empty_like(out)
        result[order] = out
        return result.to(query.dtype)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of `q` `[B, H, 1, D]` over `k`/`v` `[B, Hkv, N, D]` (fp32): (out `[B, H, D]`,
        lse `[B, H]`); every row has at least one unmasked key."""
        if self._fused is not None:
            o, lse = self._fused(q, k, v, attn_mask=mask, scale=scale)
            return o[:, :, 0], lse[:, :, 0]
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        s = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, H, 1, N]
        if mask is not None:
            s = s + mask
        lse = torch.logsumexp(s, dim=-1)
        o = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v)
        return o[:, :, 0], lse[:, :, 0]


def _count_true(values: list[int], pred: Any) -> int:
    """Length of the prefix of `values` where `pred` holds (values are monotone)."""
    n = 0
    for x in values:
        if not pred(x):
            break
        n += 1
    return n


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors lack most CPU indexing kernels; moving their bytes as uint8 is exact."""
    return t.view(torch.uint8) if t.dtype == quant.FP8_DTYPE else t


def _gather(cache: LayerKVCache, blocks: torch.Tensor, key: bool) -> torch.Tensor:
    """Pages `blocks` of K (or V) as fp32 `[len(blocks), block_size, Hkv, D]`, dequantized."""
    stored = cache.key if key else cache.value
    scale = cache.k_scale if key else cache.v_scale
    pages = _as_bytes(stored).index_select(0, blocks)
    if stored.dtype == quant.FP8_DTYPE:
        pages = pages.view(quant.FP8_DTYPE)
    if cache.kv_dtype == "int8":
        assert scale is not None
        return quant.dequantize(pages, "int8", scale.index_select(0, blocks))
    if cache.kv_dtype == "fp8":
        return quant.dequantize(pages, "fp8", scale)
    return pages if pages.dtype == torch.float32 else pages.float()
