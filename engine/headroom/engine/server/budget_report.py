"""The startup budget: what the weights take, how big the KV pool is in blocks and tokens, and
how many max-length sequences fit, as one readable line (that one fits at all, `Engine.from_config`
makes sure). Pure arithmetic over `headroom.contract.budget`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from headroom.contract.budget import (
    KVCacheDtype,
    ModelArch,
    blocks_for_tokens,
    kv_bytes_per_block,
    kv_bytes_per_token,
)

MIB = 2**20


def _mib(n: float) -> str:
    return f"{n / MIB:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


@dataclass(frozen=True, slots=True)
class BudgetReport:
    """The figures behind the startup line."""

    model: str
    arch: ModelArch
    weights_bytes: int
    weights_dtype: str
    kv_dtype: KVCacheDtype
    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int | None = None

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.arch, self.kv_dtype)

    @property
    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.arch, self.block_size, self.kv_dtype)

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def blocks_per_max_len_seq(self) -> int:
        return blocks_for_tokens(self.max_model_len, self.block_size)

    @property
    def max_concurrency(self) -> int:
        """Sequences of max_model_len tokens the pool holds at once (no prefix sharing)."""
        return self.num_blocks // self.blocks_per_max_len_seq

    def line(self) -> str:
        cap = ""
        if self.max_num_seqs is not None and self.max_num_seqs < self.max_concurrency:
            cap = f" (scheduler caps at max_num_seqs {self.max_num_seqs})"
        return (
            f"budget: model {self.model} | weights {_mib(self.weights_bytes)} "
            f"({self.weights_dtype}) | KV {self.bytes_per_token:,} B/token ({self.kv_dtype}) | "
            f"pool {self.num_blocks:,} blocks x {self.block_size} = {self.pool_tokens:,} tokens "
            f"({_mib(self.pool_bytes)}) | max concurrency at max_model_len "
            f"{self.max_model_len:,}: {self.max_concurrency:,} sequences{cap}"
        )


def budget_report(engine: Any) -> BudgetReport:
    """The startup figures of a built (sync) `Engine`: pool as allocated, weights as loaded."""
    loaded, cfg = engine.loaded, engine.config
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    return BudgetReport(
        model=str(loaded.name),
        arch=loaded.config,
        weights_bytes=weights,
        weights_dtype=str(loaded.dtype).removeprefix("torch."),
        kv_dtype=engine.kv_dtype,
        block_size=cfg.block_size,
        num_blocks=engine.scheduler.num_blocks,
        max_model_len=engine.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
    )
