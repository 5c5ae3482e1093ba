"""spec -> PlanInput -> plan: status.budget is what `headroom plan` says for the same inputs."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from headroom.contract import plan_cli
from headroom.contract.budget import GIB, plan
from headroom.operator.crd.models import InferenceDeploymentSpec, ModelSpec
from headroom.operator.reconcile.sizing import (
    SpecError,
    blocks_per_sequence,
    budget,
    model_arch,
    plan_input,
    served_model_name,
    size,
    summary,
)


def spec(**sections: dict[str, Any]) -> InferenceDeploymentSpec:
    raw: dict[str, Any] = {
        "model": {"preset": "llama-3.1-8b"},
        "gpu": {"type": "h100-80gb"},
        "traffic": {"peakConcurrency": 400, "contextTokens": 4096},
    }
    raw.update(sections)
    return InferenceDeploymentSpec.model_validate(raw)


def headroom_plan(*argv: str) -> Any:
    parser = argparse.ArgumentParser()
    plan_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    return plan(plan_cli.build_input(args))


CASES = [
    ({}, ["--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--concurrency", "400",
          "--context", "4096"]),
    ({"gpu": {"type": "h100", "countPerPod": 4},
      "model": {"preset": "llama-3.1-70b", "path": "/models/70b"}, "engine": {"runtime": "vllm"}},
     ["--model", "llama-3.1-70b", "--gpu", "h100", "--tp", "4", "--concurrency", "400",
      "--context", "4096"]),
    ({"engine": {"kvCacheDtype": "fp8", "blockSize": 32}},
     ["--model", "llama-3.1-8b", "--kv-dtype", "fp8", "--block-size", "32", "--concurrency",
      "400", "--context", "4096"]),
    ({"traffic": {"peakConcurrency": 64, "contextTokens": 32768, "prefixHitRatio": 0.5},
      "gpu": {"type": "a100-80gb", "countPerPod": 2, "tensorParallel": 1},
      "model": {"preset": "llama-3.1-8b", "path": "/models/8b"}, "engine": {"runtime": "sglang"}},
     ["--model", "llama-3.1-8b", "--gpu", "a100-80gb", "--tp", "1", "--gpus-per-pod", "2",
      "--concurrency", "64", "--context", "32768", "--prefix-hit", "0.5"]),
    ({"engine": {"gpuMemoryUtilization": 0.8, "maxNumSeqs": 64}},
     ["--model", "llama-3.1-8b", "--gpu-memory-utilization", "0.8", "--max-num-seqs", "64",
      "--concurrency", "400", "--context", "4096"]),
]  # fmt: skip


@pytest.mark.parametrize(("sections", "argv"), CASES)
def test_budget_equals_headroom_plan(sections: dict[str, Any], argv: list[str]) -> None:
    mine = size(spec(**sections)).plan
    theirs = headroom_plan(*argv)
    assert mine.model_dump(exclude={"gpu"}) == theirs.model_dump(exclude={"gpu"})
    b = budget(size(spec(**sections)))
    assert b.kv_blocks_per_pod == theirs.kv_blocks_per_pod
    assert b.kv_bytes_per_token == theirs.kv_bytes_per_token
    assert b.sized_replicas == theirs.replicas


def test_prefix_caching_off_ignores_the_hit_ratio() -> None:
    on = spec(traffic={"peakConcurrency": 400, "contextTokens": 4096, "prefixHitRatio": 0.5})
    off = spec(
        traffic={"peakConcurrency": 400, "contextTokens": 4096, "prefixHitRatio": 0.5},
        engine={"prefixCaching": False},
    )
    assert plan_input(on).prefix_hit == 0.5 and plan_input(off).prefix_hit == 0.0
    assert size(on).plan.sequences_per_pod > size(off).plan.sequences_per_pod


def test_weights_that_do_not_fit_are_infeasible_with_the_arithmetic() -> None:
    s = size(spec(model={"preset": "llama-3.1-70b"}))
    assert not s.feasible
    assert s.reason is not None and "weights 131.4 GiB/GPU" in s.reason
    assert "tp" in s.reason
    assert budget(s).sized_replicas is None and not budget(s).feasible


def test_max_model_len_that_does_not_fit_is_infeasible() -> None:
    s = size(spec(gpu={"type": "l4"}, engine={"maxModelLen": 131072}))
    assert not s.feasible and s.reason is not None
    assert "131072-token sequence" in s.reason and "GiB" in s.reason
    assert size(spec(gpu={"type": "l4"}, engine={"maxModelLen": 8192})).feasible


def test_max_model_len_beyond_the_model_is_infeasible() -> None:
    s = size(spec(engine={"maxModelLen": 200_000}))
    assert not s.feasible and "max_position_embeddings" in (s.reason or "")


# DeepSeek-V3.2's numbers as a CRD gives them (its config.json's), with and without its indexer.
V32_MODEL = {
    "numLayers": 61, "numAttentionHeads": 128, "numKVHeads": 128, "headDim": 192,
    "hiddenSize": 7168, "vocabSize": 129280, "parameterCount": 671_000_000_000,
    "maxPositionEmbeddings": 163840, "kvLoraRank": 512, "qkRopeHeadDim": 64,
    "weightDtype": "fp8", "path": "/models/v32",
}  # fmt: skip


@pytest.mark.parametrize(
    ("kv", "v32_bytes", "v3_bytes"),
    [("auto", 61 * (656 + 132), 61 * 576 * 2), ("fp8", 61 * (656 + 132), 61 * 576)],
)
def test_deepseek_v32_through_the_crd_is_priced_with_its_indexer(
    kv: str, v32_bytes: int, v3_bytes: int
) -> None:
    """indexHeadDim prices vLLM's fp8_ds_mla latent plus the indexer's key (auto runs as fp8),
    as `plan --model-config` does for the same config.json. Without it the spec is priced as
    V3: under fp8 about 27 % short of what vLLM allocates, so the pool it is given overflows."""
    sections: dict[str, Any] = {
        "gpu": {"type": "h200-141gb", "countPerPod": 8},
        "engine": {"runtime": "vllm", "kvCacheDtype": kv},
        "traffic": {"peakConcurrency": 256, "contextTokens": 32768},
    }
    assert (
        size(spec(model={**V32_MODEL, "indexHeadDim": 128}, **sections)).plan.kv_bytes_per_token
        == v32_bytes
    )
    assert size(spec(model=V32_MODEL, **sections)).plan.kv_bytes_per_token == v3_bytes


def test_deepseek_v32_with_int8_kv_is_an_invalid_spec() -> None:
    """vLLM has no int8 for sparse MLA: the spec is refused with the plan's reason."""
    s = spec(
        model={**V32_MODEL, "indexHeadDim": 128},
        gpu={"type": "h200-141gb"},
        engine={"kvCacheDtype": "int8"},
        traffic={"peakConcurrency": 8, "contextTokens": 4096},
    )
    with pytest.raises(SpecError, match="int8"):
        plan_input(s)


