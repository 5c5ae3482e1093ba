"""The model architecture record the KV arithmetic runs on."""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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


class AttentionKind(StrEnum):
    MHA = "MHA"
    GQA = "GQA"
    MQA = "MQA"
    MLA = "MLA"


class ModelArch(BaseModel):
    """Architecture numbers as published in a model's config.json."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    num_layers: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    intermediate_size: int | None = Field(default=None, ge=1)
    vocab_size: int = Field(ge=1)
    max_position_embeddings: int = Field(ge=1)
    num_parameters: int = Field(ge=1, description="total parameters (all experts for MoE)")
    weight_dtype: WeightDtype = "bf16"
    # MLA (DeepSeek-V2/V3) caches one compressed latent plus a shared rope key per layer.
    kv_lora_rank: int | None = Field(default=None, ge=1)
    qk_rope_head_dim: int | None = Field(default=None, ge=1)
    # Sliding-window layers only ever hold `sliding_window` tokens of KV.
    sliding_window: int | None = Field(default=None, ge=1)
    num_sliding_window_layers: int = Field(default=0, ge=0)

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


def from_hf_config(path: str | Path, num_parameters: int | None = None) -> ModelArch:
    """Read a local Hugging Face `config.json` (a file or the model directory)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"no config.json at {p}")
    try:
        cfg = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{p}: cannot read it as JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{p}: expected a JSON object, got {type(cfg).__name__}")
    try:
        return from_hf_dict(cfg, p.parent.name, num_parameters)
    except ValueError as exc:  # pydantic's, naming the field
        raise ValueError(f"{p}: {exc}") from None
    except (KeyError, TypeError, ZeroDivisionError, OverflowError, AttributeError) as exc:
        # A field missing, null, zero or beyond a number: say which file, and what broke.
        raise ValueError(
            f"{p}: not a model config this reads ({type(exc).__name__}: {exc}); it needs "
            "num_attention_heads, hidden_size, num_hidden_layers and vocab_size"
        ) from None


def from_hf_dict(
    cfg: dict[str, Any], name: str = "custom", num_parameters: int | None = None
) -> ModelArch:
    """The architecture record of a parsed `config.json` mapping (`name` when it names none)."""
    cfg = {**cfg.get("text_config", {}), **cfg}  # multimodal wrappers nest the decoder config
    heads = int(_get(cfg, "num_attention_heads", "n_head"))
    hidden = int(_get(cfg, "hidden_size", "n_embd"))
    layers = int(_get(cfg, "num_hidden_layers", "n_layer"))
    kv_heads = int(_get(cfg, "num_key_value_heads", default=heads))
    head_dim = int(_get(cfg, "head_dim", default=hidden // heads))
    vocab = int(cfg["vocab_size"])
    inter = _get(cfg, "intermediate_size")
    window = _get(cfg, "sliding_window")
    use_window = cfg.get("use_sliding_window", True) and window is not None
    sliding_layers = 0
    if use_window:
        pattern = cfg.get("layer_types")
        if isinstance(pattern, list):
            sliding_layers = sum(1 for t in pattern if t == "sliding_attention")
        elif "gemma2" in str(cfg.get("model_type", "")):
            sliding_layers = layers // 2  # Gemma 2 alternates local and global layers
        else:
            sliding_layers = layers
    if num_parameters is None:
        num_parameters = estimate_parameters(
            layers,
            hidden,
            int(inter or 4 * hidden),
            heads,
            kv_heads,
            head_dim,
            vocab,
            tied=bool(cfg.get("tie_word_embeddings", False)),
            experts=int(_get(cfg, "num_local_experts", "n_routed_experts", default=1)),
        )
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return ModelArch(
        name=str(cfg.get("_name_or_path") or name or "custom"),
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=int(inter) if inter else None,
        vocab_size=vocab,
        max_position_embeddings=int(_get(cfg, "max_position_embeddings", default=4096)),
        num_parameters=num_parameters,
        weight_dtype=DTYPE_NAMES.get(dtype, "bf16"),
        kv_lora_rank=_get(cfg, "kv_lora_rank"),
        qk_rope_head_dim=_get(cfg, "qk_rope_head_dim") if _get(cfg, "kv_lora_rank") else None,
        sliding_window=int(window) if use_window and sliding_layers else None,
        num_sliding_window_layers=sliding_layers,
    )


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
