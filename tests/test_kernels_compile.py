"""Every CUDA kernel compiles with NVRTC (no GPU needed) for compute_80 and compute_90, with
no warnings, and, where ptxas is installed, assembles with zero bytes of register spill."""

from __future__ import annotations

import pytest

from headroom.engine.kernels import compile as kc


@pytest.fixture(scope="module", params=kc.CHECK_ARCHS)
def compiled(request: pytest.FixtureRequest) -> dict[str, kc.CompileResult]:
    return kc.compile_variants(kc.all_variants(), request.param)


def test_nvrtc_loads_without_a_gpu() -> None:
    major, _ = kc.nvrtc_version()
    assert major >= 12
    assert (kc.cuda_include_dir() / "cuda_fp8.h").is_file()


def test_variant_list_covers_every_kernel_family() -> None:
    names = [v.name for v in kc.all_variants()]
    assert len(names) == len(set(names))
    decode = [n for n in names if n.startswith("paged_attention_decode_")]
    assert len(decode) == len(kc.QUERY_DTYPES) * len(kc.KV_DTYPES) * len(kc.HEAD_DIMS)
    assert {"paged_attention_reduce_bf16", "paged_attention_reduce_fp16", "copy_blocks"} <= set(
        names
    )
    assert sum(n.startswith("reshape_and_cache_") for n in names) == 6


def test_compiles_without_warnings(compiled: dict[str, kc.CompileResult]) -> None:
    for source, result in compiled.items():
        assert result.log == "", f"{source} ({result.arch}) compiled with warnings:\n{result.log}"
        target = result.arch.split("_")[1]
        assert f".target sm_{target}" in result.ptx


def test_every_variant_is_an_entry_point(compiled: dict[str, kc.CompileResult]) -> None:
    ptx = "".join(r.ptx for r in compiled.values())
    for v in kc.all_variants():
        assert f".entry {v.name}(" in ptx, v.name


def test_compile_error_is_reported_with_the_log() -> None:
    with pytest.raises(kc.KernelCompileError, match="undefined_thing"):
        kc.compile_program('extern "C" __global__ void k() { undefined_thing(); }', "compute_90")


def test_warnings_reach_the_log() -> None:
    result = kc.compile_program(
        'extern "C" __global__ void k(int* p) { int unused; p[0] = 1; }', "compute_90"
    )
    assert "unused" in result.log


def test_bad_arch_and_unknown_variant_are_rejected() -> None:
    with pytest.raises(ValueError, match="arch"):
        kc.nvrtc_options("hopper")
    with pytest.raises(ValueError, match="head_dim 96 is not compiled"):
        kc.decode_variant("bf16", "auto", 96)
    with pytest.raises(ValueError, match="one source file"):
        kc.program_source([kc.decode_variant("bf16", "auto", 64), kc.copy_blocks_variant()])


def test_parse_ptxas_report() -> None:
    text = """ptxas info    : Compiling entry function 'foo' for 'sm_90'
ptxas info    : Function properties for foo
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 33280 bytes smem, 472 bytes cmem[0]
ptxas info    : Compiling entry function 'bar' for 'sm_90'
ptxas info    : Function properties for bar
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 400 bytes cmem[0]
"""
    foo, bar = kc.parse_ptxas_report(text)
    assert (foo.kernel, foo.registers, foo.stack_bytes) == ("foo", 255, 8)
    assert (foo.spill_store_bytes, foo.spill_load_bytes, foo.shared_bytes) == (4, 12, 33280)
    assert (bar.kernel, bar.registers, bar.spill_store_bytes, bar.shared_bytes) == ("bar", 32, 0, 0)


def test_no_register_spills(compiled: dict[str, kc.CompileResult]) -> None:
    if kc.find_ptxas() is None:
        pytest.skip("ptxas not installed (pip install 'nvidia-cuda-nvcc>=13.2,<14')")
    rows = []
    for result in compiled.values():
        gpu = "sm_" + result.arch.split("_")[1]
        rows += [(gpu, u) for u in kc.ptxas_usage(result.ptx, gpu)]
    assert {u.kernel for _, u in rows} == {v.name for v in kc.all_variants()}
    for gpu, u in sorted(rows, key=lambda r: (r[0], r[1].kernel)):
        print(
            f"{gpu} {u.kernel:42s} {u.registers:4d} regs {u.spill_store_bytes:3d} B spill "
            f"stores {u.spill_load_bytes:3d} B spill loads {u.shared_bytes:6d} B smem"
        )
    spilled = [f"{gpu} {u.kernel}" for gpu, u in rows if u.spill_store_bytes or u.spill_load_bytes]
    assert not spilled, f"register spills in {spilled}"
    assert all(u.stack_bytes == 0 for _, u in rows)
