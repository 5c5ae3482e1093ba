"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2) over the paged KV cache.

RMSNorm, RoPE, grouped-query attention and a SwiGLU MLP. q/k/v and gate/up projections are
fused into one matmul each (fewer, larger ops); `load_weights` maps the Hugging Face
parameter names onto the fused slices.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from headroom.engine.attention.base import AttentionBackend, LayerKVCache
from headroom.engine.model.batch import ForwardBatch
from headroom.engine.model.config import ModelConfig
from headroom.engine.model.rope import apply_rope, cos_sin, inverse_frequencies

# Parameters some checkpoints carry that this implementation recomputes instead.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as the reference implementation does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    """GQA self-attention: fused qkv projection, RoPE, paged cache write and attention."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_attention_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = cfg.window(layer)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerKVCache,
        batch: ForwardBatch,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        backend.write_kv(k, v, cache, batch.slot_mapping)
        extra = {}
        if self.sliding_window is not None and getattr(backend, "supports_sliding_window", False):
            extra["sliding_window"] = self.sliding_window
        p = batch.num_prefill_tokens
        parts = []
        if p:
            parts.append(
                backend.prefill(
                    q[:p],
                    cache,
                    batch.prefill_query_start_loc,
                    batch.prefill_seq_lens,
                    batch.prefill_block_tables,
                    self.scale,
                    **extra,
                )
            )
        if p < n:
            parts.append(
                backend.decode(
                    q[p:],
                    cache,
                    batch.decode_seq_lens,
                    batch.decode_block_tables,
                    self.scale,
                    **extra,
                )
            )
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        result: torch.Tensor = self.o_proj(out.reshape(n, self.q_size))
        return result


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        result: torch.Tensor = self.down_proj(F.silu(gate) * up)
        return result


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerKVCache,
        batch: ForwardBatch,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, batch, backend)
        result: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return result


class LlamaBody(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder and its LM head; parameter names follow the Hugging Face checkpoints."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # A plain attribute, not a buffer: `.to(dtype)` must never round the frequencies.
        self._inv_freq = inverse_frequencies(cfg.rope, cfg.head_dim)

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        caches: list[LayerKVCache],
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Hidden states `[num_tokens, hidden]` after the final norm, writing K/V to `caches`."""
        x = self.model.embed_tokens(batch.input_ids)
        if self._inv_freq.device != x.device:
            self._inv_freq = self._inv_freq.to(x.device)
        cos, sin = cos_sin(batch.positions, self._inv_freq, x.dtype)
        for layer, cache in zip(self.model.layers, caches, strict=True):
            x = layer(x, cos, sin, cache, batch, backend)
        hidden: torch.Tensor = self.model.norm(x)
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[rows, vocab]` for selected hidden rows."""
        logits: torch.Tensor = self.lm_head(hidden)
        return logits.float()

    @torch.inference_mode()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in; raise naming any missing or unexpected one."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        unexpected: list[str] = []
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        fused = {
            "q_proj": ("qkv_proj", 0, q),
            "k_proj": ("qkv_proj", q, kv),
            "v_proj": ("qkv_proj", q + kv, kv),
            "gate_proj": ("gate_up_proj", 0, cfg.intermediate_size),
            "up_proj": ("gate_up_proj", cfg.intermediate_size, cfg.intermediate_size),
        }
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            target, offset, size = name, 0, None
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in fused:
                fused_name, offset, size = fused[parts[-2]]
                target = ".".join([*parts[:-2], fused_name, parts[-1]])
            param = params.get(target)
            if param is None:
                unexpected.append(name)
                continue
            dst = param.data if size is None else param.data.narrow(0, offset, size)
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"weight {name} has shape {tuple(tensor.shape)}, the config implies "
                    f"{tuple(dst.shape)}"
                )
            dst.copy_(tensor.to(dst.dtype))
            loaded.add(name)
        if unexpected:
            raise ValueError(f"checkpoint has weights this architecture lacks: {unexpected[:5]}")
        missing = [n for n in self.expected_weight_names() if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint lacks weights: {missing[:5]} ({len(missing)} missing)")

    def expected_weight_names(self) -> list[str]:
        """The Hugging Face parameter names a checkpoint for this config must contain."""
        cfg = self.config
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not cfg.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            for proj in ("q_proj", "k_proj", "v_proj"):
                names.append(f"{p}self_attn.{proj}.weight")
                if cfg.qkv_bias:
                    names.append(f"{p}self_attn.{proj}.bias")
            names.append(f"{p}self_attn.o_proj.weight")
            if cfg.o_bias:
                names.append(f"{p}self_attn.o_proj.bias")
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names.append(f"{p}mlp.{proj}.weight")
                if cfg.mlp_bias:
                    names.append(f"{p}mlp.{proj}.bias")
        return names
