"""The KV memory model: the published arithmetic, the presets, and its invariants."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headroom.contract.budget import (
    GIB,
    GPU_PRESETS,
    MODEL_PRESETS,
    ModelArch,
    PlanInput,
    activation_reserve_bytes,
    from_hf_config,
    from_hf_dict,
    gpu_preset,
    kv_bytes_per_block,
    kv_bytes_per_token,
    kv_cache_dtype,
    kv_heads_per_rank,
    layers_per_stage,
    max_concurrent_sequences,
    model_preset,
    plan,
    replicas_needed,
    reservation_waste,
    sequence_kv_bytes,
    tp_split_error,
    usable_kv_bytes_per_gpu,
    weights_bytes,
    weights_bytes_per_gpu,
)

L70 = model_preset("llama-3.1-70b")
L8 = model_preset("llama-3.1-8b")


def test_llama_70b_bf16_kv_arithmetic() -> None:
    assert kv_bytes_per_token(L70, "bf16") == 327_680  # 2 x 80 x 8 x 128 x 2
    assert 128 * 4096 * kv_bytes_per_token(L70, "bf16") == 160 * GIB
    assert weights_bytes(L70) == pytest.approx(140e9, rel=0.02)


def test_without_gqa_is_eight_times_the_kv() -> None:
    mha = L70.model_copy(update={"num_kv_heads": 64})
    assert kv_bytes_per_token(mha) == 8 * kv_bytes_per_token(L70)


def test_fp8_halves_and_int8_pays_for_its_scales() -> None:
    bf16 = kv_bytes_per_token(L70, "bf16")
    assert kv_bytes_per_token(L70, "fp8") * 2 == bf16
    # int8: one fp32 scale per (token, kv head) for K and V on every layer.
    assert kv_bytes_per_token(L70, "int8") == bf16 // 2 + 2 * 80 * 8 * 4


# Published config.json values: (layers, attention heads, kv heads, head dim, hidden, vocab).
PUBLISHED = {
    "llama-3.1-8b": (32, 32, 8, 128, 4096, 128256),
    "llama-3.1-70b": (80, 64, 8, 128, 8192, 128256),
    "llama-3.1-405b": (126, 128, 8, 128, 16384, 128256),
    "llama-3.2-1b": (16, 32, 8, 64, 2048, 128256),
    "llama-3.2-3b": (28, 24, 8, 128, 3072, 128256),
    "mistral-7b": (32, 32, 8, 128, 4096, 32000),
    "mixtral-8x7b": (32, 32, 8, 128, 4096, 32000),
    "qwen2.5-7b": (28, 28, 4, 128, 3584, 152064),
    "qwen2.5-72b": (80, 64, 8, 128, 8192, 152064),
    "gemma-2-9b": (42, 16, 8, 256, 3584, 256000),
    "gemma-2-27b": (46, 32, 16, 128, 4608, 256000),
    "deepseek-v3": (61, 128, 128, 192, 7168, 129280),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_match_published_configs(name: str) -> None:
    m = MODEL_PRESETS[name]
    got = (
        m.num_layers,
        m.num_attention_heads,
        m.num_kv_heads,
        m.head_dim,
        m.hidden_size,
        m.vocab_size,
    )
    assert got == PUBLISHED[name]


def test_every_preset_is_tested() -> None:
    assert set(MODEL_PRESETS) == set(PUBLISHED)


def test_deepseek_mla_caches_the_latent() -> None:
    ds = model_preset("deepseek-v3")
    assert ds.attention == "MLA"
    assert kv_bytes_per_token(ds, "bf16") == 61 * (512 + 64) * 2
    # The latent is replicated, so TP does not shrink it.
    assert kv_bytes_per_token(ds, "bf16", tp=8) == kv_bytes_per_token(ds, "bf16")


def test_attention_kinds() -> None:
    assert model_preset("llama-3.1-8b").attention == "GQA"
    assert L70.model_copy(update={"num_kv_heads": 64}).attention == "MHA"
    assert L70.model_copy(update={"num_kv_heads": 1}).attention == "MQA"


def test_tp_splits_heads_and_replicates_past_kv_heads() -> None:
    assert kv_heads_per_rank(L70, 4) == 2
    assert kv_heads_per_rank(L70, 8) == 1
    assert kv_heads_per_rank(L70, 16) == 1  # replicated: never zero heads
    assert kv_bytes_per_token(L70, "bf16", tp=4) * 4 == kv_bytes_per_token(L70, "bf16")
    assert weights_bytes_per_gpu(L70, tp=4) * 4 >= weights_bytes(L70)


def test_sliding_window_layers_cap_at_the_window() -> None:
    gemma = model_preset("gemma-2-9b")
    full = sequence_kv_bytes(gemma, 8192)
    per_token = kv_bytes_per_token(gemma)
    assert full == per_token // 2 * 8192 + per_token // 2 * 4096  # half the layers are local
    assert sequence_kv_bytes(gemma, 1000) == per_token * 1000


def test_block_bytes_and_capacity() -> None:
    assert kv_bytes_per_block(L70, 16) == 16 * 327_680
    assert max_concurrent_sequences(100, 160, 16) == 10
    # 50% shared prefix of 160 tokens = 5 shared blocks stored once, 5 unique blocks each.
    assert max_concurrent_sequences(100, 160, 16, 0.5) == 19
    assert replicas_needed(128, 118) == 2


def test_reservation_waste_paged_vs_contiguous() -> None:
    contiguous, paged = reservation_waste([100, 17, 2048], 2048, 16)
    assert contiguous == pytest.approx(1 - 2165 / (3 * 2048))
    assert paged == pytest.approx(1 - 2165 / (112 + 32 + 2048))
    with pytest.raises(ValueError, match="outside"):
        reservation_waste([4000], 2048, 16)


def h100_plan(**kw: object) -> PlanInput:
    args: dict[str, object] = {
        "model": L70,
        "gpu_name": "h100-80gb",
        "tp": 4,
        "gpu_memory_bytes": gpu_preset("h100").memory_bytes,
        "concurrency": 128,
        "context": 4096,
    }
    args.update(kw)
    return PlanInput.model_validate(args)


def test_plan_worked_example() -> None:
    p = plan(h100_plan())
    assert p.feasible and p.binding == "kv-cache"
    assert p.kv_bytes_for_peak == 160 * GIB
    assert p.replicas is not None and p.replicas * p.sequences_per_pod >= 128
    fp8 = {a.change: a for a in p.alternatives}["fp8 KV"]
    assert fp8.sequences_per_pod >= 2 * p.sequences_per_pod - 1


def test_infeasible_inputs_give_a_verdict_not_an_exception() -> None:
    too_big = plan(h100_plan(model=model_preset("llama-3.1-405b"), tp=1))
    assert not too_big.feasible and too_big.binding == "weights"
    assert too_big.reason is not None and "GiB" in too_big.reason
    too_long = plan(h100_plan(context=200_000))
    assert not too_long.feasible and too_long.binding == "context"
    assert too_long.reason is not None and "131072" in too_long.reason


def test_plan_input_rejects_bad_numbers_naming_the_field() -> None:
    with pytest.raises(ValueError, match="tp 3 does not divide"):
        h100_plan(tp=3, gpus_per_pod=4)
    with pytest.raises(ValueError, match="prefix_hit"):
        h100_plan(prefix_hit=1.5)


def test_from_hf_config_reads_a_local_config(tmp_path: object) -> None:
    import pathlib

    d = pathlib.Path(str(tmp_path))
    cfg = {
        "model_type": "llama",
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16",
    }
    (d / "config.json").write_text(json.dumps(cfg))
    arch = from_hf_config(d)
    assert kv_bytes_per_token(arch) == 327_680
    assert arch.num_parameters == pytest.approx(L70.num_parameters, rel=0.01)
    with pytest.raises(FileNotFoundError):
        from_hf_config(d / "missing")


def test_budget_never_imports_torch() -> None:
    code = "import sys, headroom.contract.budget; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- invariants ----------------------------------------------------------------------------

arch_st = st.sampled_from(sorted(MODEL_PRESETS)).map(model_preset)


@settings(max_examples=200, deadline=None)
@given(
    arch=arch_st,
    mem=st.integers(16, 400),
    extra=st.integers(1, 200),
    ctx=st.integers(256, 8192),
    tp=st.sampled_from([1, 2, 4, 8]),
)
def test_capacity_monotone_in_memory_and_inverse_in_context(
    arch: object, mem: int, extra: int, ctx: int, tp: int
) -> None:
    def seqs(memory_gib: int, context: int) -> int:
        inp = PlanInput(
            model=arch,
            gpu_memory_bytes=memory_gib * GIB,
            tp=tp,
            concurrency=1,
            context=context,
            max_num_seqs=10**9,
        )
        return plan(inp).sequences_per_pod

    assert seqs(mem + extra, ctx) >= seqs(mem, ctx)
    assert seqs(mem, ctx * 2) <= seqs(mem, ctx)


@settings(max_examples=200, deadline=None)
@given(
    arch=arch_st,
    peak=st.integers(1, 5000),
    ctx=st.integers(128, 16384),
    gpu=st.sampled_from(sorted(GPU_PRESETS)),
    tp=st.sampled_from([1, 2, 4, 8]),
    kv=st.sampled_from(["bf16", "fp8", "int8"]),
    hit=st.floats(0, 0.9),
)
def test_replicas_cover_the_peak(
    arch: object, peak: int, ctx: int, gpu: str, tp: int, kv: str, hit: float
) -> None:
    inp = PlanInput.model_validate(
        {
            "model": arch,
            "gpu_memory_bytes": GPU_PRESETS[gpu].memory_bytes,
            "tp": tp,
            "concurrency": peak,
            "context": ctx,
            "kv_dtype": kv,
            "prefix_hit": hit,
        }
    )
    p = plan(inp)
    if p.feasible:
        assert p.replicas is not None
        assert p.replicas * p.sequences_per_pod >= peak
        assert (p.replicas - 1) * p.sequences_per_pod < peak  # and no more pods than needed
    else:
        assert p.reason and p.replicas is None


@given(arch=arch_st, tp=st.integers(1, 64))
def test_tp_never_increases_per_rank_kv_heads(arch: object, tp: int) -> None:
    from headroom.contract.budget import ModelArch

    assert isinstance(arch, ModelArch)
    assert kv_heads_per_rank(arch, tp) <= kv_heads_per_rank(arch, max(1, tp - 1))
    assert kv_heads_per_rank(arch, tp) >= 1


def test_a_quantized_checkpoint_is_priced_at_its_stored_width() -> None:
    # DeepSeek-V3's config says bfloat16 (its compute dtype) beside an fp8 quantization_config:
    # 671B parameters, 671 GB, not the 1.3 TB (and 12 TB from the dense MoE guess) it was.
    ds3 = {
        "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
        "first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
        "vocab_size": 129280, "max_position_embeddings": 163840, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"},
    }  # fmt: skip
    arch = from_hf_dict(ds3)
    assert arch.weight_dtype == "fp8"
    assert arch.num_parameters == pytest.approx(671e9, rel=0.01)
    assert weights_bytes(arch) == pytest.approx(671e9, rel=0.01)
    # Qwen3-MoE names its experts num_experts, each moe_intermediate_size wide: 30.5B.
    qwen = {
        "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_experts": 128, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "vocab_size": 151936, "torch_dtype": "bfloat16",
    }  # fmt: skip
    assert from_hf_dict(qwen).num_parameters == pytest.approx(30.5e9, rel=0.02)
    dense = {"num_attention_heads": 8, "hidden_size": 512, "num_hidden_layers": 2,
             "vocab_size": 100, "torch_dtype": "bfloat16"}  # fmt: skip
    cases: list[tuple[dict[str, object], str]] = [
        ({"quant_method": "compressed-tensors",
          "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float"}}}}, "fp8"),
        ({"quant_method": "compressed-tensors",
          "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}}, "int4"),
        ({"quant_method": "gptq", "bits": 4}, "int4"),
        ({"quant_method": "awq", "w_bit": 4}, "int4"),
        ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "int8"),
        ({"quant_method": "modelopt", "quant_algo": "FP8"}, "fp8"),
    ]  # fmt: skip
    for q, want in cases:
        assert from_hf_dict({**dense, "quantization_config": q}).weight_dtype == want, q
    with pytest.raises(ValueError, match="cannot tell how wide"):
        from_hf_dict({**dense, "quantization_config": {"quant_method": "mystery"}})
    # An explicit weight dtype wins over what the config says (and needs no parsing of it).
    odd = {**dense, "quantization_config": {"quant_method": "mystery"}}
    assert from_hf_dict(odd, weight_dtype="int8").weight_dtype == "int8"


def test_a_config_beyond_any_model_is_refused_naming_the_field(tmp_path: Path) -> None:
    base = {"num_attention_heads": 8, "hidden_size": 512, "num_hidden_layers": 2,
            "vocab_size": 100}  # fmt: skip
    for field, value, named in [
        ("num_hidden_layers", 1e300, "num_layers"),  # OverflowError in the weights before
        ("vocab_size", 10**12, "vocab_size"),
    ]:
        cfg = tmp_path / f"{field}.json"
        cfg.write_text(json.dumps({**base, field: value}))
        with pytest.raises(ValueError, match=f"{named}: Input should be less than"):
            from_hf_config(cfg)
    cfg = tmp_path / "layer_types.json"
    cfg.write_text(json.dumps({**base, "sliding_window": 64, "layer_types": ["sliding_attention"]}))
    with pytest.raises(ValueError, match="layer_types lists 1 layers but num_hidden_layers is 2"):
        from_hf_config(cfg)


def test_tp_split_names_what_vllm_and_sglang_refuse() -> None:
    assert tp_split_error(L8, 1) is None and tp_split_error(L8, 8) is None
    assert "does not divide llama-3.1-8b's 32 attention heads" in (tp_split_error(L8, 3) or "")
    assert tp_split_error(L70, 16) is None  # 8 KV heads, each replicated twice
    odd = L8.model_copy(update={"num_attention_heads": 48, "num_kv_heads": 8})
    assert "neither divides nor is a multiple of" in (tp_split_error(odd, 12, "--tp") or "")


def test_reserved_blocks_hold_no_sequence() -> None:
    # vLLM keeps one block of --num-gpu-blocks-override N as its null block: a pool of exactly
    # two sequences' blocks holds one there.
    block = kv_bytes_per_block(L8, 16)
    memory = weights_bytes(L8) + 2 * 64 * block  # two 1,024-token sequences
    common = dict(model=L8, gpu_memory_bytes=memory, concurrency=2, context=1024,
                  gpu_memory_utilization=1.0, activation_reserve_bytes=0)  # fmt: skip
    free = plan(PlanInput(**common))  # type: ignore[arg-type]
    held = plan(PlanInput(**common, reserved_blocks=1))  # type: ignore[arg-type]
    assert free.kv_blocks_per_pod == held.kv_blocks_per_pod == 128
    assert (free.sequences_per_pod, held.sequences_per_pod) == (2, 1)
    assert (free.replicas, held.replicas) == (1, 2)


def test_a_qwen2_config_windows_only_what_transformers_windows(tmp_path: Path) -> None:
    # use_sliding_window defaults to False, and True windows only the layers from
    # max_window_layers on: the plan windowed every layer, undercounting the KV per sequence.
    qwen = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 1000,
            "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 8,
            "num_attention_heads": 8, "num_key_value_heads": 2, "sliding_window": 256,
            "max_window_layers": 6, "max_position_embeddings": 32768}  # fmt: skip
    per_seq = {}
    for name, extra, windowed in [
        ("off", {}, 0),
        ("on", {"use_sliding_window": True}, 2),
        ("all", {"use_sliding_window": True, "max_window_layers": 0}, 8),
    ]:
        cfg = tmp_path / f"{name}.json"
        cfg.write_text(json.dumps({**qwen, **extra}))
        arch = from_hf_config(cfg)
        assert arch.num_sliding_window_layers == windowed, name
        per_seq[name] = sequence_kv_bytes(arch, 4096)
    assert per_seq["off"] / per_seq["on"] == pytest.approx(8 / (6 + 2 * 256 / 4096))
    assert per_seq["off"] / per_seq["all"] == pytest.approx(4096 / 256)
    # Layers a Llama config says nothing of windows for: a stray key changes nothing.
    llama = {**qwen, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    assert from_hf_dict(llama).num_sliding_window_layers == 0
    gemma2 = {**qwen, "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}
    assert from_hf_dict(gemma2).num_sliding_window_layers == 4


def test_kv_element_width_follows_the_stored_dtype() -> None:
    """fp16 KV is as wide as bf16 and fp32 twice that; `auto` reads the compute dtype."""
    bf16 = kv_bytes_per_token(L70, "bf16")
    assert kv_bytes_per_token(L70, "fp16") == bf16
    assert kv_bytes_per_token(L70, "fp32") == 2 * bf16
    assert kv_cache_dtype("auto", "torch.float16") == "fp16"
    assert kv_cache_dtype("auto", "bf16") == "bf16"
    assert kv_cache_dtype("fp8", "torch.bfloat16") == "fp8"
    with pytest.raises(ValueError, match="KV cannot be stored as 'int4'"):
        kv_cache_dtype("auto", "int4")


def test_mla_int8_pays_one_scale_per_token_and_layer() -> None:
    """MLA's int8 cache is the one-byte latent plus one fp32 scale for its single shared head."""
    ds = model_preset("deepseek-v3")
    assert kv_bytes_per_token(ds, "int8") == 61 * (512 + 64 + 4)
    assert kv_bytes_per_token(ds, "int8", tp=8) == kv_bytes_per_token(ds, "int8")


