"""`headroom plan --model-config` against what vLLM 0.11 caches for each architecture: KV heads
by vLLM's rule, MLA only for vLLM's MLA models, DeepSeek-V3.2's sparse cache, Llama 4's weights,
and a clear refusal where the arithmetic does not apply (hybrid and state-space models)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from headroom.contract.budget import (
    AttentionKind,
    ModelArch,
    PlanInput,
    estimate_parameters,
    from_hf_config,
    from_hf_dict,
    kv_bytes_per_token,
    plan,
    sequence_kv_bytes,
)
from headroom.contract.budget.arch import ConfigFieldError
from headroom.contract.cli import main

# Published config.json values (the numbers that matter to the arithmetic).
# fmt: off
FALCON_7B = {"architectures": ["FalconForCausalLM"], "model_type": "falcon", "hidden_size": 4544,
             "num_attention_heads": 71, "num_hidden_layers": 32, "multi_query": True,
             "new_decoder_architecture": False, "vocab_size": 65024, "torch_dtype": "bfloat16"}
FALCON_40B = {"architectures": ["RWForCausalLM"], "model_type": "RefinedWeb", "hidden_size": 8192,
              "n_head": 128, "n_head_kv": 8, "n_layer": 60, "new_decoder_architecture": True,
              "num_kv_heads": 8, "vocab_size": 65024, "torch_dtype": "bfloat16"}
STARCODER = {"architectures": ["GPTBigCodeForCausalLM"], "model_type": "gpt_bigcode",
             "n_embd": 6144, "n_head": 48, "n_layer": 40, "n_inner": 24576, "n_positions": 8192,
             "multi_query": True, "vocab_size": 49152, "torch_dtype": "float32"}
GLM4_9B = {"architectures": ["ChatGLMModel"], "model_type": "chatglm", "num_layers": 40,
           "hidden_size": 4096, "num_attention_heads": 32, "kv_channels": 128,
           "multi_query_attention": True, "multi_query_group_num": 2, "ffn_hidden_size": 13696,
           "padded_vocab_size": 151552, "seq_length": 131072, "torch_dtype": "bfloat16"}
MINICPM3_4B = {"architectures": ["MiniCPM3ForCausalLM"], "model_type": "minicpm3",
               "hidden_size": 2560, "intermediate_size": 6400, "num_attention_heads": 40,
               "num_key_value_heads": 40, "num_hidden_layers": 62, "kv_lora_rank": 256,
               "q_lora_rank": 768, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32,
               "v_head_dim": 64, "max_position_embeddings": 32768, "vocab_size": 73448}
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
               "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
               "n_routed_experts": 256, "n_shared_experts": 1, "first_k_dense_replace": 3,
               "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
               "qk_rope_head_dim": 64, "v_head_dim": 128, "num_attention_heads": 128,
               "num_key_value_heads": 128, "num_hidden_layers": 61,
               "max_position_embeddings": 163840, "vocab_size": 129280,
               "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}
DEEPSEEK_V32 = {**DEEPSEEK_V3, "architectures": ["DeepseekV32ForCausalLM"],
                "model_type": "deepseek_v32", "index_head_dim": 128, "index_n_heads": 64,
                "index_topk": 2048}
LLAMA4_TEXT = {"model_type": "llama4_text", "attention_chunk_size": 8192, "head_dim": 128,
               "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
               "num_attention_heads": 40, "num_key_value_heads": 8, "num_hidden_layers": 48,
               "num_experts_per_tok": 1, "max_position_embeddings": 1048576, "vocab_size": 202048}
GEMMA3_27B_IT = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                 "text_config": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504,
                                 "model_type": "gemma3_text", "num_attention_heads": 32,
                                 "num_hidden_layers": 62, "num_key_value_heads": 16,
                                 "sliding_window": 1024},
                 "torch_dtype": "bfloat16"}
_GEMMA3N_TYPES = (["sliding_attention"] * 4 + ["full_attention"]) * 7
GEMMA3N_E4B = {"architectures": ["Gemma3nForConditionalGeneration"], "model_type": "gemma3n",
               "text_config": {"model_type": "gemma3n_text", "hidden_size": 2048,
                               "num_attention_heads": 8, "num_key_value_heads": 2,
                               "num_hidden_layers": 35, "num_kv_shared_layers": 15,
                               "head_dim": 256, "vocab_size": 262400, "sliding_window": 512,
                               "intermediate_size": [16384] * 35,
                               "max_position_embeddings": 32768, "layer_types": _GEMMA3N_TYPES},
               "torch_dtype": "bfloat16"}
QWEN3_NEXT = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
              "full_attention_interval": 4, "head_dim": 256, "hidden_size": 2048,
              "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_num_key_heads": 16,
              "moe_intermediate_size": 512, "num_attention_heads": 16, "num_experts": 512,
              "num_hidden_layers": 48, "num_key_value_heads": 2, "vocab_size": 151936}
JAMBA = {"architectures": ["JambaForCausalLM"], "model_type": "jamba", "hidden_size": 4096,
         "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
         "num_hidden_layers": 32, "attn_layer_period": 8, "attn_layer_offset": 4,
         "num_experts": 16, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
         "vocab_size": 65536}
# A config of none of the families above, for markers on their own.
PLAIN = {"model_type": "custom", "hidden_size": 1024, "num_attention_heads": 16,
         "num_key_value_heads": 4, "num_hidden_layers": 8, "vocab_size": 32000}
# fmt: on


def write(tmp_path: Path, name: str, cfg: dict[str, object]) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    rc = main(["plan", *args, "--json"])
    out = capsys.readouterr()
    assert rc in (0, 1), out.err
    result: dict[str, object] = json.loads(out.out)
    return result


def refusal(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """stderr of a `headroom plan` that must exit 2, on one line."""
    rc = main(["plan", *args])
    out = capsys.readouterr()
    assert rc == 2 and out.out == "", (rc, out.out, out.err)
    assert "Traceback" not in out.err and out.err.count("\n") == 1, out.err
    return out.err


def test_kv_heads_follow_vllms_rule_multi_query_n_head_kv_and_chatglm() -> None:
    # vLLM's get_total_num_kv_heads: multi_query is one KV head (Falcon-7B, StarCoder); a
    # new-architecture Falcon reads n_head_kv; ChatGLM multi_query_group_num. The plan read only
    # num_key_value_heads and priced one KV head per query head: 71x, 16x, 48x and 16x the KV.
    cases = [
        (FALCON_7B, 1, 32 * 2 * 1 * 64 * 2),
        (FALCON_40B, 8, 60 * 2 * 8 * 64 * 2),
        (STARCODER, 1, 40 * 2 * 1 * 128 * 2),
        (GLM4_9B, 2, 40 * 2 * 2 * 128 * 2),
        # new_decoder_architecture: multi_query is ignored, n_head_kv counts.
        ({**FALCON_40B, "multi_query": True}, 8, 60 * 2 * 8 * 64 * 2),
        # ChatGLM without multi_query_attention attends with every head.
        ({**GLM4_9B, "multi_query_attention": False}, 32, 40 * 2 * 32 * 128 * 2),
    ]
    for cfg, kv_heads, per_token in cases:
        arch = from_hf_dict(cfg)
        assert arch.num_kv_heads == kv_heads, cfg
        assert kv_bytes_per_token(arch) == per_token, cfg
    glm = from_hf_dict(GLM4_9B)
    assert (glm.num_layers, glm.vocab_size, glm.max_position_embeddings) == (40, 151552, 131072)
    assert glm.num_parameters == pytest.approx(9.4e9, rel=0.05)  # GLM-4-9B
    # Two-matrix MLPs and tied embeddings: StarCoder's published 15.5B, not 21.8B.
    assert from_hf_dict(STARCODER).num_parameters == pytest.approx(15.5e9, rel=0.05)


def test_a_falcon_config_plans_its_one_kv_head(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = write(tmp_path, "falcon-7b", FALCON_7B)
    out = plan_json(capsys, "--model-config", str(cfg), "--concurrency", "64",
                    "--context", "4096")  # fmt: skip
    assert out["kv_bytes_per_token"] == 8_192


def test_hybrid_and_state_space_models_are_refused_naming_the_marker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Qwen3-Next attends in 12 of its 48 layers and Jamba in 4 of 32; the rest keep a
    # per-sequence recurrent state the KV arithmetic does not hold. Priced as 48 and 32 KV
    # layers they were 4x and 8x over on KV and silent about the state.
    layer_types = (["linear_attention"] * 3 + ["full_attention"]) * 2
    cases = [
        (QWEN3_NEXT, "full_attention_interval"),
        ({**PLAIN, "num_hidden_layers": 8, "layer_types": layer_types},
         "layer_types 'linear_attention'"),
        (JAMBA, "attn_layer_period"),
        ({**PLAIN, "layers_block_type": ["mamba", "attention"] * 4}, "layers_block_type 'mamba'"),
        ({**PLAIN, "hybrid_override_pattern": "M-M-M*-"}, "hybrid_override_pattern"),
        ({**PLAIN, "mamba_d_state": 16}, "mamba_d_state"),
        ({**PLAIN, "ssm_cfg": {"d_state": 16}}, "ssm_cfg"),
        ({**PLAIN, "model_type": "mamba"}, "model_type 'mamba'"),
        ({**{k: v for k, v in PLAIN.items() if k != "model_type"},
          "architectures": ["Qwen3NextForCausalLM"]}, "model_type 'qwen3next'"),
        ({**PLAIN, "layer_types": ["conv", "full_attention"] * 4}, "layer_types 'conv'"),
    ]  # fmt: skip
    for cfg, marker in cases:
        with pytest.raises(ValueError, match="not sized yet") as info:
            from_hf_dict(cfg)
        assert str(info.value).startswith(f"{marker}: hybrid linear-attention / state-space")
    path = write(tmp_path, "qwen3-next", QWEN3_NEXT)
    err = refusal(capsys, "--model-config", str(path), "--concurrency", "64", "--context", "4096")
    assert f"{path / 'config.json'}: full_attention_interval: hybrid" in err
    assert "models are not sized yet" in err
    # Sliding and full attention layers are attention: nothing refused.
    gpt_oss_like = {**PLAIN, "sliding_window": 128,
                    "layer_types": ["sliding_attention", "full_attention"] * 4}  # fmt: skip
    assert from_hf_dict(gpt_oss_like).num_sliding_window_layers == 4


def test_kv_lora_rank_is_mla_only_for_vllms_mla_models() -> None:
    # vLLM runs MiniCPM3 as attention over 40 heads of K = [nope 64 | rope 32] and V padded to
    # 96: 952,320 B a token, where the plan priced a 256 + 32 latent (35,712 B, 27x under).
    mini = from_hf_dict(MINICPM3_4B)
    assert mini.kv_lora_rank is None and mini.attention == "MHA"
    assert (mini.num_kv_heads, mini.head_dim) == (40, 96)
    assert kv_bytes_per_token(mini) == 62 * 2 * 40 * 96 * 2 == 952_320
    # vLLM's MLA model types keep the latent: DeepSeek-V3, and a multimodal wrapper whose
    # text_config is one (Kimi-VL), and a config that names only its architecture.
    assert kv_bytes_per_token(from_hf_dict(DEEPSEEK_V3)) == 61 * 576 * 2
    kimi_vl = {"model_type": "kimi_vl", "text_config": {**DEEPSEEK_V3, "num_hidden_layers": 27}}
    assert from_hf_dict(kimi_vl).kv_lora_rank == 512
    no_type = {k: v for k, v in DEEPSEEK_V3.items() if k != "model_type"}
    assert kv_bytes_per_token(from_hf_dict(no_type)) == 61 * 576 * 2


def test_deepseek_v32_is_priced_as_vllms_fp8_ds_mla_plus_its_indexer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # vLLM forces fp8_ds_mla (656 B a token and layer) for auto and fp8 KV and adds the
    # indexer's 128 fp8 + one float32 scale (132 B); bf16 is 576 x 2 + 132. The plan priced a
    # bf16 latent for auto (1,152 B) and 576 B for fp8, with no indexer.
    v32 = from_hf_dict(DEEPSEEK_V32)
    assert v32.indexer_head_dim == 128
    assert kv_bytes_per_token(v32, "fp8") == 61 * (656 + 132)
    assert kv_bytes_per_token(v32, "bf16") == 61 * (1152 + 132)
    # Whole bytes: a float here would leak into every figure derived from it.
    assert all(isinstance(kv_bytes_per_token(v32, kv), int) for kv in ("fp8", "bf16"))
    assert sequence_kv_bytes(v32, 1000, "fp8", tp=8) == 1000 * 61 * 788  # replicated per rank
    cfg = write(tmp_path, "v32", DEEPSEEK_V32)
    common = ["--model-config", str(cfg), "--gpu", "h200-141gb", "--tp", "8",
              "--concurrency", "256", "--context", "32768"]  # fmt: skip
    for setting, per_token, label in [("auto", 48_068, "fp8"), ("fp8", 48_068, "fp8"),
                                      ("bf16", 78_324, "bf16")]:  # fmt: skip
        out = plan_json(capsys, *common, "--kv-dtype", setting)
        assert (out["kv_bytes_per_token"], out["kv_dtype"]) == (per_token, label), setting
    err = refusal(capsys, *common, "--kv-dtype", "int8")
    assert "DeepSeek-V3.2" in err and "not int8" in err
    with pytest.raises(ValidationError, match="not int8"):
        PlanInput(model=v32, gpu_memory_bytes=10**12, concurrency=1, context=10, kv_dtype="int8")
    # DeepSeek-V3 (no index_topk) keeps its bf16 latent under auto.
    v3 = PlanInput(model=from_hf_dict(DEEPSEEK_V3), gpu_memory_bytes=10**12, tp=8,
                   concurrency=1, context=10)  # fmt: skip
    assert plan(v3).kv_bytes_per_token == 61 * 1152


def test_llama4_weights_count_interleaved_moe_dense_layers_and_the_shared_expert() -> None:
    # Maverick: MoE in every second layer (128 experts + a shared one), dense layers 16,384
    # wide: 400B, not the 778B of 128 experts in all 48 layers. Scout: 16 experts everywhere.
    scout = {"model_type": "llama4", "text_config": {**LLAMA4_TEXT, "num_local_experts": 16,
             "interleave_moe_layer_step": 1}}  # fmt: skip
    maverick = {"model_type": "llama4", "text_config": {**LLAMA4_TEXT, "num_local_experts": 128,
                "interleave_moe_layer_step": 2}}  # fmt: skip
    assert from_hf_dict(maverick).num_parameters == pytest.approx(400e9, rel=0.05)
    assert from_hf_dict(scout).num_parameters == pytest.approx(109e9, rel=0.05)
    listed = {"model_type": "llama4", "text_config": {**LLAMA4_TEXT, "num_local_experts": 128,
              "moe_layers": list(range(1, 48, 2))}}  # fmt: skip
    assert from_hf_dict(listed).num_parameters == from_hf_dict(maverick).num_parameters


def test_gemma3_without_vocab_size_reads_transformers_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Gemma-3-27B-it's text_config states no vocab_size (transformers, and so vLLM, fill in
    # 262,208): it was `KeyError: 'vocab_size'`.
    arch = from_hf_dict(GEMMA3_27B_IT)
    assert arch.vocab_size == 262_208
    assert kv_bytes_per_token(arch) == 62 * 2 * 16 * 128 * 2
    # Any other config without it: one line naming the key and where to add it.
    no_vocab = write(tmp_path, "no-vocab", {k: v for k, v in PLAIN.items() if k != "vocab_size"})
    err = refusal(capsys, "--model-config", str(no_vocab), "--concurrency", "1", "--context", "8")
    assert (
        f"{no_vocab / 'config.json'}: vocab_size: config.json states none (nor does its "
        "text_config); add it there"
    ) in err
    assert "KeyError" not in err


def test_gemma3n_per_layer_widths_need_params_and_shared_kv_layers_cache_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A list of per-layer MLP widths was `TypeError: int() argument must be ...`.
    path = write(tmp_path, "gemma-3n", GEMMA3N_E4B)
    args = ["--model-config", str(path), "--concurrency", "64", "--context", "4096"]
    err = refusal(capsys, *args)
    assert "intermediate_size is a per-layer list" in err and "--params" in err
    assert "TypeError" not in err
    # With the count stated it plans: the last 15 layers reuse earlier layers' KV (vLLM's
    # kv_sharing), so 20 layers cache, 16 of them sliding.
    arch = from_hf_config(path, num_parameters=8_000_000_000)
    assert (arch.num_layers, arch.num_sliding_window_layers, arch.intermediate_size) == (
        20, 16, 16384)  # fmt: skip
    assert plan_json(capsys, *args, "--params", "8")["kv_bytes_per_token"] == 20 * 2 * 2 * 256 * 2
    # Another per-layer list names its key.
    lists = write(tmp_path, "lists", {**PLAIN, "num_key_value_heads": [4] * 8})
    err = refusal(capsys, "--model-config", str(lists), "--concurrency", "1", "--context", "8")
    assert "num_key_value_heads is a per-layer list, not one number" in err


# --- A config's numbers as vLLM reads them, and each refusal naming its field -----------------

# fmt: off
QWEN25_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
             "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28,
             "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
             "max_window_layers": 28, "sliding_window": 131072, "use_sliding_window": False,
             "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# The block Qwen2.5's and Qwen3's model cards add to config.json for contexts past 32,768.
YARN_4X = {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}
LLAMA31_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
QWEN2_MOE = {"model_type": "qwen2_moe", "num_attention_heads": 16, "num_key_value_heads": 16,
             "hidden_size": 2048, "num_hidden_layers": 24, "vocab_size": 151936,
             "num_experts": 60, "moe_intermediate_size": 1408,
             "shared_expert_intermediate_size": 5632}
QWEN3_MOE = {"model_type": "qwen3_moe", "num_attention_heads": 32, "num_key_value_heads": 4,
             "hidden_size": 2048, "num_hidden_layers": 48, "vocab_size": 151936,
             "num_experts": 128, "moe_intermediate_size": 768, "intermediate_size": 6144}
MISTRAL_7B = {"model_type": "mistral", "num_attention_heads": 32, "num_key_value_heads": 8,
              "hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 32000,
              "sliding_window": 4096}
# fmt: on


def test_a_layer_count_past_the_bound_is_refused_before_any_per_layer_list(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # With a sliding window, windows.py built one entry per layer before ModelArch's bound of
    # 1,024 layers was checked: 10**12 layers were a MemoryError traceback (exit 1), 5e7 on
    # Gemma 2 took 15 s and 900 MB before the refusal.
    gemma2 = {**PLAIN, "model_type": "gemma2", "sliding_window": 4096}
    qwen2 = {**QWEN25_7B, "use_sliding_window": True}
    for cfg in (MISTRAL_7B, gemma2, qwen2):
        for layers in (10**12, 5 * 10**7, 1025):
            with pytest.raises(ConfigFieldError, match=(
                rf"^num_layers: Input should be less than or equal to 1024 "
                rf"\(num_hidden_layers is {layers}\)$"
            )):  # fmt: skip
                from_hf_dict({**cfg, "num_hidden_layers": layers})
        assert from_hf_dict({**cfg, "num_hidden_layers": 1024}).num_layers == 1024
    # GPT-2's name for it is named as the config states it.
    with pytest.raises(ConfigFieldError, match=r"1024 \(n_layer is 4096\)$"):
        from_hf_dict({**STARCODER, "n_layer": 4096})
    path = write(tmp_path, "huge", {**MISTRAL_7B, "num_hidden_layers": 10**12})
    err = refusal(capsys, "--model-config", str(path), "--concurrency", "1", "--context", "10")
    assert (
        "num_layers: Input should be less than or equal to 1024 "
        "(num_hidden_layers is 1000000000000)"
    ) in err


def test_rope_scaling_extends_the_context_by_vllms_rule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # vLLM's derived max_model_len multiplies the config's length by rope scaling's factor
    # (YaRN from original_max_position_embeddings): Qwen2.5-7B with its model card's YaRN block
    # serves 131,072 tokens, where the plan called 65,536 infeasible (max 32,768).
    assert from_hf_dict(QWEN25_7B).max_position_embeddings == 32768
    path = write(tmp_path, "qwen25-7b-yarn", {**QWEN25_7B, "rope_scaling": YARN_4X})
    args = ["--model-config", str(path), "--concurrency", "8"]
    out = plan_json(capsys, *args, "--context", "65536")
    assert out["feasible"] and out["binding"] != "context", out["reason"]
    out = plan_json(capsys, *args, "--context", "131073")
    assert (out["feasible"], out["binding"]) == (False, "context")
    assert "max_position_embeddings 131072" in str(out["reason"])
    yarn_t5 = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
               "rope_theta": 1000000.0}  # fmt: skip
    longrope = {"type": "longrope", "long_factor": [1.0] * 48, "short_factor": [1.0] * 48}
    gemma3: dict[str, Any] = json.loads(json.dumps(GEMMA3_27B_IT))  # as published
    gemma3["text_config"].update(max_position_embeddings=131072,
                                 rope_scaling={"factor": 8.0, "rope_type": "linear"})  # fmt: skip
    deepseek_yarn = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"}  # fmt: skip
    cases: list[tuple[dict[str, Any], int]] = [
        # Qwen3-8B states 40,960; YaRN counts from its original 32,768.
        ({**QWEN25_7B, "max_position_embeddings": 40960,
          "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                           "original_max_position_embeddings": 32768}}, 131072),
        # YaRN without original_max_position_embeddings scales the stated length.
        ({**QWEN25_7B, "rope_scaling": {"type": "yarn", "factor": 2.0}}, 65536),
        ({**QWEN25_7B, "rope_scaling": {"type": "linear", "factor": 4}}, 131072),
        ({**QWEN25_7B, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, 65536),
        # Already extended: Llama 3.1, Phi-3's longrope (once "su"), Gemma 3's 128K.
        (LLAMA31_8B, 131072),
        ({**QWEN25_7B, "max_position_embeddings": 131072, "rope_scaling": longrope}, 131072),
        ({**QWEN25_7B, "max_position_embeddings": 131072,
          "rope_scaling": {**longrope, "type": "su"}}, 131072),
        (gemma3, 131072),
        # Qwen2-VL's mrope has no factor; DeepSeek-V3's YaRN gives its stated 163,840.
        ({**QWEN25_7B, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}, 32768),
        ({**DEEPSEEK_V3, "rope_scaling": deepseek_yarn}, 163840),
        # transformers 5's rope_parameters, one mapping or one per layer type, wins over
        # rope_scaling; its default (rope_theta only) changes nothing.
        ({**QWEN25_7B, "rope_parameters": yarn_t5}, 131072),
        ({**QWEN25_7B, "rope_parameters": yarn_t5, "rope_scaling": {"type": "linear",
          "factor": 8.0}}, 131072),
        ({**QWEN25_7B, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, 32768),
        ({**QWEN25_7B, "rope_parameters": {"full_attention": yarn_t5,
          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, 131072),
    ]  # fmt: skip
    for cfg, served in cases:
        assert from_hf_dict(cfg).max_position_embeddings == served, cfg
    refused = [
        ({"type": "yarn", "factor": "4x"}, "rope_scaling.factor: '4x' is not a positive number"),
        ({"type": "linear", "factor": 0}, "rope_scaling.factor: 0 is not a positive number"),
        ({"type": "linear", "factor": True}, "rope_scaling.factor: True is not a positive"),
        ({**YARN_4X, "original_max_position_embeddings": "32k"},
         "rope_scaling.original_max_position_embeddings: '32k' is not a number"),
        ({"type": "linear", "factor": 1e9}, "rope_scaling: factor 1000000000.0 extends the "
         "context to 32768000000000 tokens, past 100,000,000"),
        ("yarn", "rope_scaling is str, not an object"),
    ]  # fmt: skip
    for i, (rope, says) in enumerate(refused):
        path = write(tmp_path, f"rope-{i}", {**QWEN25_7B, "rope_scaling": rope})
        err = refusal(capsys, "--model-config", str(path), "--concurrency", "1",
                      "--context", "10")  # fmt: skip
        assert says in err, err


def test_every_bad_field_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each was `invalid literal for int()`, or "not a model config this reads (TypeError /
    # AttributeError / ZeroDivisionError ...)" without the field, or, for `vocab_size: true`,
    # the per-layer-list wording.
    gemma2 = {**PLAIN, "model_type": "gemma2", "sliding_window": 4096}
    qwen2 = {**QWEN25_7B, "use_sliding_window": True}
    modelopt = {"quant_method": "modelopt"}
    compressed = {"quant_method": "compressed-tensors"}
    cases = [
        ({**QWEN2_MOE, "moe_intermediate_size": "abc"},
         "moe_intermediate_size: 'abc' is not a number"),
        ({**QWEN2_MOE, "moe_intermediate_size": [1408]},
         "moe_intermediate_size is a per-layer list"),
        ({**QWEN2_MOE, "shared_expert_intermediate_size": "5632x"},
         "shared_expert_intermediate_size: '5632x' is not a number"),
        ({**MINICPM3_4B, "kv_lora_rank": "x"}, "kv_lora_rank: 'x' is not a number"),
        ({**DEEPSEEK_V3, "q_lora_rank": "x"}, "q_lora_rank: 'x' is not a number"),
        ({**MISTRAL_7B, "sliding_window": "4k"}, "sliding_window: '4k' is not a number"),
        ({**MISTRAL_7B, "sliding_window": [4096, None]}, "sliding_window is a per-layer list"),
        ({**qwen2, "max_window_layers": "x"}, "max_window_layers: 'x' is not a number"),
        ({**gemma2, "sliding_window_pattern": {"every": 2}},
         "sliding_window_pattern is an object, not a number"),
        ({**PLAIN, "quantization_config": {**modelopt, "quantization": None}},
         "quantization_config (quant_method 'modelopt'): cannot tell how wide its weights are"),
        ({**PLAIN, "quantization_config": {**modelopt, "quantization": "FP8"}},
         "quantization_config.quantization must be an object, got str"),
        ({**PLAIN, "quantization_config": {**compressed, "config_groups": [{"weights": {}}]}},
         "quantization_config.config_groups must be an object (group name to scheme), got list"),
        ({**PLAIN, "quantization_config": {**compressed, "config_groups": {
            "group_0": {"weights": {"num_bits": [8], "type": "int"}}}}},
         "quantization_config (quant_method 'compressed-tensors'): cannot tell how wide"),
        ({**PLAIN, "num_attention_heads": 0},
         "num_attention_heads: Input should be greater than or equal to 1 (it is 0)"),
        ({**PLAIN, "vocab_size": True}, "vocab_size: true is not a number"),
    ]  # fmt: skip
    for i, (cfg, says) in enumerate(cases):
        path = write(tmp_path, f"bad-{i}", cfg)
        err = refusal(capsys, "--model-config", str(path), "--concurrency", "1",
                      "--context", "100")  # fmt: skip
        assert f"{path / 'config.json'}: {says}" in err, err
        assert "not a model config this reads" not in err and "int()" not in err, err
        assert "per-layer" not in err or "per-layer list" in says, err


def test_negative_or_zero_sizes_are_refused_not_priced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # moe_intermediate_size -1 priced Qwen3-MoE's weights at 1.6 GiB instead of 28.6;
    # num_kv_shared_layers -32 cached 64 KV layers of a 32-layer Llama.
    assert from_hf_dict(QWEN3_MOE).num_parameters == pytest.approx(30.5e9, rel=0.02)
    at_least_1 = [
        (QWEN3_MOE, "moe_intermediate_size", -1), (QWEN3_MOE, "moe_intermediate_size", 0),
        (QWEN3_MOE, "num_experts", 0), (DEEPSEEK_V3, "n_routed_experts", -1),
        ({**MISTRAL_7B, "intermediate_size": 14336}, "num_local_experts", 0),
        (DEEPSEEK_V3, "q_lora_rank", -1), (DEEPSEEK_V3, "kv_lora_rank", 0),
        (MINICPM3_4B, "kv_lora_rank", -256),
    ]  # fmt: skip
    for cfg, key, value in at_least_1:
        with pytest.raises(
            ConfigFieldError,
            match=rf"^{key}: Input should be greater than or equal to 1 "
            rf"\(it is {value}\)$",
        ):
            from_hf_dict({**cfg, key: value})
    for cfg, key, value, says in [
        (DEEPSEEK_V3, "n_shared_experts", -1, "greater than or equal to 0"),
        (QWEN2_MOE, "shared_expert_intermediate_size", -5632, "greater than or equal to 0"),
        (DEEPSEEK_V3, "first_k_dense_replace", -3, "greater than or equal to 0"),
        (LLAMA31_8B, "num_kv_shared_layers", -32, "greater than or equal to 0"),
        # Every layer sharing another's KV leaves none that caches it.
        (LLAMA31_8B, "num_kv_shared_layers", 32, "less than or equal to 31"),
    ]:
        with pytest.raises(
            ConfigFieldError, match=rf"^{key}: Input should be {says} \(it is {value}\)$"
        ):
            from_hf_dict({**cfg, key: value})
    # A shared expert 0 wide is none (Qwen2-MoE's family builds one only above 0).
    no_shared = from_hf_dict({**QWEN2_MOE, "shared_expert_intermediate_size": 0})
    assert 0 < no_shared.num_parameters < from_hf_dict(QWEN2_MOE).num_parameters
    # Null is absent (DeepSeek-V2-Lite's q_lora_rank), and first_k_dense_replace past the
    # layers is every layer dense, as vLLM runs it.
    assert from_hf_dict({**DEEPSEEK_V3, "q_lora_rank": None}).num_parameters > 0
    assert (
        from_hf_dict({**DEEPSEEK_V3, "first_k_dense_replace": 100}).num_parameters
        == from_hf_dict({**DEEPSEEK_V3, "first_k_dense_replace": 61}).num_parameters
    )
    path = write(tmp_path, "neg", {**QWEN3_MOE, "moe_intermediate_size": -1})
    err = refusal(capsys, "--model-config", str(path), "--concurrency", "1", "--context", "8")
    assert "moe_intermediate_size: Input should be greater than or equal to 1 (it is -1)" in err


# What a ModelArch at every bound holds; each case below moves one field one past its bound.
_AT_THE_BOUNDS: dict[str, Any] = {
    "name": "edge", "num_layers": 1024, "num_attention_heads": 4096, "num_kv_heads": 4096,
    "head_dim": 4096, "hidden_size": 1_000_000, "intermediate_size": 10_000_000,
    "vocab_size": 100_000_000, "max_position_embeddings": 100_000_000,
    "num_parameters": 10**15, "kv_lora_rank": 65536, "qk_rope_head_dim": 4096,
    "indexer_head_dim": 4096, "sliding_window": 100_000_000, "num_sliding_window_layers": 1024,
}  # fmt: skip


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_layers", 0), ("num_layers", 1025), ("num_attention_heads", 0),
        ("num_attention_heads", 4097), ("num_kv_heads", 0), ("head_dim", 0), ("head_dim", 4097),
        ("hidden_size", 0), ("hidden_size", 1_000_001), ("intermediate_size", 0),
        ("intermediate_size", 10_000_001), ("vocab_size", 0), ("vocab_size", 100_000_001),
        ("max_position_embeddings", 0), ("max_position_embeddings", 100_000_001),
        ("num_parameters", 0), ("num_parameters", 10**15 + 1), ("kv_lora_rank", 0),
        ("kv_lora_rank", 65537), ("qk_rope_head_dim", 0), ("qk_rope_head_dim", 4097),
        ("indexer_head_dim", 0), ("indexer_head_dim", 4097), ("sliding_window", 0),
        ("sliding_window", 100_000_001), ("num_sliding_window_layers", -1),
    ],
)  # fmt: skip
def test_model_arch_refuses_one_past_each_of_the_crds_bounds(field: str, value: int) -> None:
    """ModelArch's bounds are the CRD's ModelSpec's, exactly: the edge is accepted, one past it
    is a ValidationError naming the field (not a ZeroDivisionError from a zero head count)."""
    edge = ModelArch(**_AT_THE_BOUNDS)
    assert edge.attention is AttentionKind.MLA and edge.num_parameters == 10**15
    # One KV head, so that 4,097 query heads are refused by their bound, not by the grouping.
    with pytest.raises(ValidationError, match=rf"^1 validation error for ModelArch\n{field}\n"):
        ModelArch(**{**_AT_THE_BOUNDS, "num_kv_heads": 1, field: value})


def test_parameter_estimates_are_exact_for_published_llama_and_deepseek_v2_lite() -> None:
    """The estimate counts each weight matrix, norm and embedding as the models are built:
    Llama-2-7B's published 6,738,415,616 and Llama-3-8B's 8,030,261,248 exactly, and
    DeepSeek-V2-Lite's (full-rank q, MLA, MoE) transformers count less its 27 kv_a_layernorms."""
    # estimate_parameters' defaults are a dense, untied SwiGLU model (the engine relies on it).
    assert estimate_parameters(32, 4096, 11008, 32, 32, 128, 32000) == 6_738_415_616
    llama3_8b = {**LLAMA31_8B, "rope_scaling": None, "max_position_embeddings": 8192}
    assert from_hf_dict(llama3_8b).num_parameters == 8_030_261_248
    # transformers 5's DeepseekV2ForCausalLM on this config has 15,706,484,224 parameters.
    v2_lite = {"model_type": "deepseek_v2", "hidden_size": 2048, "num_attention_heads": 16,
               "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None,
               "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
               "num_hidden_layers": 27, "moe_intermediate_size": 1408, "n_routed_experts": 64,
               "n_shared_experts": 2, "first_k_dense_replace": 1, "intermediate_size": 10944,
               "vocab_size": 102400, "max_position_embeddings": 163840}  # fmt: skip
    assert from_hf_dict(v2_lite).num_parameters == 15_706_484_224 - 27 * 512
    # Low-rank q (DeepSeek-V2, 160 experts): transformers' 235,741,434,880 less the q_a and
    # kv_a layernorms; Qwen3-30B-A3B (no shared expert): its 30,532,122,624 less q/k norms;
    # Mixtral-8x7B (every expert intermediate_size wide): its 46,702,792,704 less the routers,
    # which this path leaves out (0.002%).
    v2 = {**v2_lite, "hidden_size": 5120, "num_attention_heads": 128, "num_key_value_heads": 128,
          "q_lora_rank": 1536, "num_hidden_layers": 60, "moe_intermediate_size": 1536,
          "n_routed_experts": 160, "intermediate_size": 12288}  # fmt: skip
    assert from_hf_dict(v2).num_parameters == 235_741_434_880 - 60 * (1536 + 512)
    qwen3_30b = {**QWEN3_MOE, "head_dim": 128}
    assert from_hf_dict(qwen3_30b).num_parameters == 30_532_122_624 - 48 * 2 * 128
    mixtral = {**MISTRAL_7B, "model_type": "mixtral", "num_local_experts": 8,
               "intermediate_size": 14336}  # fmt: skip
    assert from_hf_dict(mixtral).num_parameters == 46_702_792_704 - 32 * 8 * 4096


