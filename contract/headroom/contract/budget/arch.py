"""The model architecture record the KV arithmetic runs on."""

from __future__ import annotations

import math
from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# ConfigFieldError: re-exported, as it was defined here.
from headroom.contract.budget.windows import ConfigFieldError as ConfigFieldError
from headroom.contract.budget.windows import config_number as _number
from headroom.contract.budget.windows import model_family, sliding_windows
from headroom.contract.jsonfile import fields_line, read_json_object

WeightDtype = Literal["fp32", "bf16", "fp16", "fp8", "int8", "int4"]
WEIGHT_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
}
# The one table from torch / Hugging Face dtype names (and the short names) to the short names.
DTYPE_NAMES: dict[str, WeightDtype] = {
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "fp32": "fp32",
    "bf16": "bf16",
    "fp16": "fp16",
    "fp8": "fp8",
    "int8": "int8",
    "int4": "int4",
}
MAX_PARAMETERS = 10**15  # a thousand times the largest model published
MAX_LAYERS = 1024
MAX_POSITIONS = 100_000_000
# What a serving runtime holds a float32 checkpoint's weights in. vLLM's `--dtype auto` does
# "Downcast for float32 models" (vllm/config/model.py, `_resolve_auto_dtype`) to the platform's
# preferred dtype: bf16 on CUDA from compute capability 8.0, fp16 before it and for pooling
# models; 2 bytes a weight either way, and the 16-bit KV plan.py prices goes with it.
FP32_SERVED_AS: WeightDtype = "bf16"


class AttentionKind(StrEnum):
    MHA = "MHA"
    GQA = "GQA"
    MQA = "MQA"
    MLA = "MLA"


