"""The engine's decoder config: a hand-built ModelConfig's defaults, the per-layer windows it
hands the KV budget, and what `from_hf_dict` reads from a config.json (RoPE in both spellings,
attention biases per family, the architecture by name or model_type, token ids)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from headroom.contract.budget import estimate_parameters
from headroom.engine.model.config import ModelConfig, RopeConfig, UnsupportedModel, from_hf_dict

SHAPE: dict[str, Any] = {
    "architecture": "LlamaForCausalLM",
    "vocab_size": 10,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_layers": 4,
    "num_attention_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 4,
    "max_position_embeddings": 64,
}
HF: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 10,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
}
LLAMA3: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_a_hand_built_config_is_a_plain_llama() -> None:
    """Only the shape given (as `tiny_config` and the benches build one): no biases, untied,
    unscaled RoPE of theta 10000, no windows, and the Llama parameter estimate (at least 1)."""
    cfg = ModelConfig(**SHAPE)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias, cfg.tie_word_embeddings) == (False,) * 4
    assert cfg.rope == RopeConfig(rope_type="default", theta=10000.0, factor=1.0)
    assert cfg.rms_norm_eps == 1e-6
    assert cfg.sliding_windows == () and cfg.window(3) is None
    assert cfg.min_sliding_window is None and cfg.num_sliding_window_layers == 0
    assert cfg.num_parameters == estimate_parameters(4, 8, 16, 2, 1, 4, 10)
    with pytest.raises(ValidationError, match="num_parameters"):
        ModelConfig(**SHAPE, num_parameters=0)
    wide = ModelConfig(**{**SHAPE, "head_dim": 8})  # heads wider than hidden / heads
    assert wide.num_parameters == estimate_parameters(4, 8, 16, 2, 1, 8, 10)
    assert ModelConfig(**SHAPE, tie_word_embeddings=True).num_parameters == estimate_parameters(
        4, 8, 16, 2, 1, 4, 10, tied=True
    )


def test_the_parameter_estimate_reads_the_shape_as_the_fields_do() -> None:
    """A shape given as strings or whole floats (a YAML or JSON config) validates to the same
    ints, so it gets the same Llama estimate, not the field's floor of 1."""
    lax = {**SHAPE, "num_layers": "4", "hidden_size": 8.0, "num_kv_heads": "1", "vocab_size": "10"}
    cfg = ModelConfig(**lax)
    assert cfg == ModelConfig(**SHAPE)
    assert cfg.num_parameters == estimate_parameters(4, 8, 16, 2, 1, 4, 10) > 1
    tied = ModelConfig(**SHAPE, tie_word_embeddings="true")
    assert tied.num_parameters == estimate_parameters(4, 8, 16, 2, 1, 4, 10, tied=True)
    with pytest.raises(ValidationError, match="num_layers"):  # refused by its field, as before
        ModelConfig(**{**SHAPE, "num_layers": 4.5})


def test_the_rope_settings_are_immutable() -> None:
    """Every config built without `rope` shares one default RopeConfig: changing it in place
    would change the rotary frequencies of all of them."""
    rope = ModelConfig(**SHAPE).rope
    with pytest.raises(ValidationError, match="frozen"):
        rope.theta = 500000.0  # type: ignore[misc]
    assert ModelConfig(**SHAPE).rope.theta == 10000.0


def test_per_layer_windows_give_the_budget_the_smallest_window_and_their_count() -> None:
    """The KV budget sizes windowed layers by the smallest window; full layers (None) do not
    count, and each layer keeps its own window for the attention."""
    cfg = ModelConfig(**SHAPE, sliding_windows=(None, 64, 32, None))
    assert (cfg.sliding_window, cfg.num_sliding_window_layers) == (32, 2)
    assert cfg.min_sliding_window == 32
    assert [cfg.window(i) for i in range(4)] == [None, 64, 32, None]
    with pytest.raises(ValidationError, match="sliding_windows has 3 entries for 4 layers"):
        ModelConfig(**SHAPE, sliding_windows=(8, 8, 8))


