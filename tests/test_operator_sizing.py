"""spec -> PlanInput -> plan: status.budget is what `headroom plan` says for the same inputs."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from headroom.contract import plan_cli
from headroom.contract.budget import GIB, plan
from headroom.operator.crd.models import InferenceDeploymentSpec
from headroom.operator.reconcile.sizing import (
    SpecError,
    blocks_per_sequence,
    budget,
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
