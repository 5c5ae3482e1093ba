"""NVRTC compilation of the CUDA kernels, with no GPU needed: variants, sources, PTX, ptxas.

The kernels are C++ templates in `*.cu` files beside this module; every launchable variant is
an `extern "C"` wrapper that `program_source` appends as one macro line, so a variant's symbol
is a plain C name and a program holds exactly the variants asked for.

Finding the toolchain: CuPy's `cupy_backends.cuda.libs.nvrtc` loads libnvrtc through
`cuda.pathfinder`, which searches site-packages first, so the `nvidia-cuda-nvrtc` wheel that
torch pulls in is found without CUDA_PATH. Should that lookup ever fail, `load_nvrtc`
preloads the library with `cuda.pathfinder.load_nvidia_dynamic_lib` (dlopen by absolute path;
a later dlopen of the soname then returns the loaded copy) and retries. NVRTC has no default
include path, so the fp16/bf16/fp8 headers come from the `nvidia-cuda-runtime` wheel's
include folder (found the same way) passed with `-I`. `ptxas`, only used to report registers
and spills, comes from the optional `nvidia-cuda-nvcc` wheel.

NVRTC, the headers and ptxas must be one CUDA release: NVRTC 12.8 reading the 13.5 headers
fails deep inside `cuda_fp8.hpp`, so `toolchain()` compares the versions first and refuses with
one line naming both (uv.lock holds all three, and torch's CUDA, to the same release).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

KERNEL_DIR = Path(__file__).resolve().parent

QUERY_DTYPES: tuple[str, ...] = ("bf16", "fp16")
KV_DTYPES: tuple[str, ...] = ("auto", "fp8", "int8")
HEAD_DIMS: tuple[int, ...] = (64, 128)
# Architectures the CI compile check covers (A100, H100/H200).
CHECK_ARCHS: tuple[str, ...] = ("compute_80", "compute_90")

_CXX_TYPE = {"bf16": "__nv_bfloat16", "fp16": "__half"}
_KV_KIND = {"auto": 0, "fp8": 1, "int8": 2}
_HEADERS_NEEDED = ("cuda_bf16.h", "cuda_fp16.h", "cuda_fp8.h")


class KernelCompileError(RuntimeError):
    """NVRTC rejected a program, or the toolchain could not be found."""


@dataclass(frozen=True, slots=True)
class KernelVariant:
    """One launchable kernel: its C symbol, source file and instantiation macro call."""

    name: str
    source: str
    macro: str
    macro_args: tuple[str, ...]

    def instantiation(self) -> str:
        return f"{self.macro}({', '.join((self.name, *self.macro_args))})"


def decode_variant(query_dtype: str, kv_dtype: str, head_dim: int) -> KernelVariant:
    """The paged decode attention kernel for one query dtype, cache dtype and head size."""
    _check_choice("query dtype", query_dtype, QUERY_DTYPES)
    _check_choice("kv dtype", kv_dtype, KV_DTYPES)
    _check_choice("head_dim", head_dim, HEAD_DIMS)
    return KernelVariant(
        name=f"paged_attention_decode_{query_dtype}_{kv_dtype}_d{head_dim}",
        source="paged_attention.cu",
        macro="HEADROOM_DECODE_KERNEL",
        macro_args=(_CXX_TYPE[query_dtype], str(_KV_KIND[kv_dtype]), str(head_dim)),
    )


def reduce_variant(query_dtype: str) -> KernelVariant:
    """The partition-combining kernel of split-context decode, writing `query_dtype`."""
    _check_choice("query dtype", query_dtype, QUERY_DTYPES)
    return KernelVariant(
        name=f"paged_attention_reduce_{query_dtype}",
        source="paged_attention.cu",
        macro="HEADROOM_REDUCE_KERNEL",
        macro_args=(_CXX_TYPE[query_dtype],),
    )


def cache_write_variant(input_dtype: str, kv_dtype: str) -> KernelVariant:
    """`reshape_and_cache` from `input_dtype` K/V rows into a `kv_dtype` cache."""
    _check_choice("input dtype", input_dtype, QUERY_DTYPES)
    _check_choice("kv dtype", kv_dtype, KV_DTYPES)
    return KernelVariant(
        name=f"reshape_and_cache_{input_dtype}_{kv_dtype}",
        source="cache_ops.cu",
        macro="HEADROOM_CACHE_WRITE_KERNEL",
        macro_args=(_CXX_TYPE[input_dtype], str(_KV_KIND[kv_dtype])),
    )


def copy_blocks_variant() -> KernelVariant:
    """The one dtype-agnostic copy-on-write kernel (no instantiation line needed)."""
    return KernelVariant(name="copy_blocks", source="cache_ops.cu", macro="", macro_args=())


def all_variants() -> list[KernelVariant]:
    """Every kernel the CUDA backend can launch: what the CI compile check builds."""
    variants = [
        decode_variant(q, kv, d) for q in QUERY_DTYPES for kv in KV_DTYPES for d in HEAD_DIMS
    ]
    variants += [reduce_variant(q) for q in QUERY_DTYPES]
    variants += [cache_write_variant(q, kv) for q in QUERY_DTYPES for kv in KV_DTYPES]
    variants.append(copy_blocks_variant())
    return variants


def program_source(variants: list[KernelVariant]) -> str:
    """The text of one NVRTC program holding `variants` (all from the same `.cu` file)."""
    sources = {v.source for v in variants}
    if len(sources) != 1:
        raise ValueError(f"a program compiles one source file, got {sorted(sources)}")
    text = (KERNEL_DIR / sources.pop()).read_text()
    lines = [v.instantiation() for v in variants if v.macro]
    return text + "\n" + "\n".join(lines) + "\n"


def sources_digest() -> str:
    """A sha256 of every kernel source and header beside this module (`*.cu*`): what any
    program may `#include`, so a compile cache keyed by it never serves a kernel built from
    an older `common.cuh`."""
    h = hashlib.sha256()
    for path in sorted(KERNEL_DIR.glob("*.cu*")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def group_by_source(variants: list[KernelVariant]) -> dict[str, list[KernelVariant]]:
    """Variants split into one list per source file (one NVRTC program each)."""
    groups: dict[str, list[KernelVariant]] = {}
    for v in variants:
        groups.setdefault(v.source, []).append(v)
    return groups


@dataclass(frozen=True, slots=True)
class CompileResult:
    """NVRTC's output for one program: PTX (or a CUBIN for an `sm_` target) and its log."""

    arch: str
    ptx: str
    cubin: bytes | None
    log: str


