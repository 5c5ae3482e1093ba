"""Every CUDA kernel compiles with NVRTC (no GPU needed) for compute_80 and compute_90, with
no warnings, and, where ptxas is installed, assembles for sm_80, sm_89 and sm_90 with the spill
bytes README.md states; bench/gpu_kernels.py counts its verdicts into its exit status."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

import pytest

from headroom.engine.attention import cuda_backend as cb
from headroom.engine.kernels import compile as kc

ROOT = Path(__file__).resolve().parent.parent
SPILL_ARCHS = ("sm_80", "sm_89", "sm_90")
# README's benchmark row: "spill bytes (ptxas 13.2, all 21 kernels): sm_80 0, sm_89 0, ..."
_README_SPILLS = re.compile(
    r"spill bytes \(ptxas (\d+)\.(\d+), all (\d+) kernels\): (sm_\d+ \d+(?:, sm_\d+ \d+)*)"
)


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


@pytest.fixture(scope="module")
def ptxas_usage() -> dict[str, list[kc.RegisterUsage]]:
    """ptxas -v of every kernel for each of SPILL_ARCHS."""
    if kc.find_ptxas() is None:
        pytest.skip("ptxas not installed (pip install 'nvidia-cuda-nvcc>=13.2,<14')")
    return {
        gpu: [
            u
            for r in kc.compile_variants(kc.all_variants(), "compute_" + gpu[3:]).values()
            for u in kc.ptxas_usage(r.ptx, gpu)
        ]
        for gpu in SPILL_ARCHS
    }


def test_spill_bytes_are_what_the_readme_states(
    ptxas_usage: dict[str, list[kc.RegisterUsage]],
) -> None:
    """README.md's per-architecture spill figures against ptxas, for every kernel."""
    for gpu, rows in sorted(ptxas_usage.items()):
        assert {u.kernel for u in rows} == {v.name for v in kc.all_variants()}
        for u in sorted(rows, key=lambda u: u.kernel):
            print(
                f"{gpu} {u.kernel:42s} {u.registers:4d} regs {u.spill_store_bytes:3d} B spill "
                f"stores {u.spill_load_bytes:3d} B spill loads {u.shared_bytes:6d} B smem"
            )
    m = _README_SPILLS.search((ROOT / "README.md").read_text())
    assert m, "README.md no longer states the kernels' spill bytes per architecture"
    ptxas = kc.find_ptxas()
    assert ptxas is not None
    release = kc.ptxas_version(ptxas)
    assert (int(m.group(1)), int(m.group(2))) == release, (
        f"README.md states spills for ptxas {m.group(1)}.{m.group(2)}, this is "
        f"{release[0]}.{release[1]}: re-measure (bench/gpu_kernels.py --compile-only)"
    )
    assert int(m.group(3)) == len(kc.all_variants())
    stated = {gpu: int(n) for gpu, n in re.findall(r"(sm_\d+) (\d+)", m.group(4))}
    measured = {
        gpu: sum(u.spill_store_bytes + u.spill_load_bytes for u in rows)
        for gpu, rows in ptxas_usage.items()
    }
    assert stated == measured, f"README.md states {stated}, ptxas measures {measured}"
    for gpu, rows in ptxas_usage.items():
        if stated[gpu] == 0:  # no spill also means no local-memory stack frame
            assert all(u.stack_bytes == 0 for u in rows), gpu


# ---------------------------------------------------------------- bench/gpu_kernels.py verdicts


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    from bench import gpu_kernels

    return gpu_kernels


def _fake_toolchain(monkeypatch: pytest.MonkeyPatch, spills: dict[tuple[str, str], int]) -> None:
    """NVRTC and ptxas stand-ins: no warnings, `spills[(gpu, kernel)]` spill-store bytes."""

    def compile_variants(variants: list[kc.KernelVariant], arch: str) -> dict[str, object]:
        return {"all.cu": kc.CompileResult(arch=arch, ptx="", cubin=None, log="")}

    def ptxas_usage(ptx: str, gpu: str, ptxas: Path | None = None) -> list[kc.RegisterUsage]:
        return [
            kc.RegisterUsage(v.name, 128, 0, spills.get((gpu, v.name), 0), 0, 0)
            for v in kc.all_variants()
        ]

    monkeypatch.setattr(kc, "compile_variants", compile_variants)
    monkeypatch.setattr(kc, "ptxas_usage", ptxas_usage)
    monkeypatch.setattr(kc, "find_ptxas", lambda: Path("/fake/ptxas"))
    monkeypatch.setattr(kc, "ptxas_version", lambda exe: (13, 2))
    monkeypatch.setattr(cb, "cuda_available", lambda: False)


