"""The model architecture record the KV arithmetic runs on."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from headroom.contract.budget.windows import sliding_windows
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
    num_layers: int = Field(ge=1, le=1024)
    num_attention_heads: int = Field(ge=1, le=4096)
    num_kv_heads: int = Field(ge=1, le=4096)
    head_dim: int = Field(ge=1, le=4096)
    hidden_size: int = Field(ge=1, le=1_000_000)
    intermediate_size: int | None = Field(default=None, ge=1, le=10_000_000)
    vocab_size: int = Field(ge=1, le=100_000_000)
    max_position_embeddings: int = Field(ge=1, le=100_000_000)
    num_parameters: int = Field(
        ge=1, le=MAX_PARAMETERS, description="total parameters (all experts for MoE)"
    )
    weight_dtype: WeightDtype = "bf16"
    # MLA (DeepSeek-V2/V3) caches one compressed latent plus a shared rope key per layer.
    kv_lora_rank: int | None = Field(default=None, ge=1, le=65536)
    qk_rope_head_dim: int | None = Field(default=None, ge=1, le=4096)
    # Sliding-window layers only ever hold `sliding_window` tokens of KV.
    sliding_window: int | None = Field(default=None, ge=1, le=100_000_000)
    num_sliding_window_layers: int = Field(default=0, ge=0, le=1024)

    @model_validator(mode="after")
    def _check(self) -> ModelArch:
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )
        if (self.kv_lora_rank is None) != (self.qk_rope_head_dim is None):
            raise ValueError("MLA needs both kv_lora_rank and qk_rope_head_dim")
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


def _get(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


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
    except ValueError as exc:
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
        algo = str(q.get("quant_algo") or q.get("quantization", {}).get("quant_algo", "")).upper()
        if algo.startswith("FP8"):
            return "fp8"
        if "FP4" in algo:
            return "int4"
    if method in _INTEGER_METHODS:
        bits = q.get("bits", q.get("w_bit"))
        if isinstance(bits, int) and bits in _BITS:
            return _BITS[bits]
    if method == "compressed-tensors":
        widths = {
            (g["weights"].get("num_bits"), g["weights"].get("type", "int"))
            for g in (q.get("config_groups") or {}).values()
            if isinstance(g, dict) and isinstance(g.get("weights"), dict)
        }
        if len(widths) == 1:
            bits, kind = widths.pop()
            if bits == 8:
                return "fp8" if kind == "float" else "int8"
            if bits == 4:
                return "int4"
    raise ValueError(
        f"quantization_config (quant_method {method or 'unset'!r}): cannot tell how wide its "
        "weights are; state it (headroom plan --weight-dtype, or the CRD's model.weightDtype)"
    )


def from_hf_dict(
    cfg: dict[str, Any],
    name: str = "custom",
    num_parameters: int | None = None,
    weight_dtype: WeightDtype | None = None,
) -> ModelArch:
    """The architecture record of a parsed `config.json` mapping (`name` when it names none);
    `weight_dtype` overrides what the config says its weights are stored as."""
    cfg = {**cfg.get("text_config", {}), **cfg}  # multimodal wrappers nest the decoder config
    heads = int(_get(cfg, "num_attention_heads", "n_head"))
    hidden = int(_get(cfg, "hidden_size", "n_embd"))
    layers = int(_get(cfg, "num_hidden_layers", "n_layer"))
    kv_heads = int(_get(cfg, "num_key_value_heads", default=heads))
    head_dim = int(_get(cfg, "head_dim", default=hidden // heads))
    vocab = int(cfg["vocab_size"])
    inter = _get(cfg, "intermediate_size")
    # Counted by the rule the engine runs its attention by (windows.py).
    windows = [w for w in sliding_windows(cfg, layers) if w is not None]
    if num_parameters is None:
        num_parameters = _parameters_of(cfg, layers, hidden, inter, heads, kv_heads, head_dim)
    if weight_dtype is None:
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        weight_dtype = quantized_weight_dtype(cfg.get("quantization_config")) or DTYPE_NAMES.get(
            dtype, "bf16"
        )
    return ModelArch(
        name=str(cfg.get("_name_or_path") or name or "custom"),
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=int(inter) if inter else None,
        vocab_size=vocab,
        # n_positions: GPT-2 and GPT-J's name for it (their configs map it, as n_head and n_embd).
        max_position_embeddings=int(
            _get(cfg, "max_position_embeddings", "n_positions", default=4096)
        ),
        num_parameters=num_parameters,
        weight_dtype=weight_dtype,
        kv_lora_rank=_get(cfg, "kv_lora_rank"),
        qk_rope_head_dim=_get(cfg, "qk_rope_head_dim") if _get(cfg, "kv_lora_rank") else None,
        sliding_window=min(windows) if windows else None,
        num_sliding_window_layers=len(windows),
    )


def _parameters_of(
    cfg: dict[str, Any],
    layers: int,
    hidden: int,
    inter: Any,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> int:
    """A config's parameter count where it states none: dense, Mixtral-style MoE (every expert
    `intermediate_size` wide) or DeepSeek/Qwen-MoE (experts `moe_intermediate_size` wide, some
    shared, the first layers dense), with MLA's projections where it has them."""
    vocab = int(cfg["vocab_size"])
    dense = int(inter or 4 * hidden)
    experts = int(_get(cfg, "num_local_experts", "n_routed_experts", "num_experts", default=1))
    moe_width = _get(cfg, "moe_intermediate_size")
    total = estimate_parameters(
        layers,
        hidden,
        dense if moe_width is None else 0,
        heads,
        kv_heads,
        head_dim,
        vocab,
        tied=bool(cfg.get("tie_word_embeddings", False)),
        experts=experts if moe_width is None else 1,
    )
    if moe_width is not None:
        shared = int(_get(cfg, "n_shared_experts", default=0))
        if _get(cfg, "shared_expert_intermediate_size"):  # Qwen2-MoE: one wider shared expert
            shared_width = int(cfg["shared_expert_intermediate_size"])
        else:
            shared_width = shared * int(moe_width)
        dense_layers = min(layers, int(_get(cfg, "first_k_dense_replace", default=0)))
        moe_layer = 3 * hidden * (experts * int(moe_width) + shared_width) + hidden * experts
        total += dense_layers * 3 * hidden * dense + (layers - dense_layers) * moe_layer
    if _get(cfg, "kv_lora_rank"):
        # MLA: low-rank q and kv projections replace the plain q/k/v of the estimate above.
        rope = int(_get(cfg, "qk_rope_head_dim", default=0))
        nope = int(_get(cfg, "qk_nope_head_dim", default=head_dim))
        v_dim = int(_get(cfg, "v_head_dim", default=head_dim))
        latent, q_rank = int(cfg["kv_lora_rank"]), _get(cfg, "q_lora_rank")
        q = (
            hidden * heads * (nope + rope)
            if not q_rank
            else int(q_rank) * (hidden + heads * (nope + rope))
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
) -> int:
    """Parameter count of a Llama-style decoder (for configs that do not state it)."""
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp = 3 * hidden * intermediate * experts
    embed = vocab * hidden * (1 if tied else 2)
    return layers * (attn + mlp + 2 * hidden) + embed + hidden
