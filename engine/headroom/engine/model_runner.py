"""Runs the model on a scheduler step: owns the per-layer paged KV caches and the backend."""

from __future__ import annotations

import torch

from headroom.engine.attention.base import (
    AttentionBackend,
    KVDtype,
    LayerKVCache,
    allocate_layer_cache,
)
from headroom.engine.block_table import slot_mapping
from headroom.engine.model.batch import ForwardBatch, build_forward_batch
from headroom.engine.model.llama import LlamaForCausalLM
from headroom.engine.scheduled import ScheduledSeq, SchedulerOutput


class ModelRunner:
    """Turns a `SchedulerOutput` into one forward pass and the logits rows to sample from."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        kv_dtype: KVDtype = "auto",
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = torch.device(device)
        cfg = model.config
        dtype = next(model.parameters()).dtype
        self.caches: list[LayerKVCache] = [
            allocate_layer_cache(
                num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, kv_dtype, device
            )
            for _ in range(cfg.num_layers)
        ]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Apply copy-on-write `(src, dst)` pairs to every layer before a step."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=self.device)
        self.backend.copy_blocks(self.caches, src, dst)

    def build_batch(self, output: SchedulerOutput) -> tuple[ForwardBatch, list[int]]:
        """The forward batch of a step and, per sampling entry in `output.scheduled` order,
        the token row whose logits it samples from."""
        bs = self.block_size
        prefills = []
        decodes = []
        rows: list[int] = []
        row = 0
        for e in output.prefills:
            prefills.append(
                (
                    e.seq.all_token_ids[e.start : e.end],
                    e.start,
                    slot_mapping(e.seq.block_table, e.start, e.num_new_tokens, bs),
                    e.seq.block_table,
                )
            )
            row += e.num_new_tokens
            if e.sample:
                rows.append(row - 1)
        for e in output.decodes:
            decodes.append(
                (
                    e.seq.all_token_ids[e.start],
                    e.start,
                    slot_mapping(e.seq.block_table, e.start, 1, bs)[0],
                    e.seq.block_table,
                )
            )
            rows.append(row)
            row += 1
        return build_forward_batch(prefills, decodes, self.device), rows

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """Run a step: fp32 logits `[rows, vocab]` and the sampling entries they belong to."""
        batch, rows = self.build_batch(output)
        entries = [e for e in output.prefills if e.sample] + list(output.decodes)
        hidden = self.model(batch, self.caches, self.backend)
        if not rows:
            return torch.empty(0, self.model.config.vocab_size), entries
        index = torch.tensor(rows, dtype=torch.int64, device=hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        return logits.cpu(), entries
