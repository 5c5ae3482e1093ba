"""`EngineConfig`: the one config of an engine (CLI flags and the server map onto it; the
scheduler reads its pool and batching limits from it once the engine resolved the pool size)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from headroom.contract.admission import DEFAULT_WATERMARK
from headroom.contract.budget import KVCacheSetting

# The CPU pool size when neither num_blocks nor kv_cache_memory_bytes is given.
DEFAULT_CPU_KV_BYTES = 256 * 1024 * 1024


class EngineConfig(BaseModel):
    """Model, device, KV pool and batching limits of one engine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(default="tiny", description='"tiny" or a local Hugging Face directory')
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = Field(default="cpu", description='"cpu", "cuda", "cuda:N" or "auto"')
    block_size: int = Field(default=16, ge=1, le=1024, description="tokens per KV block")
    num_blocks: int | None = Field(default=None, ge=1, description="KV blocks in the pool")
    kv_cache_memory_bytes: int | None = Field(
        default=None, ge=1, description="KV pool size in bytes (blocks = bytes // block bytes)"
    )
    max_model_len: int | None = Field(
        default=None, ge=1, description="longest prompt + output; default: the model's limit"
    )
    max_num_seqs: int = Field(default=256, ge=1, description="sequences per step")
    max_num_batched_tokens: int = Field(
        default=2048, ge=1, description="tokens per step; longer prompts prefill in chunks"
    )
    enable_prefix_caching: bool = True
    kv_cache_dtype: KVCacheSetting = "auto"
    attention_backend: Literal["auto", "torch", "cuda"] = "auto"
    seed: int = Field(default=0, description="seeds requests that bring no seed of their own")
    # The fraction of blocks kept free at admission for running decodes (see the contract).
    watermark: float = Field(default=DEFAULT_WATERMARK, ge=0.0, lt=1.0)
    num_threads: int | None = Field(
        default=None,
        ge=1,
        description="torch CPU threads (process-wide); None keeps torch's default. One thread "
        "is fastest for small models on a busy host: idle OpenMP workers spin.",
    )

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.num_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("give num_blocks or kv_cache_memory_bytes, not both")
        if re.fullmatch(r"cpu|auto|cuda(:[0-9]+)?", self.device) is None:
            raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {self.device!r}")
        return self

    def sized(self, num_blocks: int, max_model_len: int) -> EngineConfig:
        """This config with the pool size and length limit the engine resolved."""
        values = {**self.model_dump(), "num_blocks": num_blocks, "max_model_len": max_model_len}
        return EngineConfig.model_validate({**values, "kv_cache_memory_bytes": None})
