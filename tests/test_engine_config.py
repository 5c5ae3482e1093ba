"""`Engine.from_config` against a KV pool smaller than `max_model_len`: an explicit length is a
bad setting (refused with the numbers and the fixes), the model's default is capped to the pool,
so a request that leaves max_tokens unset (the chat default: all the room left) is served."""

from __future__ import annotations

import logging

import pytest

from headroom.engine.async_engine import AsyncEngine
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
