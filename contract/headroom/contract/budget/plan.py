"""Sizing a deployment: from a model, a GPU and peak traffic to pods, with a verdict."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from headroom.contract.budget.arch import ModelArch
from headroom.contract.budget.memory import (
    GIB,
    SPARSE_MLA_INT8,
    KVCacheDtype,
    KVCacheSetting,
    activation_reserve_bytes,
    blocks_for_tokens,
    kv_bytes_per_block,
    kv_bytes_per_token,
    kv_cache_dtype,
    max_concurrent_sequences,
    replicas_needed,
    usable_kv_bytes_per_gpu,
    weights_bytes,
    weights_bytes_per_gpu,
)

Binding = Literal["kv-cache", "max-num-seqs", "weights", "context"]


class PlanInput(BaseModel):
    """Everything the arithmetic needs; validated so a bad number names its field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelArch
    gpu_name: str = "custom"
    gpu_memory_bytes: int = Field(gt=0)
    tp: int = Field(default=1, ge=1, le=64)
    gpus_per_pod: int | None = Field(default=None, ge=1, le=64)
    # The CRD's traffic bounds, so `headroom plan` sizes nothing the operator would refuse.
    concurrency: int = Field(ge=1, le=10_000_000, description="peak concurrent sequences")
    context: int = Field(
        ge=1, le=10_000_000, description="tokens per sequence (prompt + output, p95)"
    )
    kv_dtype: KVCacheSetting | KVCacheDtype = "auto"
    prefix_hit: float = Field(default=0.0, ge=0.0, lt=1.0)
    block_size: int = Field(default=16, ge=1, le=1024)
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(default=8192, ge=1)
    activation_reserve_bytes: int | None = Field(default=None, ge=0)
    # Blocks of the pool no sequence can hold: vLLM's BlockPool takes one as its null block.
    reserved_blocks: int = Field(default=0, ge=0, le=1024)

    @model_validator(mode="after")
    def _check(self) -> PlanInput:
        if self.pod_gpus % self.tp:
            raise ValueError(f"tp {self.tp} does not divide gpus_per_pod {self.pod_gpus}")
        if self.model.indexer_head_dim is not None and self.kv_dtype == "int8":
            raise ValueError(SPARSE_MLA_INT8)
        return self

    @property
    def pod_gpus(self) -> int:
        return self.gpus_per_pod or self.tp

    @property
    def pp(self) -> int:
        return self.pod_gpus // self.tp

    @property
    def resolved_kv_dtype(self) -> KVCacheDtype:
        if self.model.indexer_head_dim is not None and self.kv_dtype == "auto":
            return "fp8"  # vLLM runs DeepSeek-V3.2's auto as fp8_ds_mla (models/config.py)
        # A serving runtime computes in bf16 (fp16 for fp16 checkpoints) whatever the weights.
        return kv_cache_dtype(
            self.kv_dtype, "fp16" if self.model.weight_dtype == "fp16" else "bf16"
        )


class Alternative(BaseModel):
    """What one change to the KV policy would buy."""

    change: str
    sequences_per_pod: int
    replicas: int | None


class Plan(BaseModel):
    """The verdict and every figure behind it (bytes unless named otherwise)."""

    feasible: bool
    reason: str | None = None
    binding: Binding
    model: str
    gpu: str
    tp: int
    pp: int
    gpus_per_pod: int
    kv_dtype: str
    block_size: int
    weights_bytes: int
    weights_bytes_per_gpu: int
    activation_reserve_bytes_per_gpu: int
    kv_bytes_per_token: int = Field(description="whole model, one token")
    kv_bytes_per_token_per_gpu: int
    kv_bytes_for_peak: int = Field(description="peak concurrency x context, whole model")
    kv_bytes_per_gpu: int = Field(description="KV pool on each GPU")
    kv_blocks_per_pod: int
    kv_tokens_per_pod: int
    sequences_per_pod: int
    replicas: int | None
    gpus_total: int | None
    concurrency: int
    context: int
    prefix_hit: float
    alternatives: list[Alternative] = []


def _reserve(inp: PlanInput) -> int:
    """Per-GPU activation reserve: the input's override, else the model's estimate."""
    if inp.activation_reserve_bytes is not None:
        return inp.activation_reserve_bytes
    return activation_reserve_bytes(inp.model, inp.tp, inp.max_num_batched_tokens)


