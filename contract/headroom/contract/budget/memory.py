"""KV-cache memory arithmetic: pure functions over a `ModelArch`.

bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element, plus the
scale overhead of quantized KV. Under tensor parallelism each rank holds `ceil(kv_heads / tp)`
heads (a head is replicated when tp > kv_heads); under pipeline parallelism each stage holds
`ceil(layers / pp)` layers. MLA caches `(kv_lora_rank + rope_dim)` per layer, replicated on
every TP rank; DeepSeek-V3.2 caches it as fp8_ds_mla (auto and fp8) or bf16, plus an indexer
key. Per-GPU figures are what bind: all GPUs of a pod hold the same tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

from headroom.contract.budget.arch import DTYPE_NAMES, ModelArch

# What one KV element is stored as, the figure the arithmetic runs on.
KVCacheDtype = Literal["bf16", "fp16", "fp8", "int8", "fp32"]
# What a deployment asks for (the engine's --kv-cache-dtype, the CRD's kvCacheDtype): `auto`
# keeps KV in the model's compute dtype, fp8 and int8 quantize it.
KVCacheSetting = Literal["auto", "fp8", "int8"]
KV_ELEMENT_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
# int8 keeps one fp32 scale per (token, kv head) for K and for V; fp8 keeps one static scale per
# (layer, kv head), a constant that does not grow with tokens (see attention/base.py for why).
INT8_SCALE_BYTES = 4
# DeepSeek-V3.2's fp8 caches keep one float32 scale per this many elements.
FP8_SCALE_GROUP = 128
SPARSE_MLA_INT8 = (
    "DeepSeek-V3.2 (index_topk: sparse attention) caches KV as fp8 (vLLM's fp8_ds_mla, what "
    "auto runs too) or bf16, not int8"
)

GIB = 2**30


def kv_cache_dtype(setting: str, compute_dtype: str) -> KVCacheDtype:
    """The element type KV is stored in: `auto` is the model's compute dtype (a torch name such
    as `torch.bfloat16` or a short one such as `bf16`), anything else is its own name."""
    name = compute_dtype if setting == "auto" else setting
    short = DTYPE_NAMES.get(name.removeprefix("torch."))
    if short is None or short == "int4":
        raise ValueError(f"KV cannot be stored as {name!r} (one of {', '.join(KV_ELEMENT_BYTES)})")
    return short


def kv_heads_per_rank(arch: ModelArch, tp: int = 1) -> int:
    """KV heads each tensor-parallel rank stores (never more than the model has)."""
    if tp < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {tp}")
    if arch.kv_lora_rank is not None:
        return 1  # one shared latent, replicated
    return max(1, math.ceil(arch.num_kv_heads / tp))


def tp_split_error(arch: ModelArch, tp: int, label: str = "tensor parallel size") -> str | None:
    """Why vLLM and SGLang would refuse to shard `arch` `tp` ways, or None: the attention heads
    must split evenly, and the KV heads either split or replicate evenly (MLA has one latent).
    `label` names the setting in the message (a flag or a spec field)."""
    if arch.num_attention_heads % tp:
        return (
            f"{label} {tp} does not divide {arch.name}'s {arch.num_attention_heads} attention "
            "heads (vLLM and SGLang refuse to start); pick a divisor"
        )
    kv = arch.num_kv_heads
    if arch.kv_lora_rank is None and kv % tp and tp % kv:
        return (
            f"{label} {tp} neither divides nor is a multiple of {arch.name}'s {kv} KV heads "
            "(vLLM and SGLang refuse to start)"
        )
    return None


def layers_per_stage(arch: ModelArch, pp: int = 1) -> int:
    """Layers on the most loaded pipeline stage."""
    if pp < 1:
        raise ValueError(f"pipeline parallel size must be >= 1, got {pp}")
    return math.ceil(arch.num_layers / pp)


def _sparse_mla_token_bytes(arch: ModelArch, kv_dtype: KVCacheDtype) -> int:
    """DeepSeek-V3.2's bytes per token per layer in vLLM: the MLA entry as fp8_ds_mla (fp8
    latent, a float32 scale per 128 of it, the rope key in bf16: 656 B for 512 + 64;
    kv_cache_interface.py, MLAAttentionSpec) or bf16, plus the indexer's fp8 key with its
    float32 scale per 128 (132 B for 128; deepseek_v2.py, DeepseekV32IndexerCache)."""
    assert arch.kv_lora_rank is not None and arch.qk_rope_head_dim is not None
    assert arch.indexer_head_dim is not None
    indexer = arch.indexer_head_dim + arch.indexer_head_dim // FP8_SCALE_GROUP * 4
    if kv_dtype == "fp8":
        latent = arch.kv_lora_rank + arch.kv_lora_rank // FP8_SCALE_GROUP * 4
        return latent + arch.qk_rope_head_dim * 2 + indexer
    if kv_dtype == "int8":
        raise ValueError(SPARSE_MLA_INT8)
    width = arch.kv_lora_rank + arch.qk_rope_head_dim
    return width * KV_ELEMENT_BYTES[kv_dtype] + indexer


def _per_layer_token_bytes(arch: ModelArch, kv_dtype: KVCacheDtype, tp: int) -> int:
    elem = KV_ELEMENT_BYTES[kv_dtype]
    if arch.indexer_head_dim is not None:
        return _sparse_mla_token_bytes(arch, kv_dtype)
    if arch.kv_lora_rank is not None:
        assert arch.qk_rope_head_dim is not None
        width = arch.kv_lora_rank + arch.qk_rope_head_dim
        scale = INT8_SCALE_BYTES if kv_dtype == "int8" else 0
        return width * elem + scale
    heads = kv_heads_per_rank(arch, tp)
    scale = 2 * heads * INT8_SCALE_BYTES if kv_dtype == "int8" else 0
    return 2 * heads * arch.head_dim * elem + scale


def kv_bytes_per_token(
    arch: ModelArch, kv_dtype: KVCacheDtype = "bf16", tp: int = 1, pp: int = 1
) -> int:
    """KV bytes one token occupies on one GPU (tp = pp = 1: the whole model's figure)."""
    return layers_per_stage(arch, pp) * _per_layer_token_bytes(arch, kv_dtype, tp)


def kv_bytes_per_block(
    arch: ModelArch, block_size: int, kv_dtype: KVCacheDtype = "bf16", tp: int = 1, pp: int = 1
) -> int:
    """Bytes of one paged block of `block_size` tokens on one GPU."""
    if block_size < 1:
        raise ValueError(f"block size must be >= 1, got {block_size}")
    return block_size * kv_bytes_per_token(arch, kv_dtype, tp, pp)


def sequence_kv_bytes(
    arch: ModelArch, context: int, kv_dtype: KVCacheDtype = "bf16", tp: int = 1, pp: int = 1
) -> int:
    """KV bytes of one sequence of `context` tokens on the busiest GPU, capping sliding-window
    layers at the window (what a window-aware engine must hold)."""
    per_layer = _per_layer_token_bytes(arch, kv_dtype, tp)
    layers = layers_per_stage(arch, pp)
    windowed = arch.num_sliding_window_layers if arch.sliding_window else 0
    # Which layers a stage gets is not recorded (Gemma 2 windows every other one, Qwen2 its
    # top ones), so the busiest stage holds as many full-attention layers as there are.
    full = min(layers, arch.num_layers - windowed)
    window = min(context, arch.sliding_window or context)
    return per_layer * (full * context + (layers - full) * window)


def weights_bytes(arch: ModelArch) -> int:
    """Bytes of all weights at the model's weight dtype."""
    return int(arch.num_parameters * arch.weight_bytes_per_param)


def weights_bytes_per_gpu(arch: ModelArch, tp: int = 1, pp: int = 1) -> int:
    """Weights on one GPU: tensor- and pipeline-parallel sharding split them evenly
    (norms are replicated but negligible)."""
    return math.ceil(weights_bytes(arch) / (tp * pp))


def activation_reserve_bytes(
    arch: ModelArch, tp: int = 1, max_num_batched_tokens: int = 8192
) -> int:
    """Per-GPU memory kept out of the KV pool for activations, CUDA context and graphs:
    1 GiB fixed plus four live bf16 buffers of a full prefill step's hidden and MLP width."""
    width = arch.hidden_size + (arch.intermediate_size or 4 * arch.hidden_size) // tp
    return GIB + max_num_batched_tokens * width * 2 * 4


def usable_kv_bytes_per_gpu(
    gpu_memory_bytes: int,
    weights_per_gpu: int,
    reserve_bytes: int,
    gpu_memory_utilization: float = 0.9,
) -> int:
    """What is left for KV on one GPU; negative when weights and reserve do not fit."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    return int(gpu_memory_bytes * gpu_memory_utilization) - weights_per_gpu - reserve_bytes


def blocks_for_tokens(tokens: int, block_size: int) -> int:
    """Blocks a sequence of `tokens` occupies in a paged cache."""
    return -(-tokens // block_size)


def max_concurrent_sequences(
    kv_blocks: int, context: int, block_size: int, prefix_hit_ratio: float = 0.0
) -> int:
    """Sequences of `context` tokens that fit in `kv_blocks`; a shared prefix of
    `prefix_hit_ratio x context` tokens (whole blocks only) is stored once for all of them."""
    if not 0 <= prefix_hit_ratio < 1:
        raise ValueError(f"prefix hit ratio must be in [0, 1), got {prefix_hit_ratio}")
    shared = int(context * prefix_hit_ratio) // block_size
    per_seq = blocks_for_tokens(context, block_size) - shared
    free = kv_blocks - shared
    return max(0, free // per_seq) if free > 0 else 0


def replicas_needed(peak_concurrency: int, sequences_per_pod: int) -> int:
    """Pods needed so that replicas x per-pod concurrency covers the peak."""
    if sequences_per_pod <= 0:
        raise ValueError("a pod that holds no sequence cannot serve any concurrency")
    return max(1, -(-peak_concurrency // sequences_per_pod))


def reservation_waste(
    lengths: Iterable[int], max_model_len: int, block_size: int
) -> tuple[float, float]:
    """(contiguous, paged) fraction of reserved KV left unused for these sequence lengths:
    contiguous reserves `max_model_len` per sequence, paged rounds each up to a block."""
    used = contiguous = paged = 0
    for n in lengths:
        if not 0 < n <= max_model_len:
            raise ValueError(f"sequence length {n} outside (0, {max_model_len}]")
        used += n
        contiguous += max_model_len
        paged += blocks_for_tokens(n, block_size) * block_size
    if not used:
        return 0.0, 0.0
    return 1 - used / contiguous, 1 - used / paged
