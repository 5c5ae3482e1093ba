"""`CupyRuntime`'s CUBIN cache, without a GPU: NVRTC compiles for a named `sm_XY` on the CPU,
and only the two calls that need a device (the capability query and CuPy's module load) are
replaced. The cache is keyed by every kernel source and header, and a cache directory that
cannot be written (a read-only root filesystem) costs a compile, never a failed step."""

from __future__ import annotations

import contextlib
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from headroom.engine.attention import cuda_runtime as cr
from headroom.engine.kernels import compile as kc

ARCH = "sm_90"


class FakeLoads:
    """Stands in for `load_kernel` (cuModuleLoadData needs a GPU): records what it was given."""

    def __init__(self) -> None:
        self.loaded: list[tuple[bytes, str]] = []

    def __call__(self, cubin: bytes, name: str) -> cr.LoadedKernel:
        self.loaded.append((cubin, name))
        return cr.LoadedKernel(function=None, num_regs=32, shared_size_bytes=0)


@pytest.fixture
def gpu_stand_in(monkeypatch: pytest.MonkeyPatch) -> FakeLoads:
    import cupy

    loads = FakeLoads()
    monkeypatch.setattr(cr, "load_kernel", loads)
    monkeypatch.setattr(cr, "_UNWRITABLE", set())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(cupy.cuda, "Device", lambda index=None: contextlib.nullcontext())
    return loads


def test_the_cubin_key_changes_when_an_included_header_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernels = tmp_path / "kernels"
    shutil.copytree(kc.KERNEL_DIR, kernels, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(kc, "KERNEL_DIR", kernels)
    monkeypatch.setenv("HEADROOM_CACHE", str(tmp_path / "cache"))
    variant = kc.decode_variant("bf16", "fp8", 128)
    before = cr.cubin_path(variant, ARCH)
    assert '#include "common.cuh"' in kc.program_source([variant])
    header = kernels / "common.cuh"
    header.write_text(header.read_text() + "\n// an edited helper\n")
    assert cr.cubin_path(variant, ARCH) != before  # an old CUBIN is not reused
    header.write_text(header.read_text().removesuffix("\n// an edited helper\n"))
    assert cr.cubin_path(variant, ARCH) == before


def test_a_cached_cubin_is_loaded_without_compiling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpu_stand_in: FakeLoads
) -> None:
    monkeypatch.setenv("HEADROOM_CACHE", str(tmp_path))
    runtime = cr.CupyRuntime()
    device = torch.device("cuda", 0)
    runtime.function(kc.copy_blocks_variant(), device)  # compiles and stores
    path = cr.cubin_path(kc.copy_blocks_variant(), ARCH)
    assert path.read_bytes()[:4] == b"\x7fELF" and not list(path.parent.glob("*.tmp"))

    def no_compile(*_: Any, **__: Any) -> kc.CompileResult:
        raise AssertionError("compiled although the CUBIN was cached")

    monkeypatch.setattr(kc, "compile_program", no_compile)
    cr.CupyRuntime().function(kc.copy_blocks_variant(), device)
    assert [c for c, _ in gpu_stand_in.loaded] == [path.read_bytes()] * 2


@pytest.mark.parametrize("how", ["parent is a file", "write fails"])
def test_an_unwritable_kernel_cache_compiles_in_memory_and_warns_once(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    gpu_stand_in: FakeLoads,
    how: str,
) -> None:
    # The operator's pod: readOnlyRootFilesystem with HEADROOM_CACHE on the image's root.
    if how == "parent is a file":
        (tmp_path / "cache").write_text("")  # mkdir of cache/kernels fails, even as root
    else:

        def read_only(self: Path, data: bytes) -> int:
            raise OSError(30, "Read-only file system", str(self))

        monkeypatch.setattr(Path, "write_bytes", read_only)
    monkeypatch.setenv("HEADROOM_CACHE", str(tmp_path / "cache"))
    device = torch.device("cuda", 0)
    with caplog.at_level(logging.WARNING, logger="headroom.engine.attention"):
        for _ in range(2):  # a later step (a fresh runtime: nothing memoised) works as well
            fn = cr.CupyRuntime().function(kc.copy_blocks_variant(), device)
            assert isinstance(fn, cr.LoadedKernel)
    assert [name for _, name in gpu_stand_in.loaded] == ["copy_blocks", "copy_blocks"]
    assert all(cubin[:4] == b"\x7fELF" for cubin, _ in gpu_stand_in.loaded)
    warnings = [r for r in caplog.records if "kernel cache not writable" in r.getMessage()]
    assert len(warnings) == 1
    assert not list(tmp_path.rglob("*.tmp"))