class ModelArch(BaseModel):
    """Architecture numbers as published in a model's config.json."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # The bounds are the CRD's (an architecture it would refuse is refused here too), and keep
    # every product of them within a float: a config.json can say anything.
    name: str
    num_layers: int = Field(ge=1, le=MAX_LAYERS)
    num_attention_heads: int = Field(ge=1, le=4096)
    num_kv_heads: int = Field(ge=1, le=4096)
    head_dim: int = Field(ge=1, le=4096)
    hidden_size: int = Field(ge=1, le=1_000_000)
    intermediate_size: int | None = Field(default=None, ge=1, le=10_000_000)
    vocab_size: int = Field(ge=1, le=100_000_000)
    # The longest sequence it serves: vLLM's derived max_model_len (`context_length`).
    max_position_embeddings: int = Field(ge=1, le=MAX_POSITIONS)
    num_parameters: int = Field(
        ge=1, le=MAX_PARAMETERS, description="total parameters (all experts for MoE)"
    )
    weight_dtype: WeightDtype = "bf16"
    # MLA (DeepSeek-V2/V3) caches one compressed latent plus a shared rope key per layer.
    kv_lora_rank: int | None = Field(default=None, ge=1, le=65536)
    qk_rope_head_dim: int | None = Field(default=None, ge=1, le=4096)
    # DeepSeek-V3.2's sparse attention: a lightning indexer caches one fp8 key this wide (and a
    # float32 scale per 128 of it) per layer, and vLLM stores the MLA latent as fp8_ds_mla.
    indexer_head_dim: int | None = Field(default=None, ge=1, le=4096)
    # Sliding-window layers only ever hold `sliding_window` tokens of KV.
    sliding_window: int | None = Field(default=None, ge=1, le=100_000_000)
    num_sliding_window_layers: int = Field(default=0, ge=0, le=MAX_LAYERS)

    @model_validator(mode="after")
    def _check(self) -> ModelArch:
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )
        if (self.kv_lora_rank is None) != (self.qk_rope_head_dim is None):
            raise ValueError("MLA needs both kv_lora_rank and qk_rope_head_dim")
        if self.indexer_head_dim is not None and self.kv_lora_rank is None:
            raise ValueError("indexer_head_dim (DeepSeek-V3.2's sparse attention) needs MLA")
        if self.num_sliding_window_layers > self.num_layers:
            raise ValueError("num_sliding_window_layers exceeds num_layers")
        if self.num_sliding_window_layers and self.sliding_window is None:
            raise ValueError("num_sliding_window_layers set without sliding_window")
        return self

    @property
    def attention(self) -> AttentionKind:
        if self.kv_lora_rank is not None:
            return AttentionKind.MLA
        if self.num_kv_heads == self.num_attention_heads:
            return AttentionKind.MHA
        if self.num_kv_heads == 1:
            return AttentionKind.MQA
        return AttentionKind.GQA

    @property
    def weight_bytes_per_param(self) -> float:
        return WEIGHT_BYTES[self.weight_dtype]


def from_hf_config(
    path: str | Path,
    num_parameters: int | None = None,
    weight_dtype: WeightDtype | None = None,
) -> ModelArch:
    """Read a local Hugging Face `config.json` (a file or the model directory), its weights
    priced as a serving runtime holds them: a float32 checkpoint in 16 bits (FP32_SERVED_AS)
    unless `weight_dtype` says otherwise. (`from_hf_dict` keeps the checkpoint's dtype: the
    headroom engine loads by it.)"""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"no config.json at {p}")
    try:
        cfg = read_json_object(p, "cannot read it as JSON")
    except OSError as exc:
        raise ValueError(f"{p}: cannot read it as JSON: {exc}") from None
    try:
        arch = from_hf_dict(cfg, p.parent.name, num_parameters, weight_dtype)
    except ValidationError as exc:  # name each field on one line, without pydantic's links
        raise ValueError(f"{p}: {fields_line(exc)}") from None
    except (ValueError, ConfigFieldError) as exc:
        raise ValueError(f"{p}: {exc}") from None
    except (KeyError, TypeError, ZeroDivisionError, OverflowError, AttributeError) as exc:
        # A field missing, null, zero or beyond a number: say which file, and what broke.
        raise ValueError(
            f"{p}: not a model config this reads ({type(exc).__name__}: {exc}); it needs "
            "num_attention_heads, hidden_size, num_hidden_layers and vocab_size"
        ) from None
    if weight_dtype is None and arch.weight_dtype == "fp32":  # 4 bytes a weight was twice vLLM's
        arch = arch.model_copy(update={"weight_dtype": FP32_SERVED_AS})
    return arch


# quant_method values whose weights are `bits` (GPTQ, AutoRound) or `w_bit` (AWQ) wide.
_INTEGER_METHODS = frozenset(
    {"gptq", "gptq_marlin", "awq", "awq_marlin", "auto-round", "autoround", "hqq", "bitblas"}
)
_BITS: dict[int, WeightDtype] = {4: "int4", 8: "int8"}


def quantized_weight_dtype(q: Any) -> WeightDtype | None:
    """What a checkpoint's `quantization_config` stores its weights as (None without one).

    Its `torch_dtype` is the compute dtype (bfloat16 for an fp8 checkpoint), so reading only
    that prices DeepSeek-V3's 671 GB of fp8 weights at 1.3 TB. Raises ValueError for a method
    whose width it cannot tell.
    """
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"quantization_config must be an object, got {type(q).__name__}")
    method = str(q.get("quant_method", "")).lower()
    if method in ("fp8", "fbgemm_fp8", "ptpc_fp8"):
        return "fp8"
    if method == "bitsandbytes":
        return "int4" if q.get("load_in_4bit") else "int8"
    if method in ("mxfp4", "fp_quant"):
        return "int4"  # 4-bit floats: int4's half byte a parameter
    if method == "modelopt":
        nested = q.get("quantization")
        if nested is not None and not isinstance(nested, dict):
            raise ValueError(
                f"quantization_config.quantization must be an object, got {type(nested).__name__}"
            )
        algo = str(q.get("quant_algo") or (nested or {}).get("quant_algo") or "").upper()
        if algo.startswith("FP8"):
            return "fp8"
        if "FP4" in algo:
            return "int4"
    if method in _INTEGER_METHODS:
        bits = q.get("bits", q.get("w_bit"))
        if isinstance(bits, int) and bits in _BITS:
            return _BITS[bits]
    if method == "compressed-tensors":
        groups = q.get("config_groups") or {}
        if not isinstance(groups, dict):
            raise ValueError(
                "quantization_config.config_groups must be an object (group name to scheme), "
                f"got {type(groups).__name__}"
            )
        widths: list[tuple[Any, Any]] = []  # a list: a stray num_bits need not be hashable
        for g in groups.values():
            if isinstance(g, dict) and isinstance(g.get("weights"), dict):
                width = (g["weights"].get("num_bits"), g["weights"].get("type", "int"))
                if width not in widths:
                    widths.append(width)
        if len(widths) == 1:
            bits, kind = widths[0]
            if bits == 8:
                return "fp8" if kind == "float" else "int8"
            if bits == 4:
                return "int4"
    raise ValueError(
        f"quantization_config (quant_method {method or 'unset'!r}): cannot tell how wide its "
        "weights are; state it (headroom plan --weight-dtype, or the CRD's model.weightDtype)"
    )


def _squashed(names: Iterable[str]) -> frozenset[str]:
    """Model types as `_family` compares them: lower case, no underscores."""
    return frozenset(n.lower().replace("_", "") for n in names)


def _family(cfg: dict[str, Any]) -> str:
    """`model_family` without underscores, so that a model_type ("qwen3_next") and an
    architecture ("Qwen3NextForCausalLM", where a config states no model_type) compare equal."""
    return model_family(cfg).replace("_", "")


# vLLM's MLA models (`is_deepseek_mla`, vllm/config/model.py): only these cache one latent per
# layer. Any other model with a kv_lora_rank (MiniCPM3) projects through the low rank but
# attends over full K and V heads, and caches those.
MLA_MODEL_TYPES = frozenset(
    {"deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_mtp", "kimi_k2", "longcat_flash"}
)
_FALCON_TYPES = _squashed({"falcon", "RefinedWeb", "RefinedWebModel"})
# Families whose MLP is two matrices (up, down; 4 x hidden unless stated) and whose embeddings
# are tied unless the config says otherwise (transformers' defaults for them).
_PLAIN_MLP_TYPES = _FALCON_TYPES | _squashed({"gpt_bigcode", "gpt2"})
_LLAMA4_TYPES = _squashed({"llama4", "llama4_text"})
# Hybrid models: some layers hold a per-sequence recurrent state (Mamba, linear attention,
# short convolutions) instead of KV. These keys, or these words in a per-layer type list, say so.
_HYBRID_KEYS = (
    "full_attention_interval",  # Qwen3-Next: every n-th layer attends, the rest are linear
    "linear_conv_kernel_dim",
    "attn_layer_period",  # Jamba
    "attn_layer_offset",
    "attn_layer_indices",  # Bamba
    "layers_block_type",  # Jamba, Zamba
    "hybrid_override_pattern",  # Nemotron-H
    "ssm_cfg",
    "attn_type_list",  # MiniMax-Text-01's lightning attention
    "linear_attn_config",  # Kimi-Linear
    "conv_L_cache",  # LFM2
)
_HYBRID_LAYER_WORDS = ("linear", "mamba", "conv", "ssm", "recurrent", "rwkv")
_STATE_SPACE_TYPES = _squashed(
    {"mamba", "mamba2", "falcon_mamba", "rwkv", "recurrent_gemma", "xlstm", "qwen3_next",
     "jamba", "bamba", "zamba", "zamba2", "falcon_h1", "nemotron_h", "granitemoehybrid",
     "lfm2", "plamo2", "kimi_linear", "minimax", "minimax_text_01"}
)  # fmt: skip
# What transformers fills in where a published config leaves a field out (and so what vLLM,
# which reads configs through transformers, serves): Gemma 3's text_config states no vocab_size.
_VOCAB_DEFAULTS = {"gemma3": 262_208, "gemma3text": 262_208}
# transformers' default width of Llama 4's dense (non-MoE) layers.
_LLAMA4_DENSE_WIDTH = 16384


def _types(raw: dict[str, Any]) -> set[str]:
    """The model types a config names (`_family`): its own and its text_config's."""
    text = raw.get("text_config")
    return {_family(c) for c in (raw, text) if isinstance(c, dict)} - {""}