def test_custom_architecture_and_memory() -> None:
    s = spec(
        model={
            "numLayers": 2, "numAttentionHeads": 4, "numKVHeads": 2, "headDim": 16,
            "hiddenSize": 64, "vocabSize": 256, "parameterCount": 100_000,
            "servedModelName": "tiny",
        },
        gpu={"memoryGiB": 2},
        traffic={"peakConcurrency": 8, "contextTokens": 256},
    )  # fmt: skip
    inp = plan_input(s)
    assert inp.gpu_memory_bytes == 2 * GIB and inp.model.num_kv_heads == 2
    assert inp.model.max_position_embeddings == 256  # defaults to what the engine is given
    # 2 (K,V) x 2 layers x 2 heads x 16 dims x 2 bytes
    assert size(s).plan.kv_bytes_per_token == 256
    assert served_model_name(s, "res") == "tiny"


def test_summary_and_blocks_per_sequence() -> None:
    s = spec(traffic={"peakConcurrency": 400, "contextTokens": 4096, "prefixHitRatio": 0.25})
    text = summary(size(s))
    assert "B/token/GPU" in text and "pod(s)" in text
    assert blocks_per_sequence(s, size(s).plan.block_size) == 256 * 0.75
    assert served_model_name(s, "res") == "llama-3.1-8b"


