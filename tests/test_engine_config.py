"""`Engine.from_config` against a KV pool smaller than `max_model_len`: an explicit length is a
bad setting (refused with the numbers and the fixes), the model's default is capped to the pool,
so a request that leaves max_tokens unset (the chat default: all the room left) is served. Also
the cap to a sliding window, and the prefix-cache hit each request reports."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from headroom.engine.async_engine import AsyncEngine
from headroom.engine.attention import TorchBackend
from headroom.engine.config import EngineConfig
from headroom.engine.engine import Engine
from headroom.engine.errors import EngineConfigError
from headroom.engine.sampling import SamplingParams
from headroom.engine.server.budget_report import budget_report


def test_an_explicit_max_model_len_past_the_pool_is_refused_with_the_numbers() -> None:
    config = EngineConfig(
        model="tiny", num_blocks=10, block_size=16, max_model_len=1024, num_threads=1
    )
    with pytest.raises(EngineConfigError) as info:
        Engine.from_config(config)
    msg = str(info.value)
    assert "10 blocks x 16 tokens = 160 tokens" in msg
    assert "max_model_len 1,024 tokens" in msg and "needs 64 blocks" in msg
    assert "--num-blocks to at least 64" in msg and "--max-model-len to 160 or less" in msg


def test_an_explicit_max_model_len_the_pool_holds_exactly_is_kept() -> None:
    eng = Engine.from_config(
        EngineConfig(model="tiny", num_blocks=8, block_size=16, max_model_len=128, num_threads=1)
    )
    assert eng.max_model_len == eng.config.max_model_len == 128


def test_the_models_default_length_is_capped_to_the_pool(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="headroom.engine.engine"):
        eng = Engine.from_config(
            EngineConfig(model="tiny", num_blocks=8, block_size=16, num_threads=1)
        )
    warnings = [r for r in caplog.records if "capping max_model_len" in r.getMessage()]
    assert len(warnings) == 1 and "8192" in warnings[0].getMessage()
    # Everything that reports the length reports the capped one.
    assert eng.max_model_len == eng.config.max_model_len == eng.scheduler.max_model_len == 128
    assert AsyncEngine(eng).max_model_len == 128
    assert budget_report(eng).max_model_len == 128
    assert budget_report(eng).max_concurrency == 1  # one max-length sequence fits
    # A request with max_tokens unset gets the room left in the pool, and is served.
    prompt = [1, 2, 3]
    budget = eng.check_request(prompt, None)
    assert budget == 125
    out = eng.generate([prompt], SamplingParams(max_tokens=budget, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == budget
    assert eng.stats().kv.used == 0


def _mistral_checkpoint(path: Path, window: int) -> Path:
    """A random two-layer Mistral checkpoint whose every layer slides over `window` tokens."""
    import transformers

    cfg = transformers.MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        sliding_window=window,
    )  # fmt: skip
    transformers.MistralForCausalLM(cfg).save_pretrained(path)
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0")).save(
        str(path / "tokenizer.json")
    )
    return path


def test_a_backend_without_sliding_windows_caps_the_length_to_the_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Past the window a backend that attends to every cached token would compute full
    attention where the model slides: the length is capped to the window, and said so. A
    backend that slides (the torch one) serves the model's whole length."""
    path = str(_mistral_checkpoint(tmp_path, window=48))
    config = EngineConfig(model=path, num_blocks=32, block_size=16, num_threads=1)
    assert Engine.from_config(config).max_model_len == 256
    monkeypatch.setattr(TorchBackend, "supports_sliding_window", False)
    with caplog.at_level(logging.INFO, logger="headroom.engine.engine"):
        eng = Engine.from_config(config)
    assert eng.max_model_len == eng.config.max_model_len == eng.scheduler.max_model_len == 48
    assert any("capping max_model_len to the sliding window" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    # Only a length past the window is capped.
    short = Engine.from_config(config.model_copy(update={"max_model_len": 32}))
    assert short.max_model_len == 32


def test_a_request_reports_the_prompt_tokens_the_prefix_cache_served() -> None:
    """`num_cached_tokens` is the prefix cache's hit for that request, carried from the engine's
    sequence to its output: none on a first prompt, its full blocks on a repeat (one token short
    of a whole-block prompt, which recomputes its last token)."""
    eng = Engine.from_config(
        EngineConfig(model="tiny", num_blocks=32, block_size=4, max_model_len=64, num_threads=1)
    )
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    prompt = list(range(1, 14))  # 3 full blocks and 1 token
    first, second = (eng.generate([prompt], params)[0] for _ in range(2))
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 12)
    assert eng.generate([prompt[:12]], params)[0].num_cached_tokens == 8
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
