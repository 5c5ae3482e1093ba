"""`EngineConfig`: everything needed to build an engine (CLI flags and the server map onto it)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from headroom.engine.attention.base import KVDtype

# The CPU pool size when neither num_blocks nor kv_cache_memory_bytes is given.
DEFAULT_CPU_KV_BYTES = 256 * 1024 * 1024


class EngineConfig(BaseModel):
    """Model, device, KV pool and batching limits of one engine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(default="tiny", description='"tiny" or a local Hugging Face directory')
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = Field(default="cpu", description='"cpu", "cuda", "cuda:N" or "auto"')
    block_size: int = Field(default=16, ge=1, le=1024)
    num_blocks: int | None = Field(default=None, ge=1, description="KV blocks in the pool")
    kv_cache_memory_bytes: int | None = Field(
        default=None, ge=1, description="KV pool size in bytes (blocks = bytes // block bytes)"
    )
    max_model_len: int | None = Field(
        default=None, ge=1, description="longest prompt + output; default: the model's limit"
    )
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    enable_prefix_caching: bool = True
    kv_cache_dtype: KVDtype = "auto"
    attention_backend: Literal["auto", "torch", "cuda"] = "auto"
    seed: int = Field(default=0, description="seeds requests that bring no seed of their own")
    # 5 % free at admission: 0.01 recomputed 18.7 % of tokens under preemption in bench/kv_waste.py
    watermark: float = Field(default=0.05, ge=0.0, lt=1.0)
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
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {self.device!r}")
        return self
