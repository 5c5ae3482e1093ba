"""One model under one KV setting: prefill, teacher-forced decode and greedy decode of a single
sequence through the engine's own model and attention backend, over a paged cache of the
setting's dtype (block i holds positions 16i..16i+15), so every logit is what a serving engine
with that `--kv-cache-dtype` would compute."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from headroom.engine.attention import AttentionBackend, KVDtype, allocate_layer_cache
from headroom.engine.attention.base import LayerKVCache
from headroom.engine.attention.kv_scales import KVScales, apply_scales
from headroom.engine.model import build_forward_batch
from headroom.engine.model.llama import LlamaForCausalLM

BLOCK = 16
# Prefill in chunks of this many tokens: bounds the MLP activations of long contexts.
PREFILL_CHUNK = 2048


@dataclass(frozen=True, slots=True)
class KVSetting:
    """A named KV configuration: the dtype and, for fp8, static per-head scales (None: 1.0)."""

    name: str
    kv_dtype: KVDtype
    scales: KVScales | None = None


class Session:
    """Runs `model` with the KV cache of `setting` through `backend`."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        setting: KVSetting,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.setting = setting
        self.device = device
        self.dtype = next(model.parameters()).dtype

    def _caches(self, num_tokens: int) -> list[LayerKVCache]:
        cfg = self.model.config
        blocks = -(-num_tokens // BLOCK)
        caches = [
            allocate_layer_cache(
                blocks,
                BLOCK,
                cfg.num_kv_heads,
                cfg.head_dim,
                self.dtype,
                self.setting.kv_dtype,
                self.device,
            )
            for _ in range(cfg.num_layers)
        ]
        if self.setting.scales is not None:
            apply_scales(caches, self.setting.scales)
        return caches

    @torch.inference_mode()
    def _prefill(self, caches: list[LayerKVCache], tokens: Sequence[int]) -> torch.Tensor:
        """Write `tokens` at positions 0.. and return the logits after the last one."""
        table = list(range(caches[0].num_blocks))
        hidden = None
        for c0 in range(0, len(tokens), PREFILL_CHUNK):
            chunk = list(tokens[c0 : c0 + PREFILL_CHUNK])
            slots = list(range(c0, c0 + len(chunk)))
            batch = build_forward_batch([(chunk, c0, slots, table)], [], self.device)
            hidden = self.model(batch, caches, self.backend)
        assert hidden is not None, "prefill needs at least one token"
        return self.model.compute_logits(hidden[-1:])[0]

    @torch.inference_mode()
    def _decode(self, caches: list[LayerKVCache], token: int, pos: int) -> torch.Tensor:
        table = list(range(caches[0].num_blocks))
        batch = build_forward_batch([], [(token, pos, pos, table)], self.device)
        return self.model.compute_logits(self.model(batch, caches, self.backend))[0]

    def next_token_logits(self, tokens: Sequence[int], context: int) -> torch.Tensor:
        """fp32 logits `[len(tokens) - context, vocab]` (on the CPU): row i predicts
        `tokens[context + i]` after a prefill of `tokens[:context]` and teacher-forced
        decodes of the tokens in between."""
        caches = self._caches(len(tokens))
        rows = [self._prefill(caches, tokens[:context])]
        for pos in range(context, len(tokens) - 1):
            rows.append(self._decode(caches, tokens[pos], pos))
        return torch.stack(rows).float().cpu()

    def greedy(self, tokens: Sequence[int], n: int) -> list[int]:
        """`n` greedy tokens after `tokens`."""
        caches = self._caches(len(tokens) + n)
        out = [int(self._prefill(caches, tokens).argmax())]
        for pos in range(len(tokens), len(tokens) + n - 1):
            out.append(int(self._decode(caches, out[-1], pos).argmax()))
        return out
