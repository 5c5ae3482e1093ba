"""The torch attention backend: paged attention in plain torch ops, the CPU path and reference.

Decode is two passes over the block tables in chunks of a few blocks, with sequences sorted by
context length so the sequences still active in a chunk are one contiguous range:
1. gather the chunk's K pages for those sequences with one `index_select` into a reused
   buffer that stays in cache, and write q.K scores per KV head with a batched matmul (the
   query heads of one KV head form the matmul's rows, so GQA reads each K once);
2. softmax over the whole context at once (fp32), then gather V chunk by chunk the same way
   and accumulate p.V.
Gathering a sequence's whole context into a dense copy first would move every K/V byte twice
more than dense attention reads it; the chunked gather moves it once, into cache.

Quantized K/V are dequantized to fp32 chunk by chunk, and every softmax and accumulation is in
fp32 whatever the model dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from headroom.engine import quant
from headroom.engine.attention.base import LayerKVCache

# Bytes of one gathered fp32 K (or V) chunk: small enough to stay in L2/L3, large enough that
# the per-chunk op overhead is amortised.
_CHUNK_BYTES = 2 * 1024 * 1024
# Bytes of the score matrix of one group of sequences; larger batches go in several groups.
_SCORE_BYTES = 64 * 1024 * 1024
# Query rows per prefill tile: bounds the score matrix if SDPA falls back to its math path.
_PREFILL_TILE = 512
_NEG_INF = float("-inf")


class TorchBackend:
    """Paged attention over `LayerKVCache` with torch ops; runs on any device torch supports."""

    name = "torch"
    supports_sliding_window = True

    def __init__(self) -> None:
        # Reused gather buffers: a fresh multi-MB tensor per chunk costs page faults that
        # would dominate decode time.
        self._workspace: dict[tuple[str, torch.dtype, str], torch.Tensor] = {}

    def _buffer(
        self, device: torch.device, dtype: torch.dtype, role: str, numel: int
    ) -> torch.Tensor:
        key = (str(device), dtype, role)
        buf = self._workspace.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._workspace[key] = buf
        return buf[:numel]

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
        """One query per sequence over its paged context (two chunked passes, see module doc)."""
        num_seqs, num_heads, head_dim = query.shape
        if num_seqs == 0:
            return torch.empty_like(query)
        device = cache.key.device
        lens_t = seq_lens.to(device=device, dtype=torch.long)
        order = torch.argsort(lens_t, descending=True, stable=True)
        lens = lens_t[order].tolist()
        window = sliding_window or 0
        lo_pos = [max(0, n - window) if window else 0 for n in lens]
        tables = block_tables.to(device=device, dtype=torch.long).index_select(0, order)
        kv_heads = cache.num_kv_heads
        groups = num_heads // kv_heads
        q = (query.index_select(0, order).float() * scale).view(
            num_seqs, kv_heads, groups, head_dim
        )
        out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float32, device=device)
        # Rows without context (sorted last) attend to nothing: zeros, as the CUDA kernel gives.
        live = _prefix_above(lens, 0)
        out[live:] = 0.0
        rows_per_group = max(1, _SCORE_BYTES // (num_heads * 4 * max(1, lens[0])))
        for g0 in range(0, live, rows_per_group):
            g1 = min(live, g0 + rows_per_group)
            out[g0:g1] = self._decode_group(
                q[g0:g1], cache, lens[g0:g1], lo_pos[g0:g1], tables[g0:g1]
            ).reshape(g1 - g0, num_heads, head_dim)
        result = torch.empty_like(out)
        result[order] = out
        return result.to(query.dtype)

    def _decode_group(
        self,
        q: torch.Tensor,
        cache: LayerKVCache,
        lens: list[int],
        lo_pos: list[int],
        tables: torch.Tensor,
    ) -> torch.Tensor:
        """Scaled queries `[R, Hkv, G, D]`, rows sorted by length (descending) -> outputs."""
        rows, kv_heads, groups, head_dim = q.shape
        device = q.device
        bs = cache.block_size
        per_token = rows * kv_heads * head_dim * 4
        chunk_blocks = max(1, _CHUNK_BYTES // (per_token * bs))
        first_block = min(lo_pos) // bs
        last_block = math.ceil(lens[0] / bs)
        chunk_blocks = min(chunk_blocks, last_block - first_block)
        c_tok = chunk_blocks * bs
        plan = []  # (chunk index, first block, last block, active rows r0..r1)
        for j, b0 in enumerate(range(first_block, last_block, chunk_blocks)):
            b1 = min(last_block, b0 + chunk_blocks)
            # Sorted descending: rows reaching past the chunk start are a prefix, rows whose
            # window starts before the chunk end a suffix; the active rows are one range.
            r1 = _prefix_above(lens, b0 * bs)
            r0 = _prefix_above(lo_pos[:r1], b1 * bs - 1)
            if r0 < r1:
                plan.append((j, b0, b1, r0, r1))
        n_chunks = math.ceil((last_block - first_block) / chunk_blocks)
        # [Hkv, chunk, row, G, C]: one contiguous [row, G, C] slab per (head, chunk) for bmm.
        scores = torch.full(
            (kv_heads, n_chunks, rows, groups, c_tok), _NEG_INF, dtype=torch.float32, device=device
        )
        q_heads = q.unbind(1)
        # chunk -> (its first row masked, [row, token] slots outside each row) for each run of
        # rows that does not see the whole chunk
        masks: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for j, b0, b1, r0, r1 in plan:
            n_tok = (b1 - b0) * bs
            k = self._gather_into(cache, tables[r0:r1, b0:b1].reshape(-1), True)
            k_heads = k.view(r1 - r0, n_tok, kv_heads, head_dim).unbind(2)
            for h in range(kv_heads):
                qk = (q_heads[h][r0:r1], k_heads[h].transpose(1, 2))
                if n_tok == c_tok:
                    torch.bmm(*qk, out=scores[h, j, r0:r1])
                else:  # the last, shorter chunk: its slab is not contiguous
                    scores[h, j, r0:r1, :, :n_tok] = torch.bmm(*qk)
            c0 = b0 * bs
            # Sorted by length, the rows whose window starts inside the chunk are a prefix and
            # those ending inside it a suffix. The rows between see all of it and are not
            # masked: a masked fill costs more per score than the matmul that wrote it.
            window_end = r0 + _prefix_above(lo_pos[r0:r1], c0)
            ends = max(window_end, r0 + _prefix_above(lens[r0:r1], c0 + n_tok - 1))
            for s0, s1 in ((r0, window_end), (ends, r1)):
                if s0 == s1:
                    continue
                pos = torch.arange(c0, c0 + n_tok, device=device)
                row_hi = torch.tensor(lens[s0:s1], device=device)
                row_lo = torch.tensor(lo_pos[s0:s1], device=device)
                invalid = (pos[None, :] >= row_hi[:, None]) | (pos[None, :] < row_lo[:, None])
                scores[:, j, s0:s1, :, :n_tok].masked_fill_(invalid[None, :, None, :], _NEG_INF)
                masks.setdefault(j, []).append((s0 - r0, invalid))
        peak = scores.amax(dim=(1, 4), keepdim=True)
        probs = scores.sub_(peak).exp_()
        denom = probs.sum(dim=(1, 4))  # [Hkv, R, G]
        acc = torch.zeros(kv_heads, rows, groups, head_dim, dtype=torch.float32, device=device)
        acc_heads = acc.unbind(0)
        for j, b0, b1, r0, r1 in plan:
            n_tok = (b1 - b0) * bs
            v = self._gather_into(cache, tables[r0:r1, b0:b1].reshape(-1), False)
            for s0, invalid in masks.get(j, ()):
                # A masked slot weighs 0, but 0 x a stale NaN or inf (a freed sequence's, or
                # block 0 padding a shorter table) is NaN: zero it, as the CUDA kernel skips it
                # (by index: a fill over the whole chunk cost ~1 ms a partial chunk).
                rows_v = v.view(r1 - r0, n_tok, kv_heads, head_dim)[s0 : s0 + len(invalid)]
                rows_v.view(-1, kv_heads, head_dim)[invalid.reshape(-1)] = 0.0
            v_heads = v.view(r1 - r0, n_tok, kv_heads, head_dim).unbind(2)
            for h in range(kv_heads):
                acc_heads[h][r0:r1].baddbmm_(probs[h, j, r0:r1, :, :n_tok], v_heads[h])
        acc.div_(denom.unsqueeze(-1))
        return acc.permute(1, 0, 2, 3)

    def _gather_into(self, cache: LayerKVCache, blocks: torch.Tensor, key: bool) -> torch.Tensor:
        """Pages `blocks` of K (or V) as fp32 `[len(blocks), block_size, Hkv, D]` in a reused
        workspace buffer, dequantized in place."""
        stored = cache.key if key else cache.value
        role = "k" if key else "v"
        shape = (blocks.numel(), *stored.shape[1:])
        numel = shape[0] * shape[1] * shape[2] * shape[3]
        device = stored.device
        out = self._buffer(device, torch.float32, role, numel).view(shape)
        if stored.dtype == torch.float32:
            torch.index_select(stored, 0, blocks, out=out)
            return out
        raw = _as_bytes(stored)
        pages = self._buffer(device, raw.dtype, role + "-raw", numel).view(shape)
        torch.index_select(raw, 0, blocks, out=pages)
        if stored.dtype == quant.FP8_DTYPE:
            pages = pages.view(quant.FP8_DTYPE)
        out.copy_(pages)
        scale = cache.k_scale if key else cache.v_scale
        if cache.kv_dtype == "int8":
            assert scale is not None
            out.mul_(scale.index_select(0, blocks).unsqueeze(-1))
        elif cache.kv_dtype == "fp8":
            assert scale is not None
            out.mul_(scale.unsqueeze(-1))
        return out


def _prefix_above(values: list[int], bound: int) -> int:
    """Length of the leading run of `values` (sorted descending) greater than `bound`."""
    n = 0
    for x in values:
        if x <= bound:
            break
        n += 1
    return n


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors lack most CPU indexing kernels; moving their bytes as uint8 is exact."""
    return t.view(torch.uint8) if t.dtype == quant.FP8_DTYPE else t


def _gather(cache: LayerKVCache, blocks: torch.Tensor, key: bool) -> torch.Tensor:
    """Pages `blocks` of K (or V) as a new fp32 `[len(blocks), block_size, Hkv, D]` tensor."""
    stored = cache.key if key else cache.value
    scale = cache.k_scale if key else cache.v_scale
    pages = _as_bytes(stored).index_select(0, blocks)
    if stored.dtype == quant.FP8_DTYPE:
        pages = pages.view(quant.FP8_DTYPE)
    if cache.kv_dtype == "int8":
        assert scale is not None
        return quant.dequantize(pages, "int8", scale.index_select(0, blocks))
    if cache.kv_dtype == "fp8":
        assert scale is not None
        return quant.dequantize(pages, "fp8", scale)
    return pages if pages.dtype == torch.float32 else pages.float()
