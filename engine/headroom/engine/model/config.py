"""The decoder architecture record, parsed from a Hugging Face `config.json`.

Both spellings of RoPE settings are read: transformers 5 writes `rope_parameters` (with
`rope_theta` inside), checkpoints from before write `rope_theta` and `rope_scaling`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModel(ValueError):
    """The checkpoint's architecture or one of its settings is not implemented here."""


class RopeConfig(BaseModel):
    """Rotary embedding settings (`rope_type` default, linear or llama3)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rope_type: str = "default"
    theta: float = Field(default=10000.0, gt=0)
    factor: float = Field(default=1.0, gt=0)
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class ModelConfig(BaseModel):
    """What the torch decoder needs to build itself and load weights."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    architecture: str
    vocab_size: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    num_layers: int = Field(ge=1)
    num_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = Field(default=4096, ge=1)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # One entry per layer: the window in tokens, or None for full attention.
    sliding_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModel(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise ValueError(
                f"sliding_windows has {len(self.sliding_windows)} entries for "
                f"{self.num_layers} layers"
            )
        return self

    def window(self, layer: int) -> int | None:
        """Sliding window of `layer` in tokens (None: full causal attention)."""
        return self.sliding_windows[layer] if self.sliding_windows else None

    @property
    def min_sliding_window(self) -> int | None:
        """The smallest window of any layer, None when no layer slides."""
        windows = [w for w in self.sliding_windows if w is not None]
        return min(windows) if windows else None


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise UnsupportedModel(f"rope settings must be a mapping, got {params!r}")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModel("per-layer-type rope parameters are not supported")
    rope_type = str(params.get("rope_type") or params.get("type") or "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModel(
            f"rope_type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise UnsupportedModel(f"partial_rotary_factor {partial} is not supported")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    fields: dict[str, Any] = {"rope_type": rope_type, "theta": float(theta)}
    if rope_type in ("linear", "llama3"):
        fields["factor"] = float(params["factor"])
    if rope_type == "llama3":
        fields["low_freq_factor"] = float(params["low_freq_factor"])
        fields["high_freq_factor"] = float(params["high_freq_factor"])
        fields["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
    return RopeConfig(**fields)


def _sliding_windows(cfg: dict[str, Any], family: str, layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if window is None:
        return ()
    if family == "qwen2":
        if not cfg.get("use_sliding_window", False):
            return ()
        types = cfg.get("layer_types")
        if not isinstance(types, list):
            start = int(cfg.get("max_window_layers", layers))
            types = ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    if family == "mistral":
        return tuple(int(window) for _ in range(layers))
    return ()


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)


def from_hf_dict(cfg: dict[str, Any]) -> ModelConfig:
    """Parse a `config.json` mapping; raise `UnsupportedModel` naming what is not supported."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
        arch = by_type.get(str(cfg.get("model_type")))
    if arch is None:
        found = archs or [cfg.get("model_type")]
        raise UnsupportedModel(
            f"architecture {found} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"hidden_act {act!r} is not supported (only silu)")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    layers = int(cfg["num_hidden_layers"])
    attention_bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama's attention_bias covers o_proj too.
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=family != "qwen2" and attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        sliding_windows=_sliding_windows(cfg, family, layers),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_token_ids(cfg.get("eos_token_id")),
        dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"),
    )
