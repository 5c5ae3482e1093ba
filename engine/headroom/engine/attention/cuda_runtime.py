"""Where the CUDA kernels come from and how they run: NVRTC-compiled CUBINs cached under
`$HEADROOM_CACHE/kernels` (keyed by source, headers, flags and NVRTC version), loaded from
memory and launched on torch's current stream; `KernelRuntime` is the seam the CPU emulator
fills in tests.

The disk cache only saves compile time: a directory that cannot be created or written (a
read-only root filesystem) is logged once and the kernels are compiled in memory instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from functools import cache
from pathlib import Path
from typing import Any, Protocol

import torch

from headroom.engine.attention.cuda_validate import DECODE_THREADS, _require
from headroom.engine.kernels import compile as kc


@cache
def cuda_unavailable_reason() -> str | None:
    """None when torch sees a CUDA GPU, CuPy sees one too, and NVRTC loads; else why not (a
    toolchain refusal, such as a HEADROOM_CUDA_INCLUDE without the headers, word for word)."""
    try:
        import cupy
    except ImportError as exc:
        return f"CuPy cannot be imported: {exc}"
    if not torch.cuda.is_available():
        return "torch sees no GPU"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy sees no GPU"
        kc.toolchain()
    except Exception as exc:  # no driver, no device or no toolchain all mean "not available"
        return f"{type(exc).__name__}: {exc}"
    return None


def cuda_available() -> bool:
    """True when torch sees a CUDA GPU, CuPy sees one too, and NVRTC loads."""
    return cuda_unavailable_reason() is None


log = logging.getLogger("headroom.engine.attention")


def _cache_dir() -> Path:
    root = os.environ.get("HEADROOM_CACHE") or str(Path.home() / ".cache" / "headroom")
    return Path(root) / "kernels"


def cubin_path(variant: kc.KernelVariant, arch: str) -> Path:
    """Where the CUBIN of `variant` for `arch` is cached: keyed by the program text, every
    kernel source and header it may include, the NVRTC flags and NVRTC's version."""
    parts = [kc.program_source([variant]), kc.sources_digest(), *kc.nvrtc_options(arch)]
    digest = hashlib.sha256("\0".join([*parts, repr(kc.nvrtc_version())]).encode())
    return _cache_dir() / f"{variant.name}-{arch}-{digest.hexdigest()[:24]}.cubin"


def cubin_bytes(variant: kc.KernelVariant, arch: str) -> bytes:
    """The CUBIN of `variant` for `arch`: from the disk cache, else compiled (and cached
    when the cache directory is writable)."""
    path = cubin_path(variant, arch)
    try:
        return path.read_bytes()
    except OSError:  # not cached yet (or unreadable): compile it
        pass
    result = kc.compile_program(kc.program_source([variant]), arch, name=variant.source)
    assert result.cubin is not None
    _store(path, result.cubin)
    return result.cubin


_UNWRITABLE: set[Path] = set()  # cache directories already reported


def _store(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        tmp.replace(path)  # atomic: concurrent workers never read half a file
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if path.parent not in _UNWRITABLE:
            _UNWRITABLE.add(path.parent)
            log.warning(
                "kernel cache not writable; compiling kernels in memory",
                extra={"dir": str(path.parent), "error": str(exc)},
            )


class KernelRuntime(Protocol):
    """Where kernels come from and how they run; `CupyRuntime` on a GPU (tests swap in an
    emulator so the launchers' grids and argument lists are checked on CPU)."""

    def function(self, variant: kc.KernelVariant, device: torch.device) -> Any:
        """The launchable kernel `variant` for `device`."""
        ...

    def launch(
        self,
        fn: Any,
        device: torch.device,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: tuple[Any, ...],
        shared_mem: int = 0,
    ) -> None:
        """Launch `fn` with numpy-scalar `args` (np.uint64 addresses, np.int32/np.int64/
        np.float32 values) on the current stream of `device`."""
        ...

    def resident_slots(self, fn: Any, device: torch.device) -> int:
        """How many CTAs of `fn` the whole device holds at once."""
        ...


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class LoadedKernel:
    """One kernel of a CUBIN loaded from memory (`cuModuleLoadData` through CuPy's `Module`):
    called like a `cupy.RawKernel`, with the register and static shared-memory counts the
    occupancy estimate reads."""

    __slots__ = ("function", "num_regs", "shared_size_bytes")

    def __init__(self, function: Any, num_regs: int, shared_size_bytes: int) -> None:
        self.function = function  # holds its Module, so the CUBIN stays loaded
        self.num_regs = num_regs
        self.shared_size_bytes = shared_size_bytes

    def __call__(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: tuple[Any, ...],
        shared_mem: int = 0,
    ) -> None:
        self.function(grid, block, args, shared_mem=shared_mem)


def load_kernel(cubin: bytes, name: str) -> LoadedKernel:
    """Kernel `name` of `cubin`, loaded on the current CuPy device."""
    from cupy.cuda.function import Module
    from cupy_backends.cuda.api import driver

    module = Module()
    module.load(cubin)
    fn = module.get_function(name)
    return LoadedKernel(
        fn,
        int(driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_NUM_REGS, fn.ptr)),
        int(driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn.ptr)),
    )


class CupyRuntime:
    """NVRTC-compiled CUBINs (cached on disk when it can be written) loaded from memory,
    launched on torch's current stream through `cupy.cuda.ExternalStream`."""

    def __init__(self) -> None:
        self._functions: dict[tuple[str, int], Any] = {}

    def function(self, variant: kc.KernelVariant, device: torch.device) -> Any:
        _require(device.type == "cuda", f"the cuda backend needs CUDA tensors, got {device}")
        key = (variant.name, _device_index(device))
        fn = self._functions.get(key)
        if fn is None:
            fn = self._load(variant, key[1])
            self._functions[key] = fn
        return fn

    def _load(self, variant: kc.KernelVariant, index: int) -> Any:
        import cupy

        major, minor = torch.cuda.get_device_capability(index)
        cubin = cubin_bytes(variant, f"sm_{major}{minor}")
        with cupy.cuda.Device(index):
            return load_kernel(cubin, variant.name)

    def launch(
        self,
        fn: Any,
        device: torch.device,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: tuple[Any, ...],
        shared_mem: int = 0,
    ) -> None:
        import cupy

        index = _device_index(device)
        stream = torch.cuda.current_stream(device)
        with cupy.cuda.Device(index), cupy.cuda.ExternalStream(stream.cuda_stream, index):
            fn(grid, block, args, shared_mem=shared_mem)

    def resident_slots(self, fn: Any, device: torch.device) -> int:
        return _resident_slots(int(fn.num_regs), int(fn.shared_size_bytes), _device_index(device))


@cache
def _resident_slots(fn_regs: int, fn_smem: int, device_index: int) -> int:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device_index)
    regs_per_warp = -(-max(fn_regs, 1) * 32 // 256) * 256
    by_regs = int(props["regsPerMultiprocessor"]) // (regs_per_warp * (DECODE_THREADS // 32))
    by_smem = int(props["sharedMemPerMultiprocessor"]) // max(fn_smem, 1)
    per_sm = max(1, min(by_regs, by_smem, 32))
    return per_sm * int(props["multiProcessorCount"])


_DEFAULT_RUNTIME: CupyRuntime | None = None


def default_runtime() -> CupyRuntime:
    """The process-wide CuPy runtime (kernels compiled once per process and device)."""
    global _DEFAULT_RUNTIME
    if _DEFAULT_RUNTIME is None:
        _DEFAULT_RUNTIME = CupyRuntime()
    return _DEFAULT_RUNTIME