def test_pipeline_stages_split_layers_and_weights() -> None:
    """pp stages each hold ceil(layers / pp) layers and 1 / (tp x pp) of the weights."""
    assert layers_per_stage(L70) == 80 and kv_heads_per_rank(L70) == 8
    assert weights_bytes_per_gpu(L70) == weights_bytes(L70)
    assert layers_per_stage(L70, 3) == 27  # the most loaded stage of 27 + 27 + 26
    assert kv_bytes_per_token(L70, "bf16", tp=4, pp=3) == 27 * 2 * 2 * 128 * 2
    assert kv_bytes_per_block(L70, 16, "bf16", tp=4, pp=2) == 16 * 40 * 2 * 2 * 128 * 2
    assert weights_bytes_per_gpu(L70, tp=2, pp=2) == -(-weights_bytes(L70) // 4)
    assert weights_bytes_per_gpu(L70, tp=4, pp=2) == -(-weights_bytes(L70) // 8)
    # Every layer windowed: each of 2 stages holds 21 layers of 4,096 tokens.
    windowed = model_preset("gemma-2-9b").model_copy(update={"num_sliding_window_layers": 42})
    per_layer = 2 * 8 * 256 * 2
    assert sequence_kv_bytes(windowed, 8192, pp=2) == per_layer * 21 * 4096


def test_parallel_sizes_and_block_size_below_one_are_refused() -> None:
    """tp, pp and block size of 0 are errors naming the setting, not a 0-division or 0 bytes."""
    with pytest.raises(ValueError, match="tensor parallel size must be >= 1"):
        kv_heads_per_rank(L8, 0)
    with pytest.raises(ValueError, match="pipeline parallel size must be >= 1"):
        layers_per_stage(L8, 0)
    with pytest.raises(ValueError, match="block size must be >= 1"):
        kv_bytes_per_block(L8, 0)
    assert kv_bytes_per_block(L8, 1) == kv_bytes_per_token(L8)


def test_activation_reserve_is_a_gib_plus_four_bf16_prefill_buffers() -> None:
    """1 GiB + max_num_batched_tokens x (hidden + MLP width / tp) x 2 bytes x 4 buffers."""
    assert activation_reserve_bytes(L8) == GIB + 8192 * (4096 + 14336) * 2 * 4
    assert activation_reserve_bytes(L8, 2) == GIB + 8192 * (4096 + 14336 // 2) * 2 * 4
    assert activation_reserve_bytes(L8, 1, 2048) == GIB + 2048 * (4096 + 14336) * 2 * 4
    # Without an intermediate size the MLP is taken as 4 x hidden; bytes stay whole.
    no_mlp = L8.model_copy(update={"intermediate_size": None})
    assert activation_reserve_bytes(no_mlp, 3) == GIB + 8192 * (4096 + 16384 // 3) * 2 * 4
    assert isinstance(activation_reserve_bytes(no_mlp, 3), int)


def test_usable_kv_is_the_utilized_memory_less_weights_and_reserve() -> None:
    """Utilization must lie in (0, 1]; what it leaves may go negative to flag a misfit."""
    assert usable_kv_bytes_per_gpu(100 * GIB, 60 * GIB, 5 * GIB) == 25 * GIB
    assert usable_kv_bytes_per_gpu(100 * GIB, 60 * GIB, 5 * GIB, 1.0) == 35 * GIB
    assert usable_kv_bytes_per_gpu(10 * GIB, 9 * GIB, 2 * GIB, 1.0) == -GIB
    for bad in (0.0, 1.01):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            usable_kv_bytes_per_gpu(100 * GIB, 0, 0, bad)


def test_capacity_edges_prefix_bounds_and_an_empty_pod() -> None:
    """A prefix ratio must lie in [0, 1); a pool smaller than the shared prefix holds nothing;
    a pod that holds no sequence cannot be replicated to cover a peak."""
    assert max_concurrent_sequences(10, 160, 16, 0.0) == 1
    assert max_concurrent_sequences(4, 160, 16, 0.5) == 0  # 5 shared blocks do not fit in 4
    assert max_concurrent_sequences(9, 160, 16) == 0
    assert max_concurrent_sequences(1, 16, 16) == 1
    # 50 shared tokens are 3 whole shared blocks: (100 - 3) // (7 - 3), a whole count.
    assert max_concurrent_sequences(100, 100, 16, 0.5) == 24
    assert isinstance(max_concurrent_sequences(100, 100, 16, 0.5), int)
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="prefix hit ratio"):
            max_concurrent_sequences(100, 160, 16, bad)
    assert replicas_needed(1, 1) == 1 and replicas_needed(0, 5) == 1
    assert replicas_needed(10, 5) == 2 and replicas_needed(11, 5) == 3
    with pytest.raises(ValueError, match="holds no sequence"):
        replicas_needed(1, 0)


def test_reservation_waste_of_no_sequences_is_none_and_empty_ones_are_refused() -> None:
    """No sequences waste nothing; a zero-length sequence is outside (0, max_model_len]."""
    assert reservation_waste([], 2048, 16) == (0.0, 0.0)
    assert reservation_waste([2048], 2048, 16) == (0.0, 0.0)
    assert reservation_waste([1], 16, 16) == (1 - 1 / 16, 1 - 1 / 16)
    with pytest.raises(ValueError, match="outside"):
        reservation_waste([0], 2048, 16)


def l8_plan(**kw: object) -> PlanInput:
    """Llama-3.1-8B, no activation reserve, the whole GPU and a pool of exactly 128 blocks:
    two 1,024-token sequences."""
    args: dict[str, object] = {
        "model": L8,
        "gpu_memory_bytes": weights_bytes(L8) + 128 * kv_bytes_per_block(L8, 16),
        "gpu_memory_utilization": 1.0,
        "activation_reserve_bytes": 0,
        "concurrency": 1,
        "context": 1024,
    }
    args.update(kw)
    return PlanInput.model_validate(args)


def test_plan_input_defaults_are_vllms() -> None:
    """Unset knobs take vLLM 0.11's defaults: block 16, 90% of memory, 256 seqs, 8192 tokens."""
    inp = PlanInput(model=L8, gpu_memory_bytes=80 * GIB, concurrency=1, context=1)
    assert (inp.tp, inp.pp, inp.pod_gpus, inp.block_size) == (1, 1, 1, 16)
    assert (inp.gpu_memory_utilization, inp.max_num_seqs, inp.max_num_batched_tokens) == (
        0.9,
        256,
        8192,
    )
    assert (inp.prefix_hit, inp.reserved_blocks, inp.activation_reserve_bytes) == (0.0, 0, None)
    assert inp.kv_dtype == "auto" and inp.resolved_kv_dtype == "bf16"
    with pytest.raises(ValueError, match="frozen"):
        inp.tp = 2  # type: ignore[misc]
    with pytest.raises(ValueError, match="Extra inputs"):
        PlanInput(model=L8, gpu_memory_bytes=1, concurrency=1, context=1, pp=2)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("field", "edge", "past"),
    [
        ("gpu_memory_bytes", 1, 0),
        ("tp", 1, 0),
        ("tp", 64, 65),
        ("gpus_per_pod", 1, 0),
        ("gpus_per_pod", 64, 65),
        ("concurrency", 1, 0),
        ("concurrency", 10_000_000, 10_000_001),
        ("context", 1, 0),
        ("context", 10_000_000, 10_000_001),
        ("prefix_hit", 0.0, -0.01),
        ("prefix_hit", 0.99, 1.0),
        ("block_size", 1, 0),
        ("block_size", 1024, 1025),
        ("gpu_memory_utilization", 0.01, 0.0),
        ("gpu_memory_utilization", 1.0, 1.01),
        ("max_num_seqs", 1, 0),
        ("max_num_batched_tokens", 1, 0),
        ("activation_reserve_bytes", 0, -1),
        ("reserved_blocks", 0, -1),
        ("reserved_blocks", 1024, 1025),
    ],
)
def test_plan_input_bounds_take_the_edge_and_refuse_past_it(
    field: str, edge: object, past: object
) -> None:
    """Each bound sits where the CRD's does: the edge is taken, one step past names the field."""
    base = {"model": L8, "gpu_memory_bytes": 80 * GIB, "concurrency": 1, "context": 1}
    pod = {"gpus_per_pod": edge} if field == "tp" else {}
    assert getattr(PlanInput.model_validate({**base, **pod, field: edge}), field) == edge
    with pytest.raises(ValueError, match=rf"\n{field}\n  Input should be"):
        PlanInput.model_validate({**base, field: past})


def test_plan_under_pipeline_parallelism_prices_one_stage_per_gpu() -> None:
    """gpus_per_pod = tp x pp: each GPU holds half the layers and an eighth of the weights."""
    inp = h100_plan(gpus_per_pod=8, max_num_seqs=10**6)
    assert inp.pp == 2 and isinstance(inp.pp, int)
    p = plan(inp)
    assert (p.tp, p.pp, p.gpus_per_pod) == (4, 2, 8)
    assert p.kv_bytes_per_token == 327_680
    assert p.kv_bytes_per_token_per_gpu == 327_680 // 8
    assert p.weights_bytes_per_gpu == -(-weights_bytes(L70) // 8)
    reserve = GIB + 8192 * (8192 + 28672 // 4) * 2 * 4
    assert p.activation_reserve_bytes_per_gpu == reserve
    usable = int(gpu_preset("h100").memory_bytes * 0.9) - p.weights_bytes_per_gpu - reserve
    assert p.kv_bytes_per_gpu == usable
    assert p.kv_blocks_per_pod == usable // (16 * 40_960)
    assert p.kv_tokens_per_pod == 16 * p.kv_blocks_per_pod
    assert p.sequences_per_pod == p.kv_blocks_per_pod // 256 and p.binding == "kv-cache"
    assert p.gpus_total == 8 * (p.replicas or 0) and p.replicas == 1
    assert p.kv_bytes_for_peak == 128 * 4096 * 327_680


def test_plan_binding_at_each_boundary() -> None:
    """Exactly at a limit still fits: context = max positions, seqs = max_num_seqs, a pool
    of exactly one sequence; no KV byte left at all is the weights' fault."""
    at_max = plan(l8_plan(context=131_072, gpu_memory_bytes=10**12))
    assert at_max.feasible and at_max.binding == "kv-cache"
    assert plan(l8_plan(context=131_073)).binding == "context"
    exact = plan(l8_plan(max_num_seqs=2))
    assert (exact.binding, exact.sequences_per_pod, exact.replicas) == ("kv-cache", 2, 1)
    capped = plan(l8_plan(max_num_seqs=1, concurrency=3))
    assert (capped.binding, capped.sequences_per_pod, capped.replicas) == ("max-num-seqs", 1, 3)
    one = plan(l8_plan(context=2048))
    assert one.feasible and (one.sequences_per_pod, one.replicas) == (1, 1)
    assert plan(l8_plan(context=2049)).feasible is False
    no_kv = plan(l8_plan(gpu_memory_bytes=weights_bytes(L8)))
    assert (no_kv.feasible, no_kv.binding, no_kv.kv_bytes_per_gpu) == (False, "weights", 0)
    assert no_kv.kv_blocks_per_pod == 0 and no_kv.replicas is None and no_kv.gpus_total is None
    under = plan(l8_plan(gpu_memory_bytes=weights_bytes(L8) - 1))
    assert (under.binding, under.kv_bytes_per_gpu, under.kv_blocks_per_pod) == ("weights", 0, 0)
    one_byte = plan(l8_plan(gpu_memory_bytes=weights_bytes(L8) + 1))
    assert (one_byte.binding, one_byte.kv_bytes_per_gpu, one_byte.kv_blocks_per_pod) == (
        "kv-cache",
        1,
        0,
    )


def test_infeasible_reasons_state_the_figures_a_user_acts_on() -> None:
    """The weights and KV refusals print the GiB that do not fit, and the engine's own blocks."""
    weights = plan(l8_plan(gpu_memory_bytes=16 * GIB, gpu_memory_utilization=0.5,
                           activation_reserve_bytes=GIB, context=10))  # fmt: skip
    assert weights.reason == (
        "weights 15.0 GiB/GPU + reserve 1.0 GiB exceed 50% of 16.0 GiB (8.0 GiB); "
        "use more GPUs per pod (tp) or a smaller weight dtype"
    )
    memory = weights_bytes_per_gpu(L8, 2) + GIB + GIB // 4
    kv = plan(l8_plan(tp=2, gpu_memory_bytes=memory, activation_reserve_bytes=GIB, context=8192))
    assert (kv.feasible, kv.binding, kv.alternatives) == (False, "kv-cache", [])
    assert kv.reason == (
        "one 8192-token sequence needs 0.50 GiB of KV per GPU but only 0.25 GiB is left after "
        "weights 7.5 GiB and reserve 1.0 GiB"
    )
    held = plan(l8_plan(gpu_memory_bytes=weights_bytes(L8) + 64 * kv_bytes_per_block(L8, 16),
                        reserved_blocks=1))  # fmt: skip
    assert held.reason is not None and held.reason.endswith(
        " (64 blocks, 1 of them the engine's own)"
    )
    assert held.kv_blocks_per_pod == 64 and held.sequences_per_pod == 0
    # The engine's own blocks can take the whole pool: not even a one-block sequence fits.
    for reserved in (128, 200):
        all_held = plan(l8_plan(reserved_blocks=reserved, context=16))
        assert (all_held.feasible, all_held.sequences_per_pod) == (False, 0), reserved


def test_alternatives_offer_only_changes_not_already_made() -> None:
    """fp8 KV is offered over a wider cache, 50% prefix hit over none; both obey max_num_seqs."""
    base = plan(l8_plan(concurrency=5))
    alts = {a.change: (a.sequences_per_pod, a.replicas) for a in base.alternatives}
    # fp8 halves a token: 4 sequences where 2 fit; 32 shared blocks leave 96, 32 a sequence.
    assert alts == {"fp8 KV": (4, 2), "prefix hit 50%": (3, 2)}
    capped = plan(l8_plan(concurrency=5, max_num_seqs=2))
    assert {a.sequences_per_pod for a in capped.alternatives} == {2}
    assert [a.change for a in plan(l8_plan(kv_dtype="fp8")).alternatives] == ["prefix hit 50%"]
    assert [a.change for a in plan(l8_plan(kv_dtype="int8")).alternatives] == ["prefix hit 50%"]
    assert [a.change for a in plan(l8_plan(prefix_hit=0.25)).alternatives] == ["fp8 KV"]
    assert plan(l8_plan(kv_dtype="fp8", prefix_hit=0.25)).alternatives == []


def test_auto_kv_follows_an_fp16_checkpoint_and_explicit_settings_win() -> None:
    """`auto` stores KV as fp16 for fp16 weights, bf16 otherwise; a named dtype is kept."""
    fp16 = L8.model_copy(update={"weight_dtype": "fp16"})
    assert l8_plan(model=fp16).resolved_kv_dtype == "fp16"
    assert plan(l8_plan(model=fp16)).kv_dtype == "fp16"
    assert l8_plan(model=fp16, kv_dtype="fp8").resolved_kv_dtype == "fp8"
    assert l8_plan(kv_dtype="int8").resolved_kv_dtype == "int8"


@pytest.mark.parametrize(
    ("windowed", "pp", "full", "sliding"),
    [(2, 2, 4, 0), (2, 1, 6, 2), (6, 2, 2, 2), (8, 4, 0, 2), (21, 2, 21, 0), (0, 3, 3, 0)],
)
def test_the_busiest_pipeline_stage_holds_every_full_attention_layer_it_can(
    windowed: int, pp: int, full: int, sliding: int
) -> None:
    """Which layers a stage gets is not recorded (Qwen2 windows its top layers, so its first
    stage has none), so a sequence is priced on a stage with as many full-attention layers as
    fit; the stages' average undercounted Qwen2's first stage by 23 % at pp 2."""
    arch = ModelArch(
        name="windowed", num_layers=8 if windowed < 21 else 42, num_attention_heads=8,
        num_kv_heads=2, head_dim=64, hidden_size=512, vocab_size=1000,
        max_position_embeddings=32768, num_parameters=10**6, sliding_window=256,
        num_sliding_window_layers=windowed,
    )  # fmt: skip
    per_layer = kv_bytes_per_token(arch) // arch.num_layers
    got = sequence_kv_bytes(arch, 4096, pp=pp)
    assert got == per_layer * (full * 4096 + sliding * 256)


def test_every_preset_names_the_architecture_the_engines_are_told_about() -> None:
    """The operator refuses, for the headroom engine, exactly the presets whose class its
    decoder lacks; the engine's own list is the contract's."""
    from headroom.contract.budget.presets import (
        HEADROOM_ENGINE_ARCHITECTURES,
        NOT_HEADROOM_ENGINE_PRESETS,
        PRESET_ARCHITECTURES,
    )
    from headroom.engine.model.config import SUPPORTED_ARCHITECTURES

    assert set(PRESET_ARCHITECTURES) == set(MODEL_PRESETS)
    assert SUPPORTED_ARCHITECTURES is HEADROOM_ENGINE_ARCHITECTURES
    assert NOT_HEADROOM_ENGINE_PRESETS == (
        "mixtral-8x7b",
        "gemma-2-9b",
        "gemma-2-27b",
        "deepseek-v3",
    )
    assert all(
        MODEL_PRESETS[p].kv_lora_rank is None
        for p in PRESET_ARCHITECTURES
        if p not in NOT_HEADROOM_ENGINE_PRESETS
    )
