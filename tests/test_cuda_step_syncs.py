"""The CUDA backend's host code makes no host-device sync in a model step unless debug checks
are on, counted without a GPU.

The step runs the real model (`LlamaForCausalLM`, bf16, head_dim 64) through `CudaBackend`
on CPU tensors with a runtime that records launches instead of running them, under a
`TorchFunctionMode` that counts every torch call that would block the host on a CUDA tensor:
reading a value back (`item`, `int()`, `bool()`, `tolist`, `cpu`, ...), ops whose output
shape depends on the data (`nonzero`, `unique`, boolean-mask indexing, `repeat_interleave`
without `output_size`), and tensors built from Python data inside the step (a host-to-device
copy from pageable memory synchronises the stream). The same run with `check_values` on
must count the validators' reads, so the counter is shown to see what it is meant to.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from headroom.engine.attention import cuda_backend as cb
from headroom.engine.attention.base import LayerKVCache, allocate_layer_cache
from headroom.engine.block_table import slot_mapping
from headroom.engine.kernels import compile as kc
from headroom.engine.model import build_forward_batch, build_tiny, from_hf_dict

_READS = {"item", "__int__", "__float__", "__bool__", "__index__", "tolist", "cpu", "numpy"}
_DATA_SHAPED = {"nonzero", "unique", "unique_consecutive", "masked_select", "argwhere"}
_FROM_HOST = {"tensor", "as_tensor", "from_numpy"}


class SyncCounter(TorchFunctionMode):
    """Counts the torch calls that would synchronise the host with a CUDA device."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: Counter[str] = Counter()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in _READS or name in _DATA_SHAPED or name in _FROM_HOST:
            self.syncs[name] += 1
        elif name == "repeat_interleave" and "output_size" not in kwargs:
            if len(args) > 1 and isinstance(args[1], torch.Tensor):
                self.syncs[name] += 1
        elif name in ("__getitem__", "__setitem__") and _has_bool_index(args[1:2]):
            self.syncs[name + "[bool mask]"] += 1
        return func(*args, **kwargs)


def _has_bool_index(index: tuple[Any, ...]) -> bool:
    items = index[0] if index and isinstance(index[0], tuple) else index
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class RecordingRuntime:
    """A `KernelRuntime` that records each launch (kernel, grid) and runs nothing."""

    def __init__(self) -> None:
        self.launches: list[tuple[str, tuple[int, int, int]]] = []

    def function(self, variant: kc.KernelVariant, device: torch.device) -> Any:
        return variant.name

    def launch(
        self,
        fn: Any,
        device: torch.device,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: tuple[Any, ...],
        shared_mem: int = 0,
    ) -> None:
        self.launches.append((fn, grid))

    def resident_slots(self, fn: Any, device: torch.device) -> int:
        return 132 * 8


LAYERS = 3
BLOCK = 16


def _model() -> Any:
    cfg = from_hf_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 258,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "max_position_embeddings": 4096,
        }
    )
    model, _ = build_tiny(config=cfg, dtype=torch.bfloat16)
    return model


def _caches(kv_dtype: str) -> list[LayerKVCache]:
    return [
        allocate_layer_cache(64, BLOCK, 2, 64, torch.bfloat16, kv_dtype)  # type: ignore[arg-type]
        for _ in range(LAYERS)
    ]


def _step_batch() -> Any:
    """A mixed step: one prefill chunk after a 32-token cached prefix, and three decodes."""
    table = [0, 1, 2, 3]
    prefill = ([5] * 20, 32, slot_mapping(table, 32, 20, BLOCK), table)
    decodes = []
    for i in range(3):
        table_i = [8 + 4 * i + b for b in range(4)]
        pos = 40 + 10 * i
        decodes.append((7, pos, slot_mapping(table_i, pos, 1, BLOCK)[0], table_i))
    return build_forward_batch([prefill], decodes)


def _run_step(backend: cb.CudaBackend, kv_dtype: str) -> SyncCounter:
    model, caches, batch = _model(), _caches(kv_dtype), _step_batch()
    counter = SyncCounter()
    with torch.inference_mode(), counter:
        model(batch, caches, backend)
    return counter


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "int8"])
def test_a_model_step_through_the_cuda_backend_makes_no_sync(
    kv_dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(cb.DEBUG_CHECKS_ENV, raising=False)
    runtime = RecordingRuntime()
    counter = _run_step(cb.CudaBackend(runtime=runtime), kv_dtype)  # as select_backend makes it
    assert dict(counter.syncs) == {}
    kernels = Counter(name.split("_")[0] for name, _ in runtime.launches)
    # Every layer wrote its K/V and ran prefill and decode attention: the host code ran.
    assert len(runtime.launches) >= 3 * LAYERS, kernels


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_debug_checks_read_back_what_the_counter_sees(kv_dtype: str) -> None:
    counter = _run_step(cb.CudaBackend(check_values=True, runtime=RecordingRuntime()), kv_dtype)
    # Per layer: 2 for the slot range (write), 4 for block ids and lengths (decode), and the
    # prefill's table, lengths and start checks on top.
    assert counter.syncs["__int__"] >= 6 * LAYERS
    assert sum(counter.syncs.values()) >= 8 * LAYERS


def test_value_checks_are_off_by_default_and_on_with_the_debug_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(cb.DEBUG_CHECKS_ENV, raising=False)
    assert cb.CudaBackend().check_values is False
    monkeypatch.setenv(cb.DEBUG_CHECKS_ENV, "1")
    assert cb.CudaBackend().check_values is True
    assert cb.CudaBackend(check_values=False).check_values is False
    monkeypatch.setenv(cb.DEBUG_CHECKS_ENV, "0")
    assert cb.CudaBackend().check_values is False


def test_debug_checks_still_refuse_a_bad_block_id() -> None:
    backend = cb.CudaBackend(check_values=True, runtime=RecordingRuntime())
    cache = _caches("auto")[0]
    query = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    tables = torch.tensor([[0, 99]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_tables values must be in \[0, 64\)"):
        backend.decode(query, cache, torch.tensor([20], dtype=torch.int32), tables, 0.125)


def test_block_copies_upload_the_layer_table_once() -> None:
    backend = cb.CudaBackend(check_values=False, runtime=RecordingRuntime())
    caches = _caches("int8")
    src, dst = torch.tensor([1, 2]), torch.tensor([5, 6])
    backend.copy_blocks(caches, src, dst)  # the first call uploads the address table
    counter = SyncCounter()
    with counter:
        backend.copy_blocks(caches, src, dst)
    assert dict(counter.syncs) == {}