def is_mla(raw: dict[str, Any]) -> bool:
    """Whether vLLM runs this config's attention as MLA (`is_deepseek_mla`): one of
    MLA_MODEL_TYPES (its own type or its text_config's), with a kv_lora_rank."""
    text = raw.get("text_config")
    cfg = {**(text if isinstance(text, dict) else {}), **raw}
    return cfg.get("kv_lora_rank") is not None and bool(_types(raw) & _squashed(MLA_MODEL_TYPES))


def hybrid_marker(cfg: dict[str, Any]) -> str | None:
    """What marks a config as a hybrid or state-space model (some or all layers keep a
    recurrent state, not KV), or None."""
    for key in ("layer_types", "layers_block_type", "block_types"):
        kinds = cfg.get(key)
        if isinstance(kinds, list):
            for kind in kinds:
                if isinstance(kind, str) and any(w in kind.lower() for w in _HYBRID_LAYER_WORDS):
                    return f"{key} {kind!r}"
    for key in _HYBRID_KEYS:
        if cfg.get(key) is not None:
            return key
    for key in sorted(cfg):
        if key.startswith("mamba_") and cfg[key] is not None:
            return key
    if _family(cfg) in _STATE_SPACE_TYPES:
        return f"model_type {model_family(cfg)!r}"
    return None