def _capacity(inp: PlanInput, kv_dtype: KVCacheDtype, prefix_hit: float) -> tuple[int, int, int]:
    """(usable KV bytes per GPU, blocks per pod, sequences per pod before the max_num_seqs cap)."""
    arch = inp.model
    usable = usable_kv_bytes_per_gpu(
        inp.gpu_memory_bytes,
        weights_bytes_per_gpu(arch, inp.tp, inp.pp),
        _reserve(inp),
        inp.gpu_memory_utilization,
    )
    block = kv_bytes_per_block(arch, inp.block_size, kv_dtype, inp.tp, inp.pp)
    blocks = max(0, usable) // block
    free = max(0, blocks - inp.reserved_blocks)
    return usable, blocks, max_concurrent_sequences(free, inp.context, inp.block_size, prefix_hit)


def plan(inp: PlanInput) -> Plan:
    """Size a deployment; an infeasible input yields `feasible=False` with the reason."""
    arch = inp.model
    kv_dtype = inp.resolved_kv_dtype
    reserve = _reserve(inp)
    usable, blocks, seqs = _capacity(inp, kv_dtype, inp.prefix_hit)
    per_token = kv_bytes_per_token(arch, kv_dtype)
    per_token_gpu = kv_bytes_per_token(arch, kv_dtype, inp.tp, inp.pp)
    w_gpu = weights_bytes_per_gpu(arch, inp.tp, inp.pp)
    capped = min(seqs, inp.max_num_seqs)
    binding: Binding = "max-num-seqs" if seqs > inp.max_num_seqs else "kv-cache"
    reason: str | None = None
    budget = inp.gpu_memory_bytes * inp.gpu_memory_utilization
    if inp.context > arch.max_position_embeddings:
        binding = "context"
        reason = (
            f"context {inp.context} tokens exceeds {arch.name}'s max_position_embeddings "
            f"{arch.max_position_embeddings}"
        )
    elif usable <= 0:
        binding = "weights"
        reason = (
            f"weights {w_gpu / GIB:.1f} GiB/GPU + reserve {reserve / GIB:.1f} GiB exceed "
            f"{inp.gpu_memory_utilization:.0%} of {inp.gpu_memory_bytes / GIB:.1f} GiB "
            f"({budget / GIB:.1f} GiB); use more GPUs per pod (tp) or a smaller weight dtype"
        )
    elif capped == 0:
        need = blocks_for_tokens(inp.context, inp.block_size) * inp.block_size * per_token_gpu
        reason = (
            f"one {inp.context}-token sequence needs {need / GIB:.2f} GiB of KV per GPU but only "
            f"{usable / GIB:.2f} GiB is left after weights {w_gpu / GIB:.1f} GiB and reserve "
            f"{reserve / GIB:.1f} GiB"
        )
        if inp.reserved_blocks:
            reason += f" ({blocks:,} blocks, {inp.reserved_blocks} of them the engine's own)"
    feasible = reason is None
    replicas = replicas_needed(inp.concurrency, capped) if feasible else None

    alternatives: list[Alternative] = []
    if feasible:
        options: list[tuple[str, KVCacheDtype, float]] = []
        if kv_dtype not in ("fp8", "int8"):
            options.append(("fp8 KV", "fp8", inp.prefix_hit))
        if inp.prefix_hit == 0:
            options.append(("prefix hit 50%", kv_dtype, 0.5))
        for change, dtype, hit in options:
            _, _, alt = _capacity(inp, dtype, hit)
            alt = min(alt, inp.max_num_seqs)
            alternatives.append(
                Alternative(
                    change=change,
                    sequences_per_pod=alt,
                    replicas=replicas_needed(inp.concurrency, alt) if alt else None,
                )
            )
    return Plan(
        feasible=feasible,
        reason=reason,
        binding=binding,
        model=arch.name,
        gpu=inp.gpu_name,
        tp=inp.tp,
        pp=inp.pp,
        gpus_per_pod=inp.pod_gpus,
        kv_dtype=kv_dtype,
        block_size=inp.block_size,
        weights_bytes=weights_bytes(arch),
        weights_bytes_per_gpu=w_gpu,
        activation_reserve_bytes_per_gpu=reserve,
        kv_bytes_per_token=per_token,
        kv_bytes_per_token_per_gpu=per_token_gpu,
        kv_bytes_for_peak=inp.concurrency * inp.context * per_token,
        kv_bytes_per_gpu=max(0, usable),
        kv_blocks_per_pod=blocks,
        kv_tokens_per_pod=blocks * inp.block_size,
        sequences_per_pod=capped,
        replicas=replicas,
        gpus_total=replicas * inp.pod_gpus if replicas else None,
        concurrency=inp.concurrency,
        context=inp.context,
        prefix_hit=inp.prefix_hit,
        alternatives=alternatives,
    )
