"""KV-cache quantization quality: bf16 / fp8 (e4m3) / int8 KV against an fp32 KV reference.

For the tiny model and a larger random Llama-shaped config (8 query / 2 KV heads of 64,
hidden 512, 4 layers), a 4,096-token context is prefilled and then 64 more tokens are
decoded one at a time (teacher forced), so the decode path attends over ~4k tokens of
quantized KV. Reported per KV dtype:
- attention rel. error: ||attn(KV_q) - attn(KV_fp32)|| / ||attn(KV_fp32)|| for the same
  queries and keys (a shadow cache is written beside the reference one), over all layers
  and decode steps; one extra row shows fp8 with bf16 accumulation for contrast with the
  fp32 accumulation every headroom backend uses;
- KL(p_fp32 || p_q) of next-token distributions, mean over decode positions, when the whole
  model runs on quantized KV (errors propagate through layers);
- top-1 agreement of next tokens over those ~4k-context decode positions.
Targets (stated, not from a paper): attention rel. error <= 1 % (bf16), <= 5 % (fp8, int8);
top-1 agreement >= 90 % for every dtype.
Usage: .venv/bin/python bench/kv_quant_quality.py [--context N] [--decode N] [--threads N]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import torch
from verdicts import Verdicts

from headroom.engine.attention import TorchBackend, allocate_layer_cache
from headroom.engine.attention.base import LayerKVCache
from headroom.engine.model import ModelConfig, build_forward_batch, build_tiny, tiny_config
from headroom.engine.model.config import RopeConfig
from headroom.engine.model.llama import LlamaForCausalLM

BLOCK = 16
KV_ROWS = ("bf16", "fp8", "int8")
ATTN_TARGET = {"bf16": 0.01, "fp8": 0.05, "int8": 0.05}
TOP1_TARGET = 0.90


def _cache_for(row: str, cfg: ModelConfig, num_blocks: int) -> LayerKVCache:
    if row == "fp32":
        return allocate_layer_cache(
            num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float32
        )
    if row == "bf16":  # stored bf16, read back to fp32 inside attention
        return allocate_layer_cache(
            num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16
        )
    return allocate_layer_cache(
        num_blocks,
        BLOCK,
        cfg.num_kv_heads,
        cfg.head_dim,
        torch.float32,
        row,  # type: ignore[arg-type]
    )


def _naive_bf16_decode(
    q: torch.Tensor, cache: LayerKVCache, seq_lens: torch.Tensor, tables: torch.Tensor, scale: float
) -> torch.Tensor:
    """fp8 KV attended the naive way headroom avoids: bf16 scores and probabilities, and the
    softmax sum and p.V accumulated in a bf16 register block by block (one sequence)."""
    from headroom.engine.attention.torch_backend import _gather

    n = int(seq_lens[0])
    blocks = tables[0, : -(-n // BLOCK)].long()
    k = _gather(cache, blocks, key=True).flatten(0, 1)[:n]
    v = _gather(cache, blocks, key=False).flatten(0, 1)[:n]
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = (torch.einsum("hd,nhd->hn", q[0].float(), k) * scale).bfloat16()
    p = torch.exp(s - s.amax(-1, keepdim=True))  # bf16
    acc = torch.zeros(q.shape[1], q.shape[2], dtype=torch.bfloat16)
    total = torch.zeros(q.shape[1], 1, dtype=torch.bfloat16)
    for b0 in range(0, n, BLOCK):
        pb = p[:, b0 : b0 + BLOCK].float()
        acc = (acc.float() + torch.einsum("hn,nhd->hd", pb, v[b0 : b0 + BLOCK])).bfloat16()
        total = (total.float() + pb.sum(-1, keepdim=True)).bfloat16()
    return (acc.float() / total.float()).unsqueeze(0)


@dataclass
class ShadowBackend:
    """Runs the reference attention and, on shadow caches, the same call for each KV dtype."""

    shadows: dict[str, list[LayerKVCache]]
    layer_of: dict[int, int]
    inner: TorchBackend = field(default_factory=TorchBackend)
    name: str = "shadow"
    supports_sliding_window: bool = True
    sq_err: dict[str, float] = field(default_factory=dict)
    sq_ref: dict[str, float] = field(default_factory=dict)
    record: bool = False

    def write_kv(self, key, value, cache, slot_mapping) -> None:  # type: ignore[no-untyped-def]
        self.inner.write_kv(key, value, cache, slot_mapping)
        layer = self.layer_of[id(cache)]
        for caches in self.shadows.values():
            self.inner.write_kv(key, value, caches[layer], slot_mapping)

    def prefill(self, query, cache, qsl, seq_lens, tables, scale, **kw):  # type: ignore[no-untyped-def]
        return self.inner.prefill(query, cache, qsl, seq_lens, tables, scale, **kw)

    def decode(self, query, cache, seq_lens, tables, scale, **kw):  # type: ignore[no-untyped-def]
        ref = self.inner.decode(query, cache, seq_lens, tables, scale, **kw)
        if self.record:
            layer = self.layer_of[id(cache)]
            for row, caches in self.shadows.items():
                if row == "fp8-bf16acc":
                    out = _naive_bf16_decode(query, caches[layer], seq_lens, tables, scale)
                else:
                    out = self.inner.decode(query, caches[layer], seq_lens, tables, scale, **kw)
                self.sq_err[row] = self.sq_err.get(row, 0.0) + float((out - ref).pow(2).sum())
                self.sq_ref[row] = self.sq_ref.get(row, 0.0) + float(ref.pow(2).sum())
        return ref

    def copy_blocks(self, caches, src, dst) -> None:  # type: ignore[no-untyped-def]
        self.inner.copy_blocks(caches, src, dst)


def _run(
    model: LlamaForCausalLM,
    caches: list[LayerKVCache],
    backend,
    tokens: list[int],
    prefill: int,
    shadow: ShadowBackend | None = None,
) -> torch.Tensor:
    """Prefill `tokens[:prefill]`, then teacher-forced decodes; fp32 logits of the decodes."""
    table = list(range(-(-len(tokens) // BLOCK)))
    slots = list(range(len(tokens)))  # blocks 0..n in order: slot p is position p
    batch = build_forward_batch([(tokens[:prefill], 0, slots[:prefill], table)], [])
    model(batch, caches, backend)
    if shadow is not None:
        shadow.record = True
    logits = []
    for p in range(prefill, len(tokens)):
        batch = build_forward_batch([], [(tokens[p], p, slots[p], table)])
        logits.append(model.compute_logits(model(batch, caches, backend)))
    return torch.cat(logits)


def evaluate(
    label: str, cfg: ModelConfig, context: int, decode: int, verdict: Verdicts
) -> list[str]:
    model, _ = build_tiny(config=cfg, seed=1)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (context + decode,), generator=gen).tolist()
    num_blocks = -(-len(tokens) // BLOCK)
    layers = cfg.num_layers
    ref_caches = [_cache_for("fp32", cfg, num_blocks) for _ in range(layers)]
    shadow_rows = {
        row: [_cache_for(row, cfg, num_blocks) for _ in range(layers)] for row in KV_ROWS
    }
    shadow_rows["fp8-bf16acc"] = [_cache_for("fp8", cfg, num_blocks) for _ in range(layers)]
    shadow = ShadowBackend(shadow_rows, {id(c): i for i, c in enumerate(ref_caches)})
    t0 = time.perf_counter()
    ref_logits = _run(model, ref_caches, shadow, tokens, context, shadow)
    ref_logp = torch.log_softmax(ref_logits, -1)
    ref_top1 = ref_logits.argmax(-1)
    lines = []
    for row in (*KV_ROWS, "fp8-bf16acc"):
        rel = (shadow.sq_err[row] / shadow.sq_ref[row]) ** 0.5
        if row == "fp8-bf16acc":
            lines.append(
                f"{label:>14} {'fp8, bf16 acc':>14} {rel * 100:9.3f} %  {'-':>10} {'-':>8}   "
                f"{'(contrast only)':>22}"
            )
            continue
        caches = [_cache_for(row, cfg, num_blocks) for _ in range(layers)]
        logits = _run(model, caches, TorchBackend(), tokens, context)
        logp = torch.log_softmax(logits, -1)
        kl = float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean())
        top1 = float((logits.argmax(-1) == ref_top1).float().mean())
        result = verdict(
            rel <= ATTN_TARGET[row] and top1 >= TOP1_TARGET, f"{label} {row} KV quality"
        )
        lines.append(
            f"{label:>14} {row:>14} {rel * 100:9.3f} %  {kl:10.2e} {top1 * 100:7.1f} %   "
            f"{'<=' + format(ATTN_TARGET[row] * 100, '.0f') + ' %, >=90 %':>16} "
            f"{result}"
        )
    lines.append(f"{'':>14} ({time.perf_counter() - t0:.0f} s)")
    return lines


def larger_config(max_len: int) -> ModelConfig:
    """A random Llama-shaped model, larger than tiny: GQA 8/2 heads of 64, hidden 512."""
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1408,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        rope=RopeConfig(theta=500000.0),
        max_position_embeddings=max_len,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096, help="prefilled tokens")
    ap.add_argument("--decode", type=int, default=64, help="decoded positions measured")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    total = args.context + args.decode
    print(
        f"KV quantization quality vs fp32 KV: {args.context}-token context, then {args.decode} "
        f"decode positions (block {BLOCK}, fp32 weights, fp32 accumulation)"
    )
    print(
        f"{'model':>14} {'KV dtype':>14} {'attn rel err':>11}  {'KL':>10} {'top-1':>8}   "
        f"{'target':>16} result"
    )
    verdict = Verdicts()
    for label, cfg in (
        ("tiny", tiny_config(max_position_embeddings=max(total, 8192))),
        ("llama-512x4", larger_config(total)),
    ):
        for line in evaluate(label, cfg, args.context, args.decode, verdict):
            print(line)
    print()
    return verdict.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