def test_llama4_dense_layers_are_intermediate_size_mlp_wide() -> None:
    """Maverick's 24 dense layers (every other one) each add three intermediate_size_mlp-wide
    matrices: one more unit of that width is 24 x 3 x hidden more parameters."""
    maverick = {**LLAMA4_TEXT, "num_local_experts": 128, "interleave_moe_layer_step": 2}
    wider = {**maverick, "intermediate_size_mlp": LLAMA4_TEXT["intermediate_size_mlp"] + 1}
    delta = from_hf_dict(wider).num_parameters - from_hf_dict(maverick).num_parameters
    assert delta == 24 * 3 * 5120


def test_rope_factors_of_one_or_below_scale_the_context_as_stated() -> None:
    """vLLM multiplies by any positive factor: 1.0 (common in published dynamic/linear blocks)
    leaves the length alone and 0.5 halves it; neither is refused as "not positive"."""
    for factor, served in [(1.0, 32768), (1, 32768), (0.5, 16384)]:
        cfg = {**QWEN25_7B, "rope_scaling": {"type": "linear", "factor": factor}}
        assert from_hf_dict(cfg).max_position_embeddings == served, factor


def test_eight_bit_integer_checkpoints_and_indivisible_head_dims() -> None:
    """GPTQ/AWQ 8-bit weights are int8 (4-bit int4), and a config without head_dim takes
    hidden_size // num_attention_heads, floored as transformers and vLLM do."""
    dense = {"num_attention_heads": 8, "hidden_size": 512, "num_hidden_layers": 2,
             "vocab_size": 100}  # fmt: skip
    for q, want in [
        ({"quant_method": "gptq", "bits": 8}, "int8"),
        ({"quant_method": "awq", "w_bit": 8}, "int8"),
        ({"quant_method": "gptq_marlin", "bits": 4}, "int4"),
    ]:
        assert from_hf_dict({**dense, "quantization_config": q}).weight_dtype == want, q
    arch = from_hf_dict({**dense, "hidden_size": 1000, "num_attention_heads": 3})
    assert arch.head_dim == 333 and isinstance(arch.head_dim, int)


