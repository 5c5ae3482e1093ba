"""The decoder's config: the contract's architecture record plus what torch needs, parsed
from a Hugging Face `config.json`.

Both spellings of RoPE settings are read: transformers 5 writes `rope_parameters` (with
`rope_theta` inside), checkpoints from before write `rope_theta` and `rope_scaling`.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from headroom.contract.budget import ModelArch, estimate_parameters
from headroom.contract.budget import from_hf_dict as arch_from_hf_dict
from headroom.contract.budget.presets import HEADROOM_ENGINE_ARCHITECTURES
from headroom.contract.budget.windows import sliding_windows

# The operator refuses (in the CRD and its sizing) the presets this list leaves out.
SUPPORTED_ARCHITECTURES = HEADROOM_ENGINE_ARCHITECTURES
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


_T = TypeVar("_T")
# What the Llama estimate reads, in its argument order.
_ESTIMATE_SHAPE = (
    "num_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_kv_heads",
    "head_dim", "vocab_size",
)  # fmt: skip


# Built once: an adapter costs about 20 validations to build.
_INT, _BOOL = TypeAdapter(int), TypeAdapter(bool)


def _lax(adapter: TypeAdapter[_T], value: Any) -> _T | None:
    """`value` as a field of the adapter's type reads it, or None where that would fail."""
    try:
        return adapter.validate_python(value)
    except ValidationError:
        return None


class ModelConfig(ModelArch):
    """The contract's architecture record (`headroom.contract.budget.ModelArch`, the one the
    KV arithmetic runs on) plus what the torch decoder needs to build itself and load weights.
    `num_parameters` defaults to the Llama-shaped estimate."""

    name: str = "custom"
    num_parameters: int = Field(default=1, ge=1, description="default: the Llama estimate")
    architecture: str
    intermediate_size: int = Field(ge=1)
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # One entry per layer: the window in tokens, or None for full attention.
    sliding_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _derive(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        windows = [w for w in data.get("sliding_windows", ()) if w is not None]
        if windows:  # the budget's view of the per-layer windows
            data.setdefault("sliding_window", min(windows))
            data.setdefault("num_sliding_window_layers", len(windows))
        if data.get("num_parameters") is None:
            # Read the shape as the fields will (pydantic's lax mode: "4" and 4.0 are 4), or a
            # shape given as strings or floats would get the field's floor of 1 parameter.
            ints = {f: _lax(_INT, data.get(f)) for f in _ESTIMATE_SHAPE}
            tied = _lax(_BOOL, data.get("tie_word_embeddings", False))
            layers, hidden, inter, heads, kv_heads, head_dim, vocab = ints.values()
            if layers and hidden and inter and heads and vocab and tied is not None:
                data["num_parameters"] = estimate_parameters(
                    layers, hidden, inter, heads, kv_heads or heads,
                    head_dim or hidden // heads, vocab, tied=tied,
                )  # fmt: skip
        return data

    @model_validator(mode="after")
    def _check_windows(self) -> ModelConfig:
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
    theta = params.get("rope_theta", cfg.get("rope_theta")) or 10000.0  # null: the default

    def need(key: str) -> float:
        value = params.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise UnsupportedModel(f"config.json: rope {rope_type!r} needs a number {key}")
        return float(value)

    fields: dict[str, Any] = {"rope_type": rope_type, "theta": float(theta)}
    if rope_type in ("linear", "llama3"):
        fields["factor"] = need("factor")
    if rope_type == "llama3":
        fields["low_freq_factor"] = need("low_freq_factor")
        fields["high_freq_factor"] = need("high_freq_factor")
        fields["original_max_position_embeddings"] = int(need("original_max_position_embeddings"))
    return RopeConfig(**fields)


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
    quant = cfg.get("quantization_config")
    if quant is not None:
        # Its tensors would only fail later, at load, as names the checkpoint should not have.
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise UnsupportedModel(
            f"quantized weights (quantization_config {method!r}) are not supported: the "
            "headroom engine loads fp32, bf16 or fp16 checkpoints; serve this one with "
            "engine.runtime vllm or sglang"
        )
    record = arch_from_hf_dict(cfg)  # ModelArch refuses heads that KV heads do not divide
    attention_bias = bool(cfg.get("attention_bias", False))
    budget_windows = {"sliding_window", "num_sliding_window_layers", "num_parameters"}
    return ModelConfig(
        **record.model_dump(exclude=budget_windows),
        architecture=arch,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama's attention_bias covers o_proj too.
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=family != "qwen2" and attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        # The rule `headroom plan` counts windowed layers by (the contract's windows.py).
        sliding_windows=sliding_windows(cfg, record.num_layers),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_token_ids(cfg.get("eos_token_id")),
    )
