"""FP8 (e4m3) and int8 KV quantization, shared by every attention backend.

Granularity follows `headroom.engine.attention.base`:
- fp8: one static fp32 scale per (layer, kv head). e4m3 is a float format with 3 mantissa bits
  whatever the scale, so the scale only has to keep values inside +-448 (and out of the
  subnormals below 2**-6); a static scale keeps the cache at exactly one byte per element,
  and per head rather than per layer because heads can differ widely in range.
- int8: one fp32 scale per (token, kv head), absmax / 127 at write time. int8 is a uniform
  grid, so a scale shared over many tokens would spend most of the 255 levels on the rare
  outlier token; per-token scales cost 4 bytes per head-token (3 % at head_dim 128).

Dequantization always produces fp32 so attention accumulates in fp32: naive low-precision
accumulation over long contexts is what collapsed long-context retrieval in early FP8 KV.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x` `[..., num_kv_heads, head_dim]` / per-head `scale` `[num_kv_heads]` -> e4m3."""
    scaled = x.float() / scale.unsqueeze(-1)
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(token, head) symmetric int8: (int8 values `[..., H, D]`, fp32 scales `[..., H]`)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf / safe.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize(
    x: torch.Tensor, kv_dtype: str, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize new K or V for storage: (stored, per-token scales or None)."""
    if kv_dtype == "fp8":
        if scale is None:
            raise ValueError("fp8 KV needs its per-head scale")
        return quantize_fp8(x, scale), None
    if kv_dtype == "int8":
        return quantize_int8(x)
    return x, None


def dequantize(stored: torch.Tensor, kv_dtype: str, scale: torch.Tensor | None) -> torch.Tensor:
    """Stored K or V -> fp32 (`scale` per head for fp8, per token and head for int8)."""
    if kv_dtype in ("fp8", "int8"):
        if scale is None:
            raise ValueError(f"{kv_dtype} KV needs its scales")
        return stored.float() * scale.unsqueeze(-1)
    return stored.float()
