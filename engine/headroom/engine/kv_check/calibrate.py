"""Per-head static fp8 scales from the user's own prompts: run them with the auto cache, record
each layer's and KV head's largest |K| and |V|, and set scale = absmax * MARGIN / 448.

e4m3 has the same relative precision over its whole normal range, so the scale only has to
keep values under 448 (saturation) and out of the subnormals below 2**-6 (lost precision).
The margin leaves one binade of room above what the prompts produced, for outliers they did
not contain, at the cost of one binade at the small end where values matter least to a dot
product.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from headroom.engine import quant
from headroom.engine.attention import AttentionBackend
from headroom.engine.attention.kv_scales import KVScales, clamp_scale
from headroom.engine.kv_check.session import KVSetting, Session
from headroom.engine.model.llama import LlamaForCausalLM

MARGIN = 2.0


@dataclass
class AbsMaxRecorder:
    """An attention backend that forwards every call to `inner` and keeps, per layer, the
    running max of |K| and |V| per KV head of everything written (device tensors: no sync)."""

    inner: AttentionBackend
    num_layers: int
    name: str = "absmax-recorder"
    k_max: dict[int, torch.Tensor] = field(default_factory=dict)
    v_max: dict[int, torch.Tensor] = field(default_factory=dict)
    _writes: int = 0

    @property
    def supports_sliding_window(self) -> bool:
        return bool(getattr(self.inner, "supports_sliding_window", False))

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: Any, slots: Any) -> None:
        # Every forward writes each layer once, in layer order.
        layer = self._writes % self.num_layers
        self._writes += 1
        for store, t in ((self.k_max, key), (self.v_max, value)):
            m = t.detach().abs().float().amax(dim=(0, 2))
            store[layer] = m if layer not in store else torch.maximum(store[layer], m)
        self.inner.write_kv(key, value, cache, slots)

    def prefill(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.inner.prefill(*args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.inner.decode(*args, **kwargs)

    def copy_blocks(self, caches: Any, src: Any, dst: Any) -> None:
        self.inner.copy_blocks(caches, src, dst)


def scales_from_absmax(
    k_max: Sequence[Sequence[float]], v_max: Sequence[Sequence[float]], source: str
) -> KVScales:
    """absmax * MARGIN / 448 per layer and head (1.0 for a head that only ever saw zeros),
    kept within normal fp32 (a near-dead head's tiny absmax would otherwise store a scale of 0,
    which reads its keys back as NaN)."""

    def row(values: Sequence[float]) -> list[float]:
        return [clamp_scale(v * MARGIN / quant.FP8_MAX) if v > 0 else 1.0 for v in values]

    return KVScales(k_scale=[row(r) for r in k_max], v_scale=[row(r) for r in v_max], source=source)


def calibrate(
    model: LlamaForCausalLM,
    backend: AttentionBackend,
    device: torch.device,
    prompts: Sequence[Sequence[int]],
    source: str,
    progress: Callable[[int, int], None] | None = None,
) -> KVScales:
    """Prefill each prompt with the auto cache and derive the fp8 scales from what was written."""
    layers = model.config.num_layers
    recorder = AbsMaxRecorder(backend, layers)
    session = Session(model, recorder, KVSetting("auto", "auto"), device)
    for i, tokens in enumerate(prompts):
        session.next_token_logits(tokens, len(tokens))
        if progress is not None:
            progress(i + 1, len(prompts))
    k = [recorder.k_max[i].cpu().tolist() for i in range(layers)]
    v = [recorder.v_max[i].cpu().tolist() for i in range(layers)]
    return scales_from_absmax(k, v, source)