def test_rope_in_the_transformers_5_spelling_and_the_old_one() -> None:
    """`rope_parameters` (theta inside) wins over `rope_scaling`; a top-level `rope_theta`
    applies to either, a null one is the default 10000; the old `type` key names the type."""
    new = from_hf_dict({**HF, "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                        "rope_theta": 1e6}, "rope_scaling": {"type": "bogus"}})  # fmt: skip
    assert (new.rope.rope_type, new.rope.factor, new.rope.theta) == ("linear", 2.0, 1e6)
    old = from_hf_dict({**HF, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 4}})
    assert (old.rope.rope_type, old.rope.factor, old.rope.theta) == ("linear", 4.0, 5e5)
    assert from_hf_dict({**HF, "rope_theta": None}).rope == RopeConfig()
    assert from_hf_dict({**HF, "rope_scaling": None}).rope == RopeConfig()


@pytest.mark.parametrize(
    ("rope", "says"),
    [
        ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per-layer-type"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs a number low_freq"),
        ({"rope_scaling": {**LLAMA3, "high_freq_factor": True}}, "needs a number high_freq"),
    ],
)
def test_rope_settings_the_decoder_cannot_run_are_refused(rope: dict[str, Any], says: str) -> None:
    """Each is named, instead of running the wrong rotary frequencies."""
    with pytest.raises(UnsupportedModel, match=says):
        from_hf_dict({**HF, **rope})


def test_attention_biases_follow_the_family() -> None:
    """Qwen2 always has q/k/v biases and never an o_proj one; Llama's `attention_bias` covers
    q/k/v and o_proj; `mlp_bias` the three MLP projections."""
    llama = from_hf_dict(HF)
    assert (llama.qkv_bias, llama.o_bias, llama.mlp_bias) == (False, False, False)
    biased = from_hf_dict({**HF, "attention_bias": True, "mlp_bias": True})
    assert (biased.qkv_bias, biased.o_bias, biased.mlp_bias) == (True, True, True)
    for extra in ({}, {"attention_bias": True}):
        qwen = from_hf_dict({**HF, "architectures": ["Qwen2ForCausalLM"], **extra})
        assert (qwen.qkv_bias, qwen.o_bias) == (True, False), extra


def test_flags_a_config_json_leaves_out_are_transformers_defaults() -> None:
    """Unstated, embeddings are untied (an lm_head.weight is expected) and the RMSNorm eps is
    1e-6, as transformers' LlamaConfig has them."""
    cfg = from_hf_dict(HF)
    assert (cfg.tie_word_embeddings, cfg.rms_norm_eps) == (False, 1e-6)
    tied = from_hf_dict({**HF, "tie_word_embeddings": True, "rms_norm_eps": 1e-5})
    assert (tied.tie_word_embeddings, tied.rms_norm_eps) == (True, 1e-5)


def test_the_architecture_by_name_or_model_type() -> None:
    """The first supported entry of `architectures`, else the family `model_type` names."""
    cfg = from_hf_dict({**HF, "architectures": ["Custom", "MistralForCausalLM"]})
    assert cfg.architecture == "MistralForCausalLM"
    by_type = from_hf_dict({**HF, "architectures": ["Custom"], "model_type": "qwen2"})
    assert by_type.architecture == "Qwen2ForCausalLM"
    with pytest.raises(UnsupportedModel, match=r"\['Custom'\] is not supported"):
        from_hf_dict({**HF, "architectures": ["Custom"]})


def test_token_ids_and_the_kv_head_multiple() -> None:
    """One eos id or a list of them; config.json's bos as given; heads that do not group
    evenly over the KV heads are refused."""
    assert from_hf_dict({**HF, "eos_token_id": 7, "bos_token_id": 3}).eos_token_ids == (7,)
    assert from_hf_dict({**HF, "bos_token_id": 3}).bos_token_id == 3
    assert from_hf_dict(HF).eos_token_ids == () and from_hf_dict(HF).bos_token_id is None
    with pytest.raises(ValueError, match="not a multiple"):
        from_hf_dict({**HF, "num_attention_heads": 4, "num_key_value_heads": 3, "head_dim": 2})