def _kv_heads(cfg: dict[str, Any], heads: int) -> int:
    """KV heads by vLLM's `get_total_num_kv_heads` (vllm/config/model.py): multi_query means
    one (except a new-architecture Falcon), then n_head_kv (Falcon), num_kv_heads,
    num_key_value_heads, multi_query_group_num (ChatGLM), else one per query head."""
    new_falcon = _family(cfg) in _FALCON_TYPES and bool(cfg.get("new_decoder_architecture"))
    if not new_falcon and cfg.get("multi_query"):
        return 1
    if cfg.get("multi_query_group_num") is not None and not cfg.get("multi_query_attention", True):
        return heads  # ChatGLM without multi_query_attention attends with every head
    keys = ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num")
    return _number(cfg, *keys, default=heads)


def from_hf_dict(
    cfg: dict[str, Any],
    name: str = "custom",
    num_parameters: int | None = None,
    weight_dtype: WeightDtype | None = None,
) -> ModelArch:
    """The architecture record of a parsed `config.json` mapping (`name` when it names none);
    `weight_dtype` overrides what the config says its weights are stored as. ValueError for a
    model this cannot size (hybrid and state-space models), naming what says so."""
    raw = cfg
    text = raw.get("text_config")
    cfg = {**(text if isinstance(text, dict) else {}), **raw}  # multimodal wrappers nest it
    if (marker := hybrid_marker(cfg)) is not None:
        raise ValueError(
            f"{marker}: hybrid linear-attention / state-space (Mamba) models are not sized yet "
            "(their layers are not all KV layers, and each sequence keeps a recurrent state)"
        )
    types = _types(raw)
    heads = _number(cfg, "num_attention_heads", "n_head", low=1)  # head_dim divides by it
    hidden = _number(cfg, "hidden_size", "n_embd")
    # num_layers, padded_vocab_size, ffn_hidden_size, seq_length: ChatGLM's names.
    layer_keys = ("num_hidden_layers", "n_layer", "num_layers")
    layers = _number(cfg, *layer_keys)
    if layers > MAX_LAYERS:  # refused before windows.py builds a list with one entry a layer
        key = next(k for k in layer_keys if cfg.get(k) is not None)
        raise ConfigFieldError(
            f"num_layers: Input should be less than or equal to {MAX_LAYERS} ({key} is {cfg[key]})"
        )
    vocab_default = next((v for t, v in _VOCAB_DEFAULTS.items() if t in types), None)
    vocab = _number(cfg, "vocab_size", "padded_vocab_size", default=vocab_default)
    kv_heads = _kv_heads(cfg, heads)
    head_dim = _number(cfg, "head_dim", default=hidden // heads)
    inter_keys = ("intermediate_size", "ffn_hidden_size", "n_inner")
    widths = next((cfg[k] for k in inter_keys if cfg.get(k) is not None), None)
    if isinstance(widths, list) and widths and all(isinstance(w, int) for w in widths):
        # Gemma 3n: one MLP width per layer, and per-layer embeddings besides.
        if num_parameters is None:
            raise ValueError(
                "intermediate_size is a per-layer list: the parameter count cannot be "
                "estimated from it; state it (headroom plan --params BILLIONS)"
            )
        inter: int | None = max(widths)
    else:
        inter = _number(cfg, *inter_keys, default=0) or None
    mla = is_mla(raw)
    if cfg.get("kv_lora_rank") is not None and not mla:
        # MiniCPM3 in vLLM (minicpm3.py): K is [nope | rope] and V is padded to the same
        # width, one pair per attention head.
        head_dim = _number(cfg, "qk_nope_head_dim") + _number(cfg, "qk_rope_head_dim")
        kv_heads = heads
    # Gemma 3n: the last num_kv_shared_layers reuse earlier layers' KV and cache none (the
    # first layer always caches its own).
    shared_layers = _number(cfg, "num_kv_shared_layers", default=0, low=0, high=max(0, layers - 1))
    kv_layers = layers - shared_layers
    # Counted by the rule the engine runs its attention by (windows.py).
    windows = [w for w in sliding_windows(cfg, layers)[:kv_layers] if w is not None]
    if num_parameters is None:
        num_parameters = _parameters_of(
            cfg, vocab, layers, hidden, inter, heads, kv_heads, head_dim
        )
    if weight_dtype is None:
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        weight_dtype = quantized_weight_dtype(cfg.get("quantization_config")) or DTYPE_NAMES.get(
            dtype, "bf16"
        )
    # DeepSeek-V3.2 (vLLM tells it by index_topk): sparse attention with an indexer cache.
    indexer = (
        _number(cfg, "index_head_dim", default=128)
        if mla and cfg.get("index_topk") is not None
        else None
    )
    return ModelArch(
        name=str(cfg.get("_name_or_path") or name or "custom"),
        num_layers=kv_layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=inter,
        vocab_size=vocab,
        max_position_embeddings=context_length(
            cfg, types, text if isinstance(text, dict) else None
        ),
        num_parameters=num_parameters,
        weight_dtype=weight_dtype,
        kv_lora_rank=_number(cfg, "kv_lora_rank") if mla else None,
        qk_rope_head_dim=_number(cfg, "qk_rope_head_dim") if mla else None,
        indexer_head_dim=indexer,
        sliding_window=min(windows) if windows else None,
        num_sliding_window_layers=len(windows),
    )


# Rope types whose config already states the extended length (Phi-3's longrope, once "su";
# Llama 3.1's llama3): vLLM does not scale their max_position_embeddings again.
_PRESCALED_ROPE_TYPES = frozenset({"su", "longrope", "llama3"})


# vLLM's length keys (`_get_and_verify_max_len`): it serves the smallest the config states,
# and 2,048 tokens where it states none.
_LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
_DEFAULT_LENGTH = 2048
# transformers' default max_position_embeddings of common families (`_family` names): vLLM
# reads the config class, so a config.json that leaves the key out has this one.
_LENGTH_DEFAULTS = {
    "llama": 2048, "mistral": 131072, "mixtral": 131072, "qwen2": 32768, "qwen2moe": 32768,
    "qwen3": 32768, "gemma": 8192, "gemma2": 8192, "gemma3text": 131072, "falcon": 2048,
    "deepseekv3": 4096, "phi3": 4096, "cohere": 8192,
}  # fmt: skip


def context_length(
    cfg: dict[str, Any], types: Iterable[str] = (), text: dict[str, Any] | None = None
) -> int:
    """The longest sequence vLLM serves a (text_config-merged) config at: its derived
    max_model_len (`_get_and_verify_max_len`, vllm/config/model.py, 0.11). The config's length
    (the smallest of its length keys: n_positions is GPT-2's, seq_length ChatGLM's and Qwen's,
    max_seq_len MPT's; a known family's transformers default where max_position_embeddings is
    left out; model_max_length over them all; 2,048 where it states none), times the
    rope scaling `factor` unless
    the rope type is su, longrope or llama3 (already extended) or the model a Gemma 3 (its
    128K is already scaled); YaRN counts from its original_max_position_embeddings. The
    scaling is `rope_parameters` (transformers 5, which vLLM reads the same way, one mapping
    or one per layer type) or else `rope_scaling`, its type `rope_type` or the legacy `type`.
    `types`: the config's model types (`_types`); `text`: a wrapper's text_config, the only
    place vLLM reads the lengths of such a model from."""
    src = text if text is not None else cfg
    lengths = [_number(src, key) for key in _LENGTH_KEYS if src.get(key) is not None]
    if src.get("max_position_embeddings") is None and _family(src) in _LENGTH_DEFAULTS:
        lengths.append(_LENGTH_DEFAULTS[_family(src)])
    if src.get("model_max_length"):  # Command-R's: vLLM takes it over the others (if not 0)
        length = _number(src, "model_max_length")
    else:
        length = min(lengths, default=_DEFAULT_LENGTH)
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    params = cfg.get(key)
    if params is None or any("gemma3" in t for t in types):
        return length
    if not isinstance(params, dict):
        raise ConfigFieldError(f"{key} is {type(params).__name__}, not an object")
    per_type = bool(params) and all(isinstance(v, dict) for v in params.values())
    factor: float = 1.0
    for layer_type, rope in params.items() if per_type else [("", params)]:
        where = f"{key}.{layer_type}" if layer_type else key
        rope_type = str(rope.get("rope_type") or rope.get("type") or "default")
        if rope_type in _PRESCALED_ROPE_TYPES:
            continue
        stated = rope.get("factor")
        if stated is not None:
            if (
                isinstance(stated, bool)
                or not isinstance(stated, int | float)
                or not (0 < stated < math.inf)
            ):
                raise ConfigFieldError(f"{where}.factor: {stated!r} is not a positive number")
            factor = stated
        if rope_type == "yarn" and rope.get("original_max_position_embeddings") is not None:
            try:
                length = _number(rope, "original_max_position_embeddings", low=1)
            except ConfigFieldError as exc:
                raise ConfigFieldError(f"{where}.{exc}") from None
    if factor != 1 and length * factor > MAX_POSITIONS:
        raise ConfigFieldError(
            f"{key}: factor {factor} extends the context to {length * factor:.0f} tokens, "
            f"past {MAX_POSITIONS:,}"
        )
    return int(length * factor)


def _parameters_of(
    cfg: dict[str, Any],
    vocab: int,
    layers: int,
    hidden: int,
    inter: int | None,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> int:
    """A config's parameter count where it states none: dense, Mixtral-style MoE (every expert
    `intermediate_size` wide), Llama 4 (MoE every `interleave_moe_layer_step`-th layer with a
    shared expert, dense layers `intermediate_size_mlp` wide) or DeepSeek/Qwen-MoE (experts
    `moe_intermediate_size` wide, some shared, the first layers dense), with MLA's projections
    where it has them."""
    family = _family(cfg)
    dense = inter or 4 * hidden
    experts_keys = ("num_local_experts", "n_routed_experts", "num_experts")
    experts = _number(cfg, *experts_keys, default=1, low=1)
    moe_width = _number(cfg, "moe_intermediate_size", default=0, low=1) or None
    llama4 = family in _LLAMA4_TYPES and experts > 1
    plain_mlp = family in _PLAIN_MLP_TYPES
    total = estimate_parameters(
        layers,
        hidden,
        dense if moe_width is None and not llama4 else 0,
        heads,
        kv_heads,
        head_dim,
        vocab,
        tied=bool(cfg.get("tie_word_embeddings", plain_mlp)),
        experts=experts if moe_width is None else 1,
        gated=not plain_mlp,
    )
    if llama4:
        moe_layers = cfg.get("moe_layers")
        step = max(1, _number(cfg, "interleave_moe_layer_step", default=1))
        moe = (
            len(moe_layers) if isinstance(moe_layers, list) else len(range(step - 1, layers, step))
        )
        mlp_width = _number(cfg, "intermediate_size_mlp", default=_LLAMA4_DENSE_WIDTH)
        # Each MoE layer: the routed experts, one shared expert as wide, the router.
        total += moe * (3 * hidden * dense * (experts + 1) + hidden * experts)
        total += (layers - moe) * 3 * hidden * mlp_width
    elif moe_width is not None:
        shared = _number(cfg, "n_shared_experts", default=0, low=0)
        # Qwen2-MoE: one wider shared expert; 0 is none (vLLM builds one only above 0).
        wide = _number(cfg, "shared_expert_intermediate_size", default=0, low=0)
        shared_width = wide or shared * moe_width
        # Past num_hidden_layers it means every layer dense, as vLLM's DeepSeek runs it.
        dense_layers = min(layers, _number(cfg, "first_k_dense_replace", default=0, low=0))
        moe_layer = 3 * hidden * (experts * moe_width + shared_width) + hidden * experts
        total += dense_layers * 3 * hidden * dense + (layers - dense_layers) * moe_layer
    if latent := _number(cfg, "kv_lora_rank", default=0, low=1):
        # MLA: low-rank q and kv projections replace the plain q/k/v of the estimate above.
        rope = _number(cfg, "qk_rope_head_dim", default=0)
        nope = _number(cfg, "qk_nope_head_dim", default=head_dim)
        v_dim = _number(cfg, "v_head_dim", default=head_dim)
        q_rank = _number(cfg, "q_lora_rank", default=0, low=1)  # null: a full-rank q
        q = (
            hidden * heads * (nope + rope)
            if not q_rank
            else q_rank * (hidden + heads * (nope + rope))
        )
        kv = hidden * (latent + rope) + latent * heads * (nope + v_dim)
        plain = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
        total += layers * (q + kv + heads * v_dim * hidden - plain)
    return total


def estimate_parameters(
    layers: int,
    hidden: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    vocab: int,
    *,
    tied: bool = False,
    experts: int = 1,
    gated: bool = True,
) -> int:
    """Parameter count of a Llama-style decoder (for configs that do not state it); `gated`
    False for a two-matrix MLP (GPT-2, Falcon, StarCoder) instead of SwiGLU's three."""
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp = (3 if gated else 2) * hidden * intermediate * experts
    embed = vocab * hidden * (1 if tied else 2)
    return layers * (attn + mlp + 2 * hidden) + embed + hidden