@pytest.mark.parametrize(
    ("model", "tp", "refused"),
    [
        ({"preset": "llama-3.1-8b"}, 2, None),  # 32 heads, 8 KV heads: both split
        ({"preset": "llama-3.1-8b"}, 3, "does not divide llama-3.1-8b's 32 attention heads"),
        ({"preset": "llama-3.1-8b"}, 16, None),  # 8 KV heads replicated twice
        # 48 heads split 12 ways, but 8 KV heads neither split 12 ways nor replicate evenly.
        ({"numLayers": 8, "numAttentionHeads": 48, "numKVHeads": 8, "headDim": 64,
          "hiddenSize": 3072, "vocabSize": 32000, "maxPositionEmbeddings": 8192,
          "parameterCount": 1_000_000_000}, 12, "neither divides nor is a multiple"),
    ],
)  # fmt: skip
def test_a_tensor_parallel_size_the_stock_engines_refuse_is_an_invalid_spec(
    model: dict[str, Any], tp: int, refused: str | None
) -> None:
    s = spec(
        model={**model, "path": "/models/m"},
        gpu={"type": "h200", "countPerPod": tp},  # type: ignore[dict-item]
        engine={"runtime": "vllm"},
    )
    if refused is None:
        assert size(s).plan.tp == tp
    else:
        with pytest.raises(SpecError, match=refused):
            size(s)


def test_infeasible_weights_on_the_headroom_engine_point_at_a_stock_runtime() -> None:
    sizing = size(spec(model={"preset": "llama-3.1-70b"}))
    assert not sizing.feasible and sizing.reason is not None
    assert "several GPUs per pod need engine.runtime vllm or sglang" in sizing.reason
    # A stock runtime on one GPU: more GPUs per pod is the advice as it stands.
    stock = size(spec(model={"preset": "llama-3.1-70b", "path": "/m"}, engine={"runtime": "vllm"}))
    assert stock.reason is not None and "engine.runtime" not in stock.reason


def test_a_context_past_the_model_s_positions_does_not_point_at_more_gpus() -> None:
    """No runtime or GPU count lifts a context past max_position_embeddings: the headroom
    engine's "several GPUs per pod" advice is left out there."""
    sizing = size(spec(traffic={"peakConcurrency": 4, "contextTokens": 200_000}))
    assert not sizing.feasible and sizing.plan.binding == "context"
    assert sizing.reason is not None and "max_position_embeddings 131072" in sizing.reason
    assert "several GPUs" not in sizing.reason


def test_a_preset_s_weight_dtype_override_is_priced() -> None:
    """model.weightDtype on a preset replaces the preset's: fp8 weights are half of bf16's."""
    vllm = {"runtime": "vllm"}  # the headroom engine loads no fp8 checkpoint
    fp8_spec = spec(
        model={"preset": "llama-3.1-8b", "weightDtype": "fp8", "path": "/m"}, engine=vllm
    )
    fp8 = size(fp8_spec)
    bf16 = size(spec(model={"preset": "llama-3.1-8b", "path": "/m"}, engine=vllm))
    assert plan_input(fp8_spec).model.weight_dtype == "fp8"
    assert fp8.plan.weights_bytes_per_gpu * 2 == bf16.plan.weights_bytes_per_gpu
    assert fp8.plan.kv_blocks_per_pod > bf16.plan.kv_blocks_per_pod


def test_an_infeasible_sizing_still_counts_one_pod() -> None:
    """Sizing.replicas is 1 when the plan has none, so callers need not special-case it."""
    s = size(spec(model={"preset": "llama-3.1-70b"}))
    assert not s.feasible and s.plan.replicas is None and s.replicas == 1
    feasible = size(spec())
    assert feasible.replicas == feasible.plan.replicas == 4


def test_blocks_per_sequence_without_prefix_caching_and_its_floor() -> None:
    """Without prefix caching a request claims all its blocks; with any hit, at least one."""
    hit = {"peakConcurrency": 400, "contextTokens": 4096, "prefixHitRatio": 0.5}
    off = spec(traffic=hit, engine={"prefixCaching": False})
    assert blocks_per_sequence(off, 16) == 256
    one = spec(traffic={"peakConcurrency": 8, "contextTokens": 16, "prefixHitRatio": 0.5})
    assert blocks_per_sequence(one, 16) == 1.0  # half a block's worth still takes one


