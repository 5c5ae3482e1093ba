"""Static per-head fp8 KV scales: the file `headroom kv-check --calibrate` writes and the engine
reads at start-up.

The file is `kv_cache_scales.json` in the model directory, so the engine finds it wherever
the weights are mounted (the InferenceDeployment's `spec.model.path` included) and nothing
else needs configuring. Only fp8 uses it: int8 scales are per token, computed at write time.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from headroom.engine.attention.base import LayerKVCache

SCALES_FILE = "kv_cache_scales.json"
FORMAT = "headroom.kv-scales/v1"
# The caches hold the scales as fp32: a file's scale must stay positive and finite once cast
# (below the smallest subnormal it becomes 0 and reads back NaN; past the fp32 max, inf). A
# subnormal stays usable and is accepted, since files calibrated before the clamp hold such
# values for near-dead heads; calibration writes normal numbers (SCALE_MIN up).
SCALE_MIN = float(torch.finfo(torch.float32).tiny)
SCALE_MAX = float(torch.finfo(torch.float32).max)


class KVScalesError(ValueError):
    """A scales file that cannot be read or does not fit the model."""


class KVScales(BaseModel):
    """Per-layer, per-KV-head fp32 scales (dequantized value = stored e4m3 * scale)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: str = FORMAT
    kv_cache_dtype: str = "fp8"
    k_scale: list[list[float]] = Field(description="[layer][kv head]")
    v_scale: list[list[float]] = Field(description="[layer][kv head]")
    source: str = Field(default="", description="what the scales were derived from")

    @model_validator(mode="after")
    def _check(self) -> KVScales:
        if self.format != FORMAT:
            raise ValueError(f"format must be {FORMAT!r}, got {self.format!r}")
        if self.kv_cache_dtype != "fp8":
            raise ValueError("static scales are for kv_cache_dtype fp8 only")
        if len(self.k_scale) != len(self.v_scale) or not self.k_scale:
            raise ValueError("k_scale and v_scale need one row per layer, the same number")
        for name, rows in (("k_scale", self.k_scale), ("v_scale", self.v_scale)):
            for i, row in enumerate(rows):
                if not row or not _usable_fp32(row):
                    raise ValueError(
                        f"{name}[{i}] must be positive finite numbers that stay so as the "
                        f"cache's fp32 (at most {SCALE_MAX:.8g}, not 0 once cast), got {row}"
                    )
        return self

    @property
    def num_layers(self) -> int:
        return len(self.k_scale)


def _usable_fp32(row: list[float]) -> bool:
    """Whether every value, cast to fp32 as `apply_scales` does, is positive and finite."""
    f32 = torch.tensor(row, dtype=torch.float64).to(torch.float32)
    return bool(((f32 > 0) & (f32 <= SCALE_MAX)).all())


def clamp_scale(scale: float) -> float:
    """`scale` brought into the range a scales file may hold (normal fp32)."""
    return min(max(scale, SCALE_MIN), SCALE_MAX)


def read_scales(path: Path) -> KVScales:
    """Parse a scales file; `KVScalesError` names the file and what is wrong."""
    try:
        return KVScales.model_validate(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError, ValidationError) as exc:
        raise KVScalesError(f"cannot read KV scales from {path}: {exc}") from exc


def write_scales(scales: KVScales, path: Path) -> None:
    """Write `scales` as indented JSON (atomically: readers never see half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(scales.model_dump_json(indent=2) + "\n")
    tmp.replace(path)


def apply_scales(caches: list[LayerKVCache], scales: KVScales) -> None:
    """Copy `scales` into fp8 caches' `k_scale`/`v_scale`, checking layers and heads match."""
    if len(caches) != scales.num_layers:
        raise KVScalesError(
            f"KV scales have {scales.num_layers} layers, the model has {len(caches)}"
        )
    for i, cache in enumerate(caches):
        if cache.kv_dtype != "fp8" or cache.k_scale is None or cache.v_scale is None:
            raise KVScalesError(f"layer {i} cache is {cache.kv_dtype}, static scales need fp8")
        for name, row, dst in (
            ("k_scale", scales.k_scale[i], cache.k_scale),
            ("v_scale", scales.v_scale[i], cache.v_scale),
        ):
            if len(row) != dst.numel():
                raise KVScalesError(
                    f"{name}[{i}] has {len(row)} heads, the model has {dst.numel()} kv heads"
                )
            dst.copy_(torch.tensor(row, dtype=torch.float32))


def model_scales_path(model: str) -> Path | None:
    """`<model dir>/kv_cache_scales.json` when that file exists, else None."""
    path = Path(model).expanduser() / SCALES_FILE
    return path if path.is_file() else None


def load_model_scales(model: str, caches: list[LayerKVCache]) -> Path | None:
    """Apply `<model dir>/kv_cache_scales.json` to fp8 caches when the file exists; the path
    applied, or None (no file, or a cache that is not fp8)."""
    if not caches or caches[0].kv_dtype != "fp8":
        return None
    path = model_scales_path(model)
    if path is None:
        return None
    apply_scales(caches, read_scales(path))
    return path
