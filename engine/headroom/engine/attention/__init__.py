"""Paged attention backends and their selection (`--attention-backend auto|torch|cuda`).

The CUDA backend (CuPy kernels) is imported only when asked for or when `auto` finds a GPU,
so CPU-only installs never import CuPy.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch

from headroom.engine.attention.base import (
    AttentionBackend,
    KVDtype,
    LayerKVCache,
    allocate_layer_cache,
    storage_dtype,
)
from headroom.engine.attention.torch_backend import TorchBackend

BackendName = Literal["auto", "torch", "cuda"]
log = logging.getLogger("headroom.engine.attention")


class BackendUnavailable(RuntimeError):
    """The requested attention backend cannot run here (no GPU, no CuPy, wrong device)."""


def _cuda_backend_status(device: torch.device) -> str | None:
    """None when the CUDA backend can run on `device`, else the reason it cannot."""
    if device.type != "cuda":
        return f"the cuda attention backend needs a CUDA device, the engine runs on {device}"
    if not torch.cuda.is_available():
        return "the cuda attention backend needs a GPU, and torch sees none"
    try:
        from headroom.engine.attention import cuda_backend
    except ImportError as exc:  # CuPy missing or the backend module not installed
        return f"the cuda attention backend cannot be imported: {exc}"
    if (why := cuda_backend.cuda_unavailable_reason()) is not None:
        return f"the cuda attention backend cannot run: {why}"
    return None


def cuda_shape_reason(
    head_dim: int | None, block_size: int | None, dtype: torch.dtype | None = None
) -> str | None:
    """None when the CUDA kernels are compiled for this head size, block size and model dtype,
    else why not (checked at start-up: the kernels' own check runs only at the first request,
    after the model has loaded)."""
    from headroom.engine.attention.cuda_validate import _QUERY_DTYPES, TILE_TOKENS
    from headroom.engine.kernels.compile import HEAD_DIMS

    if dtype is not None and dtype not in _QUERY_DTYPES:
        name = str(dtype).removeprefix("torch.")
        return (
            f"the cuda attention kernels take bfloat16 or float16 models, the model runs in "
            f"{name}; use --dtype bfloat16 or --attention-backend torch"
        )
    if head_dim is not None and head_dim not in HEAD_DIMS:
        return f"the cuda attention kernels take head_dim {HEAD_DIMS}, the model has {head_dim}"
    if block_size is not None and block_size % TILE_TOKENS != 0:
        return f"the cuda attention kernels take blocks of {TILE_TOKENS}k tokens, got {block_size}"
    return None


def select_backend(
    name: BackendName,
    device: torch.device | str,
    head_dim: int | None = None,
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """The backend for `name` on `device`: "auto" picks cuda when a GPU and CuPy are present
    and its kernels fit the model's head size, the block size and the model's dtype (`dtype`,
    the weights' and so the KV cache's), else torch; "cuda" where they do not fit raises
    `BackendUnavailable` saying why."""
    dev = torch.device(device)
    if name == "torch":
        return TorchBackend()
    if name not in ("auto", "cuda"):
        raise ValueError(f"attention backend must be auto, torch or cuda, got {name!r}")
    reason = _cuda_backend_status(dev) or cuda_shape_reason(head_dim, block_size, dtype)
    if reason is None:
        from headroom.engine.attention.cuda_backend import CudaBackend

        backend: AttentionBackend = CudaBackend()
        return backend
    if name == "cuda":
        raise BackendUnavailable(reason)
    if dev.type == "cuda":
        log.warning("attention backend torch", extra={"reason": reason})
    return TorchBackend()


__all__ = [
    "AttentionBackend",
    "BackendName",
    "BackendUnavailable",
    "KVDtype",
    "LayerKVCache",
    "TorchBackend",
    "allocate_layer_cache",
    "select_backend",
    "storage_dtype",
]