@cache
def load_nvrtc() -> Any:
    """CuPy's NVRTC bindings, with libnvrtc preloaded from site-packages if CuPy missed it."""
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
        return nvrtc
    except Exception as first:  # CuPy raises several types when libnvrtc is missing
        try:
            from cuda.pathfinder import load_nvidia_dynamic_lib

            load_nvidia_dynamic_lib("nvrtc")
            from cupy_backends.cuda.libs import nvrtc

            nvrtc.getVersion()
            return nvrtc
        except Exception as second:
            raise KernelCompileError(
                "cannot load NVRTC: install the CUDA 13 wheels torch depends on "
                f"(nvidia-cuda-nvrtc) and cupy-cuda13x ({first}; {second})"
            ) from second


def nvrtc_version() -> tuple[int, int]:
    """The loaded NVRTC's (major, minor)."""
    major, minor = load_nvrtc().getVersion()
    return int(major), int(minor)


@cache
def cuda_include_dir() -> Path:
    """The folder with `cuda_bf16.h`, `cuda_fp16.h` and `cuda_fp8.h` for NVRTC's `-I`."""
    candidates: list[Path] = []
    override = os.environ.get("HEADROOM_CUDA_INCLUDE")
    if override:
        # Told where: headers found anywhere else would not be the ones the user chose.
        missing = [h for h in _HEADERS_NEEDED if not (Path(override) / h).is_file()]
        if missing:
            raise KernelCompileError(
                f"HEADROOM_CUDA_INCLUDE={override} has no {', '.join(missing)}: point it at "
                "a CUDA include folder, or unset it to search the nvidia wheels and CUDA_PATH"
            )
        return Path(override)
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cudart")
        if found:
            candidates.append(Path(found))
    except Exception:  # an old cuda-pathfinder without the header finder; search below
        pass
    import site

    for root in [*site.getsitepackages(), site.getusersitepackages()]:
        candidates.extend(sorted(Path(root).glob("nvidia/cu*/include")))
        candidates.append(Path(root) / "nvidia" / "cuda_runtime" / "include")
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            candidates.append(Path(os.environ[env]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    for path in candidates:
        if all((path / h).is_file() for h in _HEADERS_NEEDED):
            return path
    raise KernelCompileError(
        f"no CUDA include folder with {', '.join(_HEADERS_NEEDED)}: install the "
        "nvidia-cuda-runtime wheel (a torch dependency) or set HEADROOM_CUDA_INCLUDE"
    )


_VERSION_DEFINES = (
    ("cuda_runtime_api.h", re.compile(r"#define\s+CUDART_VERSION\s+(\d+)")),
    ("cuda.h", re.compile(r"#define\s+CUDA_VERSION\s+(\d+)")),
)


def header_cuda_version(include_dir: Path) -> tuple[int, int]:
    """The CUDA release of an include folder, from `CUDART_VERSION` (13020 is 13.2)."""
    for header, pattern in _VERSION_DEFINES:
        path = include_dir / header
        if path.is_file() and (m := pattern.search(path.read_text(errors="replace"))):
            number = int(m.group(1))
            return number // 1000, number % 1000 // 10
    raise KernelCompileError(
        f"cannot tell the CUDA release of the headers in {include_dir}: "
        "neither cuda_runtime_api.h nor cuda.h defines its version"
    )


def ptxas_version(exe: Path) -> tuple[int, int]:
    """The CUDA release of a `ptxas` binary, from `ptxas --version`."""
    proc = subprocess.run(
        [str(exe), "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    m = re.search(r"release (\d+)\.(\d+)", proc.stdout)
    if proc.returncode != 0 or m is None:
        raise KernelCompileError(f"cannot tell the version of {exe}: {proc.stderr.strip()}")
    return int(m.group(1)), int(m.group(2))


def _dotted(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def check_same_release(what: str, version: tuple[int, int], nvrtc: tuple[int, int]) -> None:
    """Refuse a CUDA component of another release than NVRTC's, in one line naming both."""
    if version != nvrtc:
        raise KernelCompileError(
            f"CUDA release mismatch: NVRTC is {_dotted(nvrtc)} but {what} is {_dotted(version)}; "
            "install one CUDA release for both (uv.lock pins them together: run make venv)"
        )


@dataclass(frozen=True, slots=True)
class Toolchain:
    """The NVRTC and headers a compile uses, checked to be one CUDA release."""

    nvrtc: tuple[int, int]
    include_dir: Path

    def describe(self) -> str:
        # toolchain() refused any other header release, so one version names both.
        v = _dotted(self.nvrtc)
        return f"NVRTC {v} with the CUDA {v} headers in {self.include_dir}"


@cache
def toolchain() -> Toolchain:
    """NVRTC and the include folder, refused (`KernelCompileError`) unless one CUDA release."""
    nvrtc = nvrtc_version()
    include = cuda_include_dir()
    check_same_release(f"the headers in {include}", header_cuda_version(include), nvrtc)
    return Toolchain(nvrtc=nvrtc, include_dir=include)


def nvrtc_options(arch: str) -> list[str]:
    """Compile flags for `arch` (`compute_90` for PTX, `sm_90` for a CUBIN)."""
    if not re.fullmatch(r"(compute|sm)_\d+a?", arch):
        raise ValueError(f"arch must look like compute_90 or sm_90, got {arch!r}")
    return [
        f"--gpu-architecture={arch}",
        "--std=c++17",
        f"-I{toolchain().include_dir}",
        f"-I{KERNEL_DIR}",
    ]


def compile_program(source: str, arch: str, name: str = "headroom.cu") -> CompileResult:
    """Compile one program with NVRTC; raises `KernelCompileError` with the log on failure."""
    nvrtc = load_nvrtc()
    prog = nvrtc.createProgram(source, name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, nvrtc_options(arch))
        except nvrtc.NVRTCError as exc:
            log = _decode(nvrtc.getProgramLog(prog))
            raise KernelCompileError(f"NVRTC failed for {name} ({arch}):\n{log}") from exc
        log = _decode(nvrtc.getProgramLog(prog)).strip()
        ptx = _decode(nvrtc.getPTX(prog))
        cubin = bytes(nvrtc.getCUBIN(prog)) if arch.startswith("sm_") else None
    finally:
        nvrtc.destroyProgram(prog)
    return CompileResult(arch=arch, ptx=ptx, cubin=cubin, log=log)


def compile_variants(variants: list[KernelVariant], arch: str) -> dict[str, CompileResult]:
    """Compile `variants` for `arch`, one program per source file, keyed by source name."""
    return {
        src: compile_program(program_source(group), arch, name=src)
        for src, group in group_by_source(variants).items()
    }


@dataclass(frozen=True, slots=True)
class RegisterUsage:
    """What `ptxas -v` reports for one kernel."""

    kernel: str
    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    shared_bytes: int


def find_ptxas() -> Path | None:
    """The `ptxas` binary (from the nvidia-cuda-nvcc wheel or a CUDA install), if any."""
    try:
        from cuda.pathfinder import find_nvidia_binary_utility

        found = find_nvidia_binary_utility("ptxas")
        if found:
            return Path(found)
    except Exception:  # an old cuda-pathfinder; fall back to PATH
        pass
    which = shutil.which("ptxas")
    return Path(which) if which else None


def ptxas_usage(ptx: str, gpu_name: str, ptxas: Path | None = None) -> list[RegisterUsage]:
    """Assemble PTX with `ptxas -v --gpu-name gpu_name` and parse the per-kernel report."""
    exe = ptxas or find_ptxas()
    if exe is None:
        raise FileNotFoundError("ptxas not found (pip install nvidia-cuda-nvcc)")
    check_same_release(f"ptxas ({exe})", ptxas_version(exe), toolchain().nvrtc)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernels.ptx"
        src.write_text(ptx)
        proc = subprocess.run(
            [str(exe), "-v", "--gpu-name", gpu_name, str(src), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    if proc.returncode != 0:
        raise KernelCompileError(f"ptxas failed ({gpu_name}):\n{proc.stderr}")
    return parse_ptxas_report(proc.stderr + proc.stdout)


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas_report(text: str) -> list[RegisterUsage]:
    """Per-kernel registers, stack, spills and shared memory from `ptxas -v` output."""
    out: list[RegisterUsage] = []
    kernel: str | None = None
    stack = (0, 0, 0)
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            kernel, stack = m.group(1), (0, 0, 0)
        elif (m := _STACK.search(line)) and kernel is not None:
            stack = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
        elif (m := _USED.search(line)) and kernel is not None:
            out.append(
                RegisterUsage(
                    kernel=kernel,
                    registers=int(m.group(1)),
                    stack_bytes=stack[0],
                    spill_store_bytes=stack[1],
                    spill_load_bytes=stack[2],
                    shared_bytes=int(m.group(2) or 0),
                )
            )
            kernel = None
    return out


def _check_choice(what: str, value: object, allowed: tuple[object, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{what} {value!r} is not compiled; choose one of {allowed}")


def _decode(raw: bytes | str) -> str:
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    return text.rstrip("\x00")
