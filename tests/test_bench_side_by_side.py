"""The benchmarks of issue 25 at a small size: paired CPU attention timing, the trace-driven
prefix replay, the engine against transformers' `generate`, and the precision-emulating
attention of the retrieval table."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

from headroom.engine.attention import TorchBackend, allocate_layer_cache


@pytest.fixture(scope="module")
def trace_bench() -> ModuleType:
    from bench import prefix_trace

    return prefix_trace


def test_paged_attention_row_is_a_median_of_paired_ratios() -> None:
    from bench import cpu_attention as bench

    ratio, paged_ms, dense_ms, diff = bench.attention_row(
        [64, 48, 33], 3, torch.Generator().manual_seed(0)
    )
    assert ratio > 0 and paged_ms > 0 and dense_ms > 0
    assert diff < 1e-5  # paged and dense attend to the same K/V


def test_the_whole_mooncake_trace_has_the_stated_ceiling(trace_bench: ModuleType) -> None:
    if not trace_bench.TRACE.is_file():
        pytest.fail(f"the shared trace {trace_bench.TRACE} is missing")
    rows = trace_bench.read_trace(trace_bench.TRACE)
    assert len(rows) == 3993
    assert trace_bench.trace_block_ceiling(rows) == pytest.approx(0.64, abs=0.005)


def test_replayed_prompts_share_exactly_the_traces_prefixes(trace_bench: ModuleType) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 40, "hash_ids": [1, 2]},
        {"timestamp": 5, "input_length": 1500, "output_length": 10, "hash_ids": [1, 3, 4]},
        {"timestamp": 9, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]},
    ]
    a, b, c = trace_bench.scaled_requests(rows, 3)
    n = trace_bench.SCALE_TOKENS
    assert (len(a.prompt), len(b.prompt), len(c.prompt)) == (2 * n, -(-1500 * n // 512), 19)
    assert a.prompt[:n] == b.prompt[:n] and a.prompt[n : 2 * n] != b.prompt[n : 2 * n]
    assert c.prompt == a.prompt[: len(c.prompt)]
    assert (a.output, b.output, c.output) == (2, 1, 1)
    # b hits block 1 (16 tokens); c hits all it has but its last token: 18 -> 16 (whole blocks).
    expected = (16 + 16) / (len(a.prompt) + len(b.prompt) + len(c.prompt))
    assert trace_bench.token_ceiling([a, b, c]) == pytest.approx(expected)


def test_a_short_replay_one_at_a_time_finds_every_shared_prefix(
    trace_bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trace_bench, "IN_FLIGHT", 1)  # in flight together, they cannot share
    rows = [
        {"timestamp": i, "input_length": 2048, "output_length": 32, "hash_ids": [7, 8, 9, i + 10]}
        for i in range(6)
    ]
    reqs = trace_bench.scaled_requests(rows, 6)
    on = trace_bench.replay(reqs, caching=True, num_blocks=256)
    off = trace_bench.replay(reqs, caching=False, num_blocks=256)
    assert len(on.ttft) == len(off.ttft) == 6
    assert off.hit_ratio == 0.0
    # The first request computes the three shared blocks; the other five find them.
    assert on.hit_ratio == pytest.approx(5 * 48 / (6 * 64))
    assert on.hit_ratio == pytest.approx(trace_bench.token_ceiling(reqs))


def test_the_hf_pipeline_counts_only_useful_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench import hf_pipeline as bench

    monkeypatch.setattr(bench, "MAX_PROMPT", 80)
    monkeypatch.setattr(bench, "MAX_OUTPUT", 40)
    bench.write_model(tmp_path)
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    reqs = bench.workload(3, seed=1)
    assert all(64 <= len(r.prompt) <= 80 and 32 <= r.output <= 40 for r in reqs)
    h = bench.run_headroom(bench.engine_for(tmp_path), reqs)
    f = bench.run_hf(hf, reqs)
    want = sum(r.output for r in reqs)
    assert h.tokens == f.tokens == want
    width = max(len(r.prompt) for r in reqs) + max(r.output for r in reqs)
    assert f.slots == 3 * width and f.useful_slots == h.useful_slots < f.slots


def test_kernel_precision_emulation_is_close_and_bf16_accumulation_is_not() -> None:
    from bench import kv_quant_quality as bench

    gen = torch.Generator().manual_seed(0)
    cache = allocate_layer_cache(64, 16, 2, 64, torch.float32)
    cache.key.normal_(generator=gen)
    cache.value.normal_(generator=gen)
    query = torch.randn(2, 8, 64, generator=gen) * 3
    tables = torch.arange(64, dtype=torch.int32).view(2, 32)
    lens = torch.tensor([512, 300], dtype=torch.int32)
    ref = TorchBackend().decode(query, cache, lens, tables, 0.125)

    def err(mode: str) -> float:
        out = bench.PrecisionBackend(mode).decode(query, cache, lens, tables, 0.125)
        return float((out - ref).norm() / ref.norm())

    assert err("kernel") < 2e-3
    assert err("bf16") > 5 * err("kernel")
