"""NVRTC, the CUDA headers, ptxas, torch's CUDA and CuPy's wheel are one CUDA release, and a
mismatch is refused up front in one line naming both versions (not deep inside a header)."""

from __future__ import annotations

from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
import torch

from headroom.engine.kernels import compile as kc


@pytest.fixture
def fresh_toolchain() -> Iterator[None]:
    kc.toolchain.cache_clear()
    kc.cuda_include_dir.cache_clear()
    yield
    kc.toolchain.cache_clear()
    kc.cuda_include_dir.cache_clear()


def _include_dir(tmp_path: Path, cudart_version: int) -> Path:
    inc = tmp_path / "include"
    inc.mkdir(parents=True)
    for header in ("cuda_bf16.h", "cuda_fp16.h", "cuda_fp8.h"):
        # What NVRTC 12.8 choked on in the 13.5 headers: it must never get this far.
        (inc / header).write_text("this declaration has no storage class;\n")
    (inc / "cuda_runtime_api.h").write_text(f"#define CUDART_VERSION  {cudart_version}\n")
    return inc


def test_installed_components_are_one_release() -> None:
    nvrtc = kc.nvrtc_version()
    assert kc.header_cuda_version(kc.cuda_include_dir()) == nvrtc
    ptxas = kc.find_ptxas()
    assert ptxas is not None, "ptxas comes from the locked nvidia-cuda-nvcc wheel"
    assert kc.ptxas_version(ptxas) == nvrtc
    assert torch.version.cuda is not None, "the lock installs torch's CUDA build"
    assert tuple(int(x) for x in torch.version.cuda.split(".")[:2]) == nvrtc
    cupy_majors = {
        int(d.metadata["Name"].removeprefix("cupy-cuda").removesuffix("x"))
        for d in metadata.distributions()
        if (d.metadata["Name"] or "").startswith("cupy-cuda")
    }
    assert cupy_majors == {nvrtc[0]}


def test_header_version_is_read_from_cudart(tmp_path: Path) -> None:
    assert kc.header_cuda_version(_include_dir(tmp_path, 13050)) == (13, 5)
    assert kc.header_cuda_version(_include_dir(tmp_path / "b", 12080)) == (12, 8)


def test_header_without_a_version_is_refused(tmp_path: Path) -> None:
    with pytest.raises(kc.KernelCompileError, match="cannot tell the CUDA release"):
        kc.header_cuda_version(tmp_path)


def test_mismatched_headers_fail_in_one_line_naming_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_toolchain: None
) -> None:
    monkeypatch.setenv("HEADROOM_CUDA_INCLUDE", str(_include_dir(tmp_path, 13050)))
    monkeypatch.setattr(kc, "nvrtc_version", lambda: (12, 8))
    with pytest.raises(kc.KernelCompileError) as info:
        kc.compile_program('extern "C" __global__ void k() {}', "compute_90")
    message = str(info.value)
    assert "\n" not in message
    assert "NVRTC is 12.8" in message and "is 13.5" in message
    assert str(tmp_path) in message


def test_ptxas_of_another_release_is_refused(
    monkeypatch: pytest.MonkeyPatch, fresh_toolchain: None
) -> None:
    ptxas = kc.find_ptxas()
    assert ptxas is not None
    major, minor = kc.nvrtc_version()
    monkeypatch.setattr(kc, "ptxas_version", lambda exe: (major, minor + 3))
    expected = rf"NVRTC is {major}\.{minor} but ptxas .* is {major}\.{minor + 3}"
    with pytest.raises(kc.KernelCompileError, match=expected):
        kc.ptxas_usage(".version 9.0\n.target sm_90\n", "sm_90", ptxas)


def test_toolchain_says_what_it_used() -> None:
    text = kc.toolchain().describe()
    assert f"NVRTC {'.'.join(map(str, kc.nvrtc_version()))}" in text
    assert str(kc.cuda_include_dir()) in text


def test_a_toolchain_refusal_is_the_reason_the_cuda_backend_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_toolchain: None
) -> None:
    """On a GPU machine whose HEADROOM_CUDA_INCLUDE lacks the headers, `--attention-backend
    cuda` is refused with that reason, not a generic "CuPy or its runtime unavailable" (and
    `auto` logs it as it falls back to torch)."""
    import cupy

    from headroom.engine.attention import BackendUnavailable, select_backend
    from headroom.engine.attention import cuda_runtime as cr

    monkeypatch.setenv("HEADROOM_CUDA_INCLUDE", str(tmp_path))  # no headers there
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", lambda: 1)
    cr.cuda_unavailable_reason.cache_clear()
    try:
        with pytest.raises(BackendUnavailable) as info:
            select_backend("cuda", torch.device("cuda"), 128, 16, torch.float16)
    finally:
        cr.cuda_unavailable_reason.cache_clear()
    assert "the cuda attention backend cannot run: KernelCompileError: " in str(info.value)
    assert f"HEADROOM_CUDA_INCLUDE={tmp_path} has no cuda_bf16.h" in str(info.value)