def test_bench_without_a_gpu_says_so_with_exit_77(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_toolchain(monkeypatch, {})
    assert bench.main([]) == bench.EXIT_NEEDS_GPU == 77
    out = capsys.readouterr().out
    assert "correctness and timing need a GPU" in out
    assert "verdicts: 6 PASS, 0 MISS" in out
    assert bench.main(["--compile-only"]) == 0


def test_bench_counts_a_spill_as_a_miss_without_a_gpu(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_toolchain(monkeypatch, {("sm_80", "paged_attention_decode_bf16_fp8_d128"): 48})
    assert bench.main([]) == bench.EXIT_MISS == 1
    out = capsys.readouterr().out
    assert "sm_80: spill bytes 48 (48 stored, 0 loaded; target 0) MISS" in out
    assert "sm_90: spill bytes 0 (0 stored, 0 loaded; target 0) PASS" in out
    assert "5 PASS, 1 MISS, 0 informational (MISS: sm_80 spills 48 B)" in out
    assert bench.main(["--compile-only"]) == 1


def test_bench_without_ptxas_cannot_pass_the_spill_verdicts(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_toolchain(monkeypatch, {})
    monkeypatch.setattr(kc, "find_ptxas", lambda: None)
    assert bench.main(["--compile-only"]) == 1
    assert "the spill verdicts cannot be checked MISS" in capsys.readouterr().out


def test_bench_informational_rows_are_reported_not_counted(bench: ModuleType) -> None:
    verdicts = bench.Verdicts()
    assert verdicts(True, "a") == "PASS"
    assert verdicts(False, "b", informational=True) == "MISS (informational)"
    assert bench.finish(verdicts, 0.0, bench.EXIT_PASS) == 0
    assert verdicts(False, "c") == "MISS"
    assert bench.finish(verdicts, 0.0, bench.EXIT_NEEDS_GPU) == 1
    assert verdicts.summary() == "1 PASS, 1 MISS, 1 informational (MISS: c)"


@pytest.mark.slow
def test_bench_compile_only_runs_the_real_toolchain(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    if kc.find_ptxas() is None:
        pytest.skip("ptxas not installed")
    code = bench.main(["--compile-only"])
    out = capsys.readouterr().out
    for gpu in SPILL_ARCHS:
        assert re.search(rf"^{gpu}: spill bytes \d+ .* (PASS|MISS)", out, re.M), out
    summary = re.search(r"^verdicts: \d+ PASS, (\d+) MISS", out, re.M)
    assert summary, out
    assert code == (0 if summary.group(1) == "0" else 1)


# ---------------------------------------------------------------- compile.py's own logic


def test_instantiation_lines_use_the_kernels_kv_kind_numbers() -> None:
    """The KV kind each variant passes its template is common.cuh's `KvKind`: a wrong number
    still compiles, to a kernel that reads the cache in another format."""
    enum = re.search(r"enum KvKind \{([^}]*)\}", (kc.KERNEL_DIR / "common.cuh").read_text())
    assert enum, "common.cuh no longer declares enum KvKind"
    kinds = {
        name.removeprefix("KV_").lower(): value
        for name, value in re.findall(r"(KV_\w+) = (\d+)", enum.group(1))
    }
    assert kinds == {"auto": "0", "fp8": "1", "int8": "2"}
    for kv in kc.KV_DTYPES:
        assert kc.decode_variant("bf16", kv, 64).macro_args[1] == kinds[kv]
        assert kc.cache_write_variant("fp16", kv).macro_args[1] == kinds[kv]
    assert kc.decode_variant("fp16", "int8", 128).instantiation() == (
        "HEADROOM_DECODE_KERNEL(paged_attention_decode_fp16_int8_d128, __half, 2, 128)"
    )


def test_release_mismatch_names_both_versions_as_major_dot_minor(tmp_path: Path) -> None:
    """13050 in cuda_runtime_api.h is release 13.5, two ints, shown as `13.5` (not `13.5.0`);
    13000 is 13.0, not a 12.x."""
    (tmp_path / "cuda_runtime_api.h").write_text("#define CUDART_VERSION 13000\n")
    assert kc.header_cuda_version(tmp_path) == (13, 0)
    (tmp_path / "cuda_runtime_api.h").write_text("#define CUDART_VERSION 13050\n")
    version = kc.header_cuda_version(tmp_path)
    assert version == (13, 5) and all(type(n) is int for n in version)
    with pytest.raises(kc.KernelCompileError, match=r"NVRTC is 12\.8 but the headers is 13\.5;"):
        kc.check_same_release("the headers", version, (12, 8))
    kc.check_same_release("the headers", version, (13, 5))


def _fake_ptxas(tmp_path: Path, name: str, body: str) -> Path:
    """An executable shell script standing in for ptxas."""
    exe = tmp_path / name
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(0o755)
    return exe


def test_ptxas_version_refuses_output_it_cannot_read(tmp_path: Path) -> None:
    """No `release X.Y` in the output, or a failing exit status, is a KernelCompileError."""
    assert kc.ptxas_version(_fake_ptxas(tmp_path, "ok", "echo 'release 13.2, V13.2.51'\n")) == (
        13,
        2,
    )
    with pytest.raises(kc.KernelCompileError, match="cannot tell the version"):
        kc.ptxas_version(_fake_ptxas(tmp_path, "mute", "echo 'no version here'\n"))
    failing = _fake_ptxas(tmp_path, "failing", "echo 'release 13.2'; echo broken >&2; exit 3\n")
    with pytest.raises(kc.KernelCompileError, match="broken"):
        kc.ptxas_version(failing)


def test_ptxas_usage_parses_its_report_and_reports_its_failure(tmp_path: Path) -> None:
    """ptxas gets the PTX as a file and `-v --gpu-name`; its report is parsed from stderr and
    stdout, and a failing ptxas is a KernelCompileError carrying its stderr."""
    major, minor = kc.toolchain().nvrtc
    version = f"if [ \"$1\" = --version ]; then echo 'release {major}.{minor}'; exit 0; fi\n"
    report = _fake_ptxas(
        tmp_path,
        "report",
        version
        + 'echo "$@" > "$0.args"; cp "$4" "$0.ptx"\n'
        + "echo \"ptxas info    : Compiling entry function 'k' for '$3'\" >&2\n"
        + "echo 'ptxas info    : Used 40 registers, used 0 barriers, 400 bytes cmem[0]'\n",
    )
    (usage,) = kc.ptxas_usage(".version 9.0\n", "sm_90", report)
    assert (usage.kernel, usage.registers, usage.shared_bytes) == ("k", 40, 0)
    assert (tmp_path / "report.args").read_text().split()[:3] == ["-v", "--gpu-name", "sm_90"]
    assert (tmp_path / "report.ptx").read_text() == ".version 9.0\n"
    failing = _fake_ptxas(
        tmp_path, "failing", version + "echo 'ptxas fatal: bad PTX' >&2; exit 255\n"
    )
    with pytest.raises(
        kc.KernelCompileError, match=r"ptxas failed \(sm_80\):\nptxas fatal: bad PTX"
    ):
        kc.ptxas_usage("garbage", "sm_80", failing)


def test_parse_ptxas_report_resets_the_stack_frame_per_kernel() -> None:
    """A kernel whose report has no stack-frame line has none, not the previous kernel's; a
    `Used` line outside any entry function is no kernel."""
    text = """ptxas info    : Used 9 registers
ptxas info    : Compiling entry function 'foo' for 'sm_90'
    16 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 64 registers, used 0 barriers
ptxas info    : Compiling entry function 'bar' for 'sm_90'
ptxas info    : Used 32 registers, used 0 barriers
"""
    foo, bar = kc.parse_ptxas_report(text)
    assert (foo.kernel, foo.stack_bytes, foo.spill_store_bytes, foo.spill_load_bytes) == (
        "foo",
        16,
        8,
        8,
    )
    assert (bar.kernel, bar.registers) == ("bar", 32)
    assert (bar.stack_bytes, bar.spill_store_bytes, bar.spill_load_bytes) == (0, 0, 0)


def test_include_dir_search_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """HEADROOM_CUDA_INCLUDE wins, and one without the headers is refused rather than passed
    over; without it or the wheels' headers, CUDA_PATH's include folder is used, and with none
    of them the error says what to install or set."""
    import site

    import cuda.pathfinder

    def include(name: str) -> Path:
        folder = tmp_path / name / "include"
        folder.mkdir(parents=True)
        for header in ("cuda_bf16.h", "cuda_fp16.h", "cuda_fp8.h"):
            (folder / header).write_text("\n")
        return folder

    monkeypatch.setattr(cuda.pathfinder, "find_nvidia_header_directory", lambda lib: None)
    monkeypatch.setattr(site, "getsitepackages", lambda: [str(tmp_path / "site")])
    monkeypatch.setattr(site, "getusersitepackages", lambda: str(tmp_path / "user"))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setenv("CUDA_PATH", str(include("cuda_path").parent))
    monkeypatch.setenv("HEADROOM_CUDA_INCLUDE", str(include("override")))
    kc.cuda_include_dir.cache_clear()
    try:
        assert kc.cuda_include_dir() == tmp_path / "override" / "include"
        (tmp_path / "override" / "include" / "cuda_fp8.h").unlink()
        kc.cuda_include_dir.cache_clear()
        with pytest.raises(kc.KernelCompileError, match=r"HEADROOM_CUDA_INCLUDE=.* no cuda_fp8\.h"):
            kc.cuda_include_dir()
        monkeypatch.delenv("HEADROOM_CUDA_INCLUDE")
        kc.cuda_include_dir.cache_clear()
        assert kc.cuda_include_dir() == tmp_path / "cuda_path" / "include"
        monkeypatch.delenv("CUDA_PATH")
        kc.cuda_include_dir.cache_clear()
        if not Path("/usr/local/cuda/include/cuda_fp8.h").is_file():
            with pytest.raises(kc.KernelCompileError, match="set HEADROOM_CUDA_INCLUDE"):
                kc.cuda_include_dir()
    finally:
        kc.cuda_include_dir.cache_clear()