def test_per_layer_mlp_widths_record_the_widest() -> None:
    """A per-layer intermediate_size list (Gemma 3n) records its widest layer: the activation
    estimate sizes the peak, not the narrowest layer."""
    cfg: dict[str, Any] = json.loads(json.dumps(GEMMA3N_E4B))
    cfg["text_config"]["intermediate_size"] = [8192] * 20 + [16384] * 15
    assert from_hf_dict(cfg, num_parameters=8_000_000_000).intermediate_size == 16384


@pytest.mark.parametrize(
    ("lengths", "served"),
    [
        ({}, 2048),  # vLLM's default where the config states no length
        ({"max_position_embeddings": 32768, "seq_length": 8192}, 8192),  # Qwen (1): the smaller
        ({"max_seq_len": 2048}, 2048),  # MPT's key
        ({"n_positions": 1024, "max_sequence_length": 4096}, 1024),
        ({"max_position_embeddings": 8192, "model_max_length": 131072}, 131072),  # Command-R
    ],
)
def test_the_context_is_the_smallest_length_the_config_states_as_vllm_serves_it(
    lengths: dict[str, int], served: int
) -> None:
    """vLLM's `_get_and_verify_max_len` takes the smallest of its length keys (Command-R's
    model_max_length over them) and 2,048 where none is stated: so does the plan."""
    assert from_hf_dict({**PLAIN, **lengths}).max_position_embeddings == served


