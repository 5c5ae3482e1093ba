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

Also the one reader of a config's numbers (`config_number`), whose errors name the field.
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


class ConfigFieldError(TypeError):
    """A config.json field absent, not one number or out of bounds, its message naming it. A
    TypeError, as int() of such a field raises: a reader that names the file for those names
    it for this."""


def config_number(
    cfg: dict[str, Any],
    *keys: str,
    default: int | None = None,
    low: int | None = None,
    high: int | None = None,
) -> int:
    """The first of `keys` the config states, as an int; `default` where it states none.
    ConfigFieldError naming the key where it states none and there is no default, states
    something other than one number (a per-layer list, true, an object), or states a number
    outside `low`..`high`."""
    for key in keys:
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, list):
            raise ConfigFieldError(
                f"{key} is a per-layer list, not one number: a model whose layers differ in "
                f"{key} is not sized yet"
            )
        if isinstance(value, bool):
            raise ConfigFieldError(f"{key}: {str(value).lower()} is not a number")
        if not isinstance(value, int | float | str):
            what = "an object" if isinstance(value, dict) else type(value).__name__
            raise ConfigFieldError(f"{key} is {what}, not a number")
        try:
            number = int(value)
        except (ValueError, OverflowError):
            raise ConfigFieldError(f"{key}: {value!r} is not a number") from None
        # Worded as pydantic words ModelArch's bounds, with what the config states.
        stated = repr(value) if isinstance(value, str) else value
        if low is not None and number < low:
            raise ConfigFieldError(
                f"{key}: Input should be greater than or equal to {low} (it is {stated})"
            )
        if high is not None and number > high:
            raise ConfigFieldError(
                f"{key}: Input should be less than or equal to {high} (it is {stated})"
            )
        return number
    if default is None:
        raise ConfigFieldError(
            f"{keys[0]}: config.json states none (nor does its text_config); add it there"
        )
    return default


def sliding_windows(cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Per layer, the window in tokens (None: full attention); `()` when no layer slides.
    Raises ValueError for a `layer_types` list whose length is not `num_layers`, and
    ConfigFieldError for a window, max_window_layers or sliding_window_pattern not one number."""
    window = cfg.get("sliding_window")
    if window is None or isinstance(window, bool):
        return ()
    family = model_family(cfg)
    if family == "llama":
        return ()
    qwen = family.startswith("qwen")
    if (qwen or "use_sliding_window" in cfg) and not cfg.get("use_sliding_window", False):
        return ()
    size = config_number(cfg, "sliding_window")
    types = cfg.get("layer_types")
    if family == "mistral":
        types = [_SLIDING] * num_layers
    elif isinstance(types, list):
        if len(types) != num_layers:
            raise ValueError(
                f"layer_types lists {len(types)} layers but num_hidden_layers is {num_layers}"
            )
    elif family == "qwen2_moe":
        start = config_number(cfg, "max_window_layers", default=DEFAULT_MAX_WINDOW_LAYERS)
        types = [_SLIDING if i % 2 == 0 and i < start else "full" for i in range(num_layers)]
    elif qwen:
        start = config_number(cfg, "max_window_layers", default=DEFAULT_MAX_WINDOW_LAYERS)
        types = [_SLIDING if i >= start else "full" for i in range(num_layers)]
    elif family in _PATTERN_DEFAULTS:
        every = config_number(cfg, "sliding_window_pattern", default=_PATTERN_DEFAULTS[family])
        types = [_SLIDING if every <= 0 or (i + 1) % every else "full" for i in range(num_layers)]
    else:
        types = [_SLIDING] * num_layers
    windows = tuple(size if t == _SLIDING else None for t in types)
    return windows if any(w is not None for w in windows) else ()
