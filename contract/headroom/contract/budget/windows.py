"""Which layers of a Hugging Face `config.json` attend through a sliding window, by the rules
transformers applies. One function for `headroom plan` (`arch.from_hf_dict`, the KV budget) and
the engine's decoder config (the attention it runs), so the two never disagree.

- No `sliding_window` (or null): no layer slides.
- Llama: transformers' Llama has no sliding window; a stray `sliding_window` key is ignored.
- `use_sliding_window` (Qwen2/Qwen3 and the others that have the key; absent means False for
  the Qwen families): False means no layer slides. True with no `layer_types`: Qwen2/Qwen3 slide
  the layers from `max_window_layers` on (default 28), Qwen2-MoE the even layers below it.
- Mistral: every layer slides (Mistral-7B-v0.1); transformers' Mistral ignores `layer_types`.
- `layer_types`: the layers listed as "sliding_attention".
- Gemma 2, Gemma 3 and Cohere 2 without `layer_types`: every `sliding_window_pattern`-th
  layer (default 2, 6 and 4) is global, the others slide.
- Any other model with a `sliding_window` (Mixtral, Phi-3, Starcoder2, ...): every layer.
"""

from __future__ import annotations

import re
from typing import Any

# transformers' default of `max_window_layers` (Qwen2, Qwen3, Qwen2-MoE).
DEFAULT_MAX_WINDOW_LAYERS = 28
# Every n-th layer global, the others sliding, where a config lists no `layer_types`.
_PATTERN_DEFAULTS = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6, "cohere2": 4}
_SLIDING = "sliding_attention"


def model_family(cfg: dict[str, Any]) -> str:
    """The config's `model_type`, else its first architecture without the head suffix, lower
    case ("LlamaForCausalLM" -> "llama"); "" when it names neither."""
    model_type = cfg.get("model_type")
    if isinstance(model_type, str) and model_type:
        return model_type.lower()
    archs = cfg.get("architectures")
    for arch in archs if isinstance(archs, list) else []:
        if isinstance(arch, str) and arch:
            return re.sub(r"For(CausalLM|ConditionalGeneration)$", "", arch).lower()
    return ""


def _int(cfg: dict[str, Any], key: str, default: int) -> int:
    value = cfg.get(key)
    return default if value is None else int(value)


def sliding_windows(cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Per layer, the window in tokens (None: full attention); `()` when no layer slides.
    Raises ValueError for a `layer_types` list whose length is not `num_layers`."""
    window = cfg.get("sliding_window")
    if window is None or isinstance(window, bool):
        return ()
    family = model_family(cfg)
    if family == "llama":
        return ()
    qwen = family.startswith("qwen")
    if (qwen or "use_sliding_window" in cfg) and not cfg.get("use_sliding_window", False):
        return ()
    types = cfg.get("layer_types")
    if family == "mistral":
        types = [_SLIDING] * num_layers
    elif isinstance(types, list):
        if len(types) != num_layers:
            raise ValueError(
                f"layer_types lists {len(types)} layers but num_hidden_layers is {num_layers}"
            )
    elif family == "qwen2_moe":
        start = _int(cfg, "max_window_layers", DEFAULT_MAX_WINDOW_LAYERS)
        types = [_SLIDING if i % 2 == 0 and i < start else "full" for i in range(num_layers)]
    elif qwen:
        start = _int(cfg, "max_window_layers", DEFAULT_MAX_WINDOW_LAYERS)
        types = [_SLIDING if i >= start else "full" for i in range(num_layers)]
    elif family in _PATTERN_DEFAULTS:
        every = _int(cfg, "sliding_window_pattern", _PATTERN_DEFAULTS[family])
        types = [_SLIDING if every <= 0 or (i + 1) % every else "full" for i in range(num_layers)]
    else:
        types = [_SLIDING] * num_layers
    size = int(window)
    windows = tuple(size if t == _SLIDING else None for t in types)
    return windows if any(w is not None for w in windows) else ()