def test_a_family_s_transformers_default_length_holds_where_the_config_leaves_it_out() -> None:
    """vLLM reads the config class, so a left-out max_position_embeddings is transformers'
    default for the family (checked against transformers itself), still under a smaller key."""
    import transformers

    from headroom.contract.budget.arch import _LENGTH_DEFAULTS

    classes = {"llama": "LlamaConfig", "mistral": "MistralConfig", "mixtral": "MixtralConfig",
               "qwen2": "Qwen2Config", "qwen2moe": "Qwen2MoeConfig", "qwen3": "Qwen3Config",
               "gemma": "GemmaConfig", "gemma2": "Gemma2Config",
               "gemma3text": "Gemma3TextConfig", "falcon": "FalconConfig",
               "deepseekv3": "DeepseekV3Config", "phi3": "Phi3Config",
               "cohere": "CohereConfig"}  # fmt: skip
    assert set(classes) == set(_LENGTH_DEFAULTS)
    for family, name in classes.items():
        default = getattr(transformers, name)().max_position_embeddings
        assert _LENGTH_DEFAULTS[family] == default, family
    assert from_hf_dict({**PLAIN, "model_type": "qwen2"}).max_position_embeddings == 32768
    qwen_short = {**PLAIN, "model_type": "qwen2", "seq_length": 8192}
    assert from_hf_dict(qwen_short).max_position_embeddings == 8192


def test_a_wrapper_s_length_is_its_text_config_s() -> None:
    """vLLM reads the lengths of a multimodal wrapper from its text_config only: a vision
    tower's seq_len at the top does not cap it."""
    wrapper = {"model_type": "llava", "seq_len": 576,
               "text_config": {**PLAIN, "max_position_embeddings": 32768}}  # fmt: skip
    assert from_hf_dict(wrapper).max_position_embeddings == 32768
