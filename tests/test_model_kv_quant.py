"""Teacher-forced quality of quantized KV on the tiny model: next-token distributions with
fp8 / int8 / bf16 KV stay close to fp32 KV over a few hundred positions."""

from __future__ import annotations

import pytest
import torch

from headroom.engine.attention import TorchBackend, allocate_layer_cache
from headroom.engine.model import build_forward_batch, build_tiny

CONTEXT, BLOCK = 384, 16


def _logits(kv: str, tokens: list[int]) -> torch.Tensor:
    model, _ = build_tiny()
    cfg = model.config
    model_dtype = torch.bfloat16 if kv == "bf16" else torch.float32  # bf16 storage only
    kv_dtype = "auto" if kv in ("fp32", "bf16") else kv
    caches = [
        allocate_layer_cache(
            CONTEXT // BLOCK,
            BLOCK,
            cfg.num_kv_heads,
            cfg.head_dim,
            model_dtype,
            kv_dtype,  # type: ignore[arg-type]
        )
        for _ in range(cfg.num_layers)
    ]
    table = list(range(CONTEXT // BLOCK))
    backend = TorchBackend()
    out = []
    # Chunks of 64: later chunks read earlier ones back from the (quantized) cache.
    for lo in range(0, CONTEXT, 64):
        batch = build_forward_batch(
            [(tokens[lo : lo + 64], lo, list(range(lo, lo + 64)), table)], []
        )
        out.append(model.compute_logits(model(batch, caches, backend)))
    return torch.cat(out)


@pytest.fixture(scope="module")
def reference() -> tuple[list[int], torch.Tensor]:
    tokens = torch.randint(0, 256, (CONTEXT,), generator=torch.Generator().manual_seed(0)).tolist()
    return tokens, _logits("fp32", tokens)


@pytest.mark.parametrize(
    "kv,max_kl,min_top1", [("bf16", 1e-5, 0.99), ("int8", 1e-4, 0.98), ("fp8", 2e-3, 0.95)]
)
def test_quantized_kv_tracks_fp32(reference, kv: str, max_kl: float, min_top1: float) -> None:
    tokens, ref = reference
    got = _logits(kv, tokens)
    ref_logp, logp = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean())
    top1 = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    assert 0 < kl < max_kl, f"{kv}: KL {kl:.2e}"
    assert top1 >= min_top1, f"{kv}: top-1 agreement {top1:.3f}"
