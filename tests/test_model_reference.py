"""headroom's decoder against Hugging Face transformers on random small checkpoints.

Each family is built with transformers, saved with `save_pretrained` and loaded by both sides:
fp32 logits must agree within 1e-4 relative, and greedy generations through the engine (paged
cache, chunked prefill, prefix caching on and off, preemption by a tiny pool) must be token
for token what transformers produces.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from headroom.engine.attention import TorchBackend, allocate_layer_cache
from headroom.engine.config import EngineConfig
from headroom.engine.engine import Engine
from headroom.engine.model import build_forward_batch, load_model
from headroom.engine.sampling import SamplingParams

VOCAB = 320
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.15,
    attn_implementation="eager",
)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # Llama 3.1-style rope scaling with a short original context so scaling matters.
    "llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        ),
    ),
    "llama2": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=4)),
    # A window shorter than the prompts, so sliding-window attention is exercised.
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=12)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
}


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(family, directory, transformers model) for a random checkpoint of that family."""
    family = request.param
    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(1234)
    cfg = getattr(transformers, cfg_cls)(**{**COMMON, **extra})
    hf = getattr(transformers, model_cls)(cfg).eval()
    path = tmp_path_factory.mktemp(family)
    hf.save_pretrained(path)
    _write_tokenizer(path)
    return family, path, hf


_EXPECTED: dict[str, list[list[int]]] = {}


def _expected(family: str, hf: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy continuations, computed once per family."""
    if family not in _EXPECTED:
        _EXPECTED[family] = [_hf_greedy(hf, p, n) for p in prompts]
    return _EXPECTED[family]


def _hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt) :]


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, VOCAB, (10,), generator=gen).tolist()
    lengths = [3, 17, 1, 26, 9, 14]
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    # Two prompts share a 10-token prefix (2 full blocks of 4), so prefix caching gets hits.
    prompts[4] = shared + prompts[4]
    prompts[5] = shared + prompts[5]
    return prompts


def test_logits_match_transformers(checkpoint) -> None:
    family, path, hf = checkpoint
    loaded = load_model(str(path), dtype="float32")
    cfg = loaded.config
    bs = 4
    caches = [
        allocate_layer_cache(32, bs, cfg.num_kv_heads, cfg.head_dim, torch.float32)
        for _ in range(cfg.num_layers)
    ]
    ids = torch.randint(0, VOCAB, (45,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    table = torch.randperm(32, generator=torch.Generator().manual_seed(3))[: math.ceil(45 / bs)]
    table_l = table.tolist()
    slots = [table_l[p // bs] * bs + p % bs for p in range(len(ids))]
    backend = TorchBackend()
    hidden = []
    # Two prefill chunks (the second attends to the first through the cache), then decodes.
    for lo, hi in ((0, 20), (20, 41)):
        batch = build_forward_batch([(ids[lo:hi], lo, slots[lo:hi], table_l)], [])
        hidden.append(loaded.model(batch, caches, backend))
    for p in range(41, 45):
        batch = build_forward_batch([], [(ids[p], p, slots[p], table_l)])
        hidden.append(loaded.model(batch, caches, backend))
    logits = loaded.model.compute_logits(torch.cat(hidden))
    rel = (logits - ref).abs().max() / ref.abs().max()
    assert rel < 1e-4, f"{family}: relative logit error {rel:.2e}"


@pytest.mark.parametrize(
    "prefix_caching,num_blocks,batched_tokens",
    [(True, 256, 2048), (False, 256, 2048), (True, 256, 16), (True, 16, 24), (False, 16, 24)],
    ids=["prefix-on", "prefix-off", "chunked-prefill", "preempt-prefix-on", "preempt-prefix-off"],
)
def test_greedy_generation_matches_transformers(
    checkpoint, prefix_caching: bool, num_blocks: int, batched_tokens: int
) -> None:
    family, path, hf = checkpoint
    prompts = _prompts(11)
    max_tokens = 10
    expected = _expected(family, hf, prompts, max_tokens)
    engine = Engine.from_config(
        EngineConfig(
            model=str(path),
            dtype="float32",
            block_size=4,
            num_blocks=num_blocks,
            max_num_batched_tokens=batched_tokens,
            enable_prefix_caching=prefix_caching,
            attention_backend="torch",
            num_threads=1,
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # Submit the shared-prefix prompt late so it finds the first one's blocks cached.
    engine.generate(prompts[4:5], params)
    outs = engine.generate(prompts, params)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == expected, f"{family}: greedy tokens differ from transformers"
    stats = engine.stats()
    if num_blocks == 16:
        assert stats.preemptions_total > 0, "the tiny pool was meant to force preemption"
    if prefix_caching:
        assert stats.prefix_cache.hits_tokens_total > 0
    else:
        assert stats.prefix_cache.hits_tokens_total == 0
    assert stats.kv.used == 0, "finished requests must leave no block referenced"
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