def test_summary_states_the_kv_per_gpu_in_gib() -> None:
    """The describe line's figures are the plan's, in GiB where it says GiB."""
    s = size(spec())
    p = s.plan
    assert f"{p.kv_bytes_per_gpu / GIB:.1f} GiB KV per GPU" in summary(s)
    assert f"= {p.kv_blocks_per_pod:,} blocks of 16 tokens per pod" in summary(s)


def _sized_with_pool(blocks: int, max_model_len: int, runtime: str = "vllm") -> Any:
    """A runtime sized (contextTokens 4096) on the least GPU memory that plans `blocks` blocks."""

    def sizing(gib: float) -> Any:
        return size(spec(model={"preset": "llama-3.1-8b", "path": "/m"},
                         gpu={"memoryGiB": gib},
                         engine={"runtime": runtime, "prefixCaching": False,
                                 "maxModelLen": max_model_len}))  # fmt: skip

    lo, hi = 16.0, 64.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if sizing(mid).plan.kv_blocks_per_pod >= blocks else (mid, hi)
    s = sizing(hi)
    assert s.plan.kv_blocks_per_pod == blocks and s.plan.feasible
    return s


def test_max_model_len_past_the_pool_counts_vllm_s_null_block() -> None:
    """engine.maxModelLen above contextTokens: the plan fits, but vLLM's pool of N blocks gives
    sequences N - 1, so a maxModelLen of exactly N blocks cannot run there (SGLang's can), and
    the reason states the one sequence's KV in GiB and the engine's own block."""
    need = 131072 // 16
    on_vllm = _sized_with_pool(need, 131072)
    assert not on_vllm.feasible and on_vllm.reason is not None
    p = on_vllm.plan
    assert on_vllm.reason == (
        "one 131072-token sequence (engine.maxModelLen) needs 16.00 GiB of KV per GPU but only "
        f"{p.kv_bytes_per_gpu / GIB:.2f} GiB is left after weights "
        f"{p.weights_bytes_per_gpu / GIB:.1f} GiB and reserve "
        f"{p.activation_reserve_bytes_per_gpu / GIB:.1f} GiB; lower maxModelLen or add GPUs per "
        f"pod ({need:,} blocks, 1 of them the engine's own)"
    )
    assert "16.00 GiB is left after weights 15.0 GiB" in on_vllm.reason  # 8192 blocks x 2 MiB
    assert budget(on_vllm).sized_replicas is None
    assert _sized_with_pool(need, 131072, "sglang").feasible
    # One block fewer in maxModelLen fits beside the null block.
    assert _sized_with_pool(need, 131072 - 16).feasible


def test_an_architecture_the_budget_refuses_is_a_spec_error() -> None:
    """Should the CRD's bounds drift from ModelArch's, the spec is refused with the field named,
    never with an uncaught ValidationError (parse() promises an error, not an exception)."""
    model = ModelSpec.model_construct(
        num_layers=2000, num_attention_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64,
        vocab_size=256, parameter_count=100_000,
    )  # fmt: skip
    with pytest.raises(SpecError, match=r"^model architecture: num_layers: .*1024"):
        model_arch(model, 256)


@pytest.mark.parametrize(
    ("model", "why"),
    [
        ({**V32_MODEL, "weightDtype": "bf16"}, "model.kvLoraRank makes it an MLA model"),
        (
            {"preset": "gemma-2-27b", "path": "/m"},
            "model.preset gemma-2-27b is a Gemma2ForCausalLM",
        ),
        ({"preset": "qwen2.5-7b", "weightDtype": "int8", "path": "/m"}, "weightDtype int8 is a"),
    ],
)
def test_the_headroom_engine_refuses_what_it_cannot_load_naming_why(
    model: dict[str, Any], why: str
) -> None:
    """The default runtime is the headroom engine, which would crash-loop on these checkpoints:
    sizing refuses the spec, naming the field, and points at a stock runtime."""
    with pytest.raises(SpecError, match=why) as refused:
        size(spec(model=model, gpu={"type": "b200"}))
    assert "set engine.runtime vllm or sglang" in str(refused.value)
    stock = spec(model={**model, "path": "/m"}, gpu={"type": "b200"}, engine={"runtime": "vllm"})
    assert size(stock).plan.kv_bytes_per_token > 0
    # 'tiny' runs the built-in model whatever the preset says: the preset only sizes the pods.
    assert size(spec(model={**model, "path": "tiny"}, gpu={"type": "b200"})).plan is not None
