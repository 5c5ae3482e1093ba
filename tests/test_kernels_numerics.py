"""The CUDA kernels against an fp32 torch reference, through the real Python launchers.

Every test runs twice: `emulated` on CPU and `gpu` on a CUDA device (marked `gpu`, skipped
when torch or CuPy sees no device). For `emulated`, `kernels/host_emulation.cuh` turns every
CUDA thread into a fiber and the warp collectives into barriers, so the unchanged kernel
sources build with g++ into a small library, and an `EmulatedRuntime` plugs it into
`cuda_backend` where CuPy would be. Both cover the launchers' grids and argument lists (the
emulator checks each launch against the kernel's signature), the fragment mappings, the
online softmax, the split-context reduce, masking of stale (NaN-poisoned) slots, quantised
writes and block copies. What emulation cannot check is the hardware (it takes the MMA
fragment layout from the PTX ISA); the `gpu` runs and bench/gpu_kernels.py do.

The emulator also interleaves each CTA's threads in a seeded random order (HEADROOM_EMU_SEED,
default 1) with yields at every shared-memory access, checks shared memory for races and
uninitialised reads, and requires vector loads and stores to be naturally aligned; any failed
check fails the launch with its message. The tests at the end prove those checks bite: each
`__syncthreads()` of paged_attention.cu, removed, is reported as a race and gives a wrong
result under some schedule, and misaligned 16- and 8-byte accesses are reported.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from headroom.engine.attention import cuda_backend as cb
from headroom.engine.attention.base import LayerKVCache, allocate_layer_cache
from headroom.engine.attention.torch_backend import TorchBackend
from headroom.engine.kernels import compile as kc

_SIGNATURES = {
    "HEADROOM_DECODE_KERNEL": "PPPPPPPPPPPPiiiiLLiif",
    "HEADROOM_REDUCE_KERNEL": "PPPPPiiii",
    "HEADROOM_CACHE_WRITE_KERNEL": "PPPPPPPiiLLLL",
    "": "PPLL",
}

_DRIVER_HEAD = r"""
#include "paged_attention.cu"
#include "cache_ops.cu"
#include <cstring>
#include <type_traits>

extern "C" const char* emu_error() { return emu::launch_error(); }
extern "C" void emu_configure(unsigned long long seed, int race_check) {
  emu::configure(seed, race_check != 0);
}

template <typename T>
T arg(const unsigned long long* a, int i) {
  if constexpr (std::is_pointer_v<T>) {
    return reinterpret_cast<T>(a[i]);
  } else if constexpr (std::is_same_v<T, float>) {
    unsigned u = static_cast<unsigned>(a[i]);
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  } else {
    return static_cast<T>(static_cast<long long>(a[i]));
  }
}

template <typename F>
bool run_grid(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
              unsigned long long smem, F& f) {
  return emu::launch({gx, gy, gz}, {bx, by, bz}, smem,
                     [](void* p) { (*static_cast<F*>(p))(); }, &f);
}

// 0: ran clean; 1: argument codes differ from the kernel's signature; 2: an emulation check
// failed (emu_error() says which).
#define EMU_BEGIN(NAME, SIG)                                                               \
  extern "C" int launch_##NAME(unsigned gx, unsigned gy, unsigned gz, unsigned bx,         \
                               unsigned by, unsigned bz, unsigned long long smem,          \
                               const char* codes, const unsigned long long* a) {           \
    if (std::strcmp(codes, SIG) != 0) return 1;                                            \
    auto body = [&]() {
#define EMU_END                                          \
  };                                                     \
  return run_grid(gx, gy, gz, bx, by, bz, smem, body) ? 0 : 2; \
  }

#define EMU_DECODE(NAME, QT)                                                                \
  EMU_BEGIN(NAME, "PPPPPPPPPPPPiiiiLLiif")                                                 \
  NAME(arg<QT*>(a, 0), arg<float*>(a, 1), arg<float*>(a, 2), arg<float*>(a, 3),              \
       arg<const QT*>(a, 4), arg<const unsigned char*>(a, 5), arg<const unsigned char*>(a, 6), \
       arg<const float*>(a, 7), arg<const float*>(a, 8), arg<const int*>(a, 9),                \
       arg<const int*>(a, 10), arg<const int*>(a, 11), arg<int>(a, 12), arg<int>(a, 13),       \
       arg<int>(a, 14), arg<int>(a, 15), arg<long long>(a, 16), arg<long long>(a, 17),         \
       arg<int>(a, 18), arg<int>(a, 19), arg<float>(a, 20));                                   \
  EMU_END

#define EMU_REDUCE(NAME, QT)                                                                 \
  EMU_BEGIN(NAME, "PPPPPiiii")                                                              \
  NAME(arg<QT*>(a, 0), arg<const float*>(a, 1), arg<const float*>(a, 2),                      \
       arg<const float*>(a, 3), arg<const int*>(a, 4), arg<int>(a, 5), arg<int>(a, 6),         \
       arg<int>(a, 7), arg<int>(a, 8));                                                        \
  EMU_END

#define EMU_CACHE_WRITE(NAME, IT)                                                            \
  EMU_BEGIN(NAME, "PPPPPPPiiLLLL")                                                          \
  NAME(arg<const IT*>(a, 0), arg<const IT*>(a, 1), arg<unsigned char*>(a, 2),                 \
       arg<unsigned char*>(a, 3), arg<float*>(a, 4), arg<float*>(a, 5),                        \
       arg<const long long*>(a, 6), arg<int>(a, 7), arg<int>(a, 8), arg<long long>(a, 9),      \
       arg<long long>(a, 10), arg<long long>(a, 11), arg<long long>(a, 12));                   \
  EMU_END

EMU_BEGIN(copy_blocks, "PPLL")
copy_blocks(arg<const long long*>(a, 0), arg<const long long*>(a, 1), arg<long long>(a, 2),
            arg<long long>(a, 3));
EMU_END
"""

_EMU_MACRO = {
    "HEADROOM_DECODE_KERNEL": "EMU_DECODE",
    "HEADROOM_REDUCE_KERNEL": "EMU_REDUCE",
    "HEADROOM_CACHE_WRITE_KERNEL": "EMU_CACHE_WRITE",
}
# The schedule seed of the emulated runs (each seed is another interleaving of the threads).
EMU_SEED = int(os.environ.get("HEADROOM_EMU_SEED", "1"))


def _driver_source(variants: list[kc.KernelVariant] | None = None, prelude: str = "") -> str:
    lines = [prelude, _DRIVER_HEAD]
    for v in kc.all_variants() if variants is None else variants:
        if v.macro:
            lines.append(v.instantiation())
            lines.append(f"{_EMU_MACRO[v.macro]}({v.name}, {v.macro_args[0]})")
    return "\n".join(lines) + "\n"


def build_emulated(source: str, kernel_dir: Path = kc.KERNEL_DIR) -> ctypes.CDLL:
    """`source` built for the host against the kernels in `kernel_dir` (then KERNEL_DIR);
    cached by a hash of every input to the build."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++ for the host emulation")
    dirs = list(dict.fromkeys([kernel_dir, kc.KERNEL_DIR]))
    flags = ["-std=c++17", "-O1", "-shared", "-fPIC", "-DHEADROOM_HOST_EMULATION"]
    compiler = subprocess.run(["g++", "--version"], capture_output=True, text=True, check=True)
    # Everything the library depends on is in its key: sources, flags and the compiler.
    inputs = "\0".join(
        [
            source,
            *flags,
            compiler.stdout,
            *(p.read_text() for d in dirs for p in sorted(d.glob("*.cu*"))),
        ]
    )
    digest = hashlib.sha256(inputs.encode()).hexdigest()[:20]
    cache = Path(os.environ.get("HEADROOM_CACHE", Path.home() / ".cache" / "headroom"))
    lib = cache / "emulated-kernels" / f"kernels-{digest}.so"
    if not lib.is_file():
        lib.parent.mkdir(parents=True, exist_ok=True)
        # Per process, source and library both: a shared .cpp rewritten (truncated first) by a
        # concurrent run could be compiled half-written into a library cached for good.
        src = lib.with_suffix(f".{os.getpid()}.cpp")
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        src.write_text(source)
        cmd = ["g++", *flags, *[f"-I{d}" for d in dirs], str(src), "-o", str(tmp)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
            assert proc.returncode == 0, proc.stderr[-4000:]
            tmp.replace(lib)
        finally:
            src.unlink(missing_ok=True)
            tmp.unlink(missing_ok=True)
    out = ctypes.CDLL(str(lib))
    out.emu_error.restype = ctypes.c_char_p
    out.emu_configure.argtypes = [ctypes.c_ulonglong, ctypes.c_int]
    out.emu_configure(EMU_SEED, 1)
    return out


@pytest.fixture(scope="module")
def emulator() -> ctypes.CDLL:
    """Every kernel built for the host, race check on, schedule seed EMU_SEED."""
    return build_emulated(_driver_source())


class EmulatedRuntime:
    """`cuda_backend.KernelRuntime` over the emulated kernels (CPU tensors, CPU pointers)."""

    def __init__(self, lib: ctypes.CDLL, strict: bool = True) -> None:
        self.lib = lib
        self.strict = strict  # a failed emulation check fails the launch; else it is kept
        self.launches: list[tuple[str, tuple[int, int, int]]] = []
        self.errors: list[str] = []

    def function(self, variant: kc.KernelVariant, device: torch.device) -> Any:
        fn = getattr(self.lib, f"launch_{variant.name}")
        fn.restype = ctypes.c_int
        return (variant, fn)

    def launch(
        self,
        fn: Any,
        device: torch.device,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: tuple[Any, ...],
        shared_mem: int = 0,
    ) -> None:
        variant, cfn = fn
        codes, slots = _pack(args)
        assert codes == _SIGNATURES[variant.macro], (variant.name, codes)
        arr = (ctypes.c_ulonglong * len(slots))(*slots)
        rc = cfn(
            *[ctypes.c_uint(x) for x in (*grid, *block)],
            ctypes.c_ulonglong(shared_mem),
            codes.encode(),
            arr,
        )
        assert rc != 1, f"{variant.name}: argument codes {codes}"
        if rc == 2:
            error = f"{variant.name}: {self.lib.emu_error().decode()}"
            assert not self.strict, error
            self.errors.append(error)
        self.launches.append((variant.name, grid))

    def resident_slots(self, fn: Any, device: torch.device) -> int:
        return 4


def _pack(args: tuple[Any, ...]) -> tuple[str, list[int]]:
    codes, slots = [], []
    for a in args:
        if isinstance(a, np.uint64):
            codes.append("P")
            slots.append(int(a))
        elif isinstance(a, np.int32):
            codes.append("i")
            slots.append(int(a) & (2**64 - 1))
        elif isinstance(a, np.int64):
            codes.append("L")
            slots.append(int(a) & (2**64 - 1))
        elif isinstance(a, np.float32):
            codes.append("f")
            slots.append(struct.unpack("<I", struct.pack("<f", float(a)))[0])
        else:
            raise TypeError(f"launch argument of type {type(a).__name__}; pass numpy scalars")
    return "".join(codes), slots


@dataclass
class Runner:
    """Where kernels run: the host emulator on CPU tensors or CuPy on CUDA tensors."""

    device: torch.device
    runtime: Any

    def cache(self, c: LayerKVCache) -> LayerKVCache:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(self.device)

        key, value = move(c.key), move(c.value)
        assert key is not None and value is not None
        return LayerKVCache(key, value, c.kv_dtype, move(c.k_scale), move(c.v_scale))

    def t(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.device)

    def launched(self) -> list[str] | None:
        """Kernel names launched so far (None where the runtime does not record them)."""
        if isinstance(self.runtime, EmulatedRuntime):
            return [n for n, _ in self.runtime.launches]
        return None


def _gpu_present() -> bool:
    return cb.cuda_available()


@pytest.fixture(params=["emulated", pytest.param("gpu", marks=pytest.mark.gpu)])
def runner(request: pytest.FixtureRequest) -> Runner:
    if request.param == "gpu":
        if not _gpu_present():
            pytest.skip("no CUDA GPU visible to torch and CuPy")
        return Runner(torch.device("cuda"), None)
    return Runner(torch.device("cpu"), EmulatedRuntime(request.getfixturevalue("emulator")))


# ---------------------------------------------------------------- fp32 reference


def reference_rows(
    query: torch.Tensor,
    cache: LayerKVCache,
    row_lens: list[int],
    row_seq: list[int],
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of each query row over the first row_lens[r] tokens of its sequence."""
    k_all, v_all = cache.dequantized()
    bs, hkv, d = cache.block_size, cache.num_kv_heads, cache.head_dim
    k_flat, v_flat = k_all.reshape(-1, hkv, d), v_all.reshape(-1, hkv, d)
    heads = query.shape[1]
    group = heads // hkv
    out = torch.zeros(query.shape, dtype=torch.float32)
    for r, (n, s) in enumerate(zip(row_lens, row_seq, strict=True)):
        if n == 0:
            continue
        pos = torch.arange(n)
        slots = block_tables[s].long()[pos // bs] * bs + pos % bs
        k = k_flat[slots].repeat_interleave(group, dim=1)  # [n, heads, d]
        v = v_flat[slots].repeat_interleave(group, dim=1)
        logits = torch.einsum("hd,nhd->hn", query[r].float(), k) * scale
        out[r] = torch.einsum("hn,nhd->hd", logits.softmax(-1), v)
    return out


def quantize_reference(
    x: torch.Tensor, kv_dtype: str, head_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, Any]:
    """Stored codes (and int8 per-row scales) per base.py's conventions."""
    xf = x.float()
    if kv_dtype == "fp8":
        assert head_scale is not None
        q = (xf / head_scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        return q, None
    amax = xf.abs().amax(-1)
    s = amax / 127
    q = torch.where(s[..., None] > 0, torch.round(xf / s[..., None]), torch.zeros_like(xf))
    return q.clamp(-127, 127).to(torch.int8), s


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


# ---------------------------------------------------------------- random paged inputs


def make_cache(
    num_blocks: int,
    block_size: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    kv_dtype: str,
    gen: torch.Generator,
) -> LayerKVCache:
    """A cache whose every slot holds poison (NaN where the format has one)."""
    cache = allocate_layer_cache(num_blocks, block_size, hkv, d, dtype, kv_dtype)  # type: ignore[arg-type]
    if kv_dtype == "auto":
        cache.key.fill_(float("nan"))
        cache.value.fill_(float("nan"))
    elif kv_dtype == "fp8":
        cache.key.view(torch.uint8).fill_(0x7F)  # e4m3fn NaN
        cache.value.view(torch.uint8).fill_(0x7F)
        assert cache.k_scale is not None and cache.v_scale is not None
        cache.k_scale.copy_(torch.rand(hkv, generator=gen) * 0.5 + 0.05)
        cache.v_scale.copy_(torch.rand(hkv, generator=gen) * 0.5 + 0.05)
    else:
        cache.key.fill_(127)
        cache.value.fill_(-127)
        assert cache.k_scale is not None and cache.v_scale is not None
        cache.k_scale.fill_(float("nan"))
        cache.v_scale.fill_(float("nan"))
    return cache


def fill_slots(
    cache: LayerKVCache, slots: torch.Tensor, dtype: torch.dtype, gen: torch.Generator
) -> None:
    """Random K/V at `slots`, stored the way write_kv would store them."""
    n, hkv, d = slots.numel(), cache.num_kv_heads, cache.head_dim
    for tensor, scales in ((cache.key, cache.k_scale), (cache.value, cache.v_scale)):
        x = (torch.randn(n, hkv, d, generator=gen) * 2).to(dtype)
        flat = tensor.view(-1, hkv, d)
        if cache.kv_dtype == "auto":
            flat[slots] = x
        elif cache.kv_dtype == "fp8":
            assert scales is not None
            flat[slots] = quantize_reference(x, "fp8", scales)[0]
        else:
            assert scales is not None
            q, s = quantize_reference(x, "int8")
            flat[slots] = q
            scales.view(-1, hkv)[slots] = s


def make_tables(
    lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator
) -> torch.Tensor:
    """Disjoint random blocks per sequence, padded with 0 past each sequence's end."""
    need = [max(1, -(-n // block_size)) for n in lens]
    width = max(need)
    perm = torch.randperm(num_blocks, generator=gen)
    assert sum(need) <= num_blocks
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    at = 0
    for i, k in enumerate(need):
        table[i, :k] = perm[at : at + k]
        at += k
    return table


def used_slots(lens: list[int], table: torch.Tensor, block_size: int) -> torch.Tensor:
    out = []
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        out.append(table[i].long()[pos // block_size] * block_size + pos % block_size)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


# ---------------------------------------------------------------- tests

DECODE_CASES = [
    # (query dtype, kv dtype, head_dim, block_size, kv heads, group, lens, partition_size)
    ("bf16", "auto", 64, 16, 2, 4, [1, 37, 100], 0),
    ("bf16", "auto", 64, 32, 2, 1, [16, 70, 5], 32),
    ("fp16", "auto", 128, 16, 1, 8, [50, 3], 0),
    ("bf16", "auto", 64, 16, 1, 18, [40, 17], 0),  # group > 16: two head chunks per kv head
    ("bf16", "fp8", 64, 16, 2, 4, [33, 90], 48),
    ("fp16", "fp8", 128, 32, 1, 4, [64, 9], 0),
    ("bf16", "int8", 64, 32, 2, 4, [81, 1], 0),
    ("fp16", "int8", 128, 16, 1, 2, [45, 120], 64),
]
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _case_id(c: tuple[Any, ...]) -> str:
    return f"{c[0]}-{c[1]}-d{c[2]}-bs{c[3]}-g{c[5]}-p{c[7]}"


def _paged_setup(
    lens: list[int],
    bs: int,
    hkv: int,
    group: int,
    d: int,
    dtype: torch.dtype,
    kv_dtype: str,
    seed: int,
    spare_blocks: int = 3,
) -> tuple[LayerKVCache, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(max(1, -(-n // bs)) for n in lens) + spare_blocks
    cache = make_cache(num_blocks, bs, hkv, d, dtype, kv_dtype, gen)
    table = make_tables(lens, bs, num_blocks, gen)
    fill_slots(cache, used_slots(lens, table, bs), dtype, gen)
    query = torch.randn(len(lens), hkv * group, d, generator=gen).to(dtype)
    return cache, table, query


@pytest.mark.parametrize("case", DECODE_CASES, ids=_case_id)
def test_decode_matches_fp32_reference(runner: Runner, case: tuple[Any, ...]) -> None:
    qname, kv_dtype, d, bs, hkv, group, lens, part = case
    dtype = _DTYPES[qname]
    cache, table, query = _paged_setup(
        lens, bs, hkv, group, d, dtype, kv_dtype, seed=len(lens) * 1000 + d + bs + group
    )
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = 1 / math.sqrt(d)
    out = runner.t(torch.full(query.shape, float("nan"), dtype=dtype))  # poisoned
    cb.paged_decode(
        runner.t(query),
        runner.cache(cache),
        runner.t(seq_lens),
        runner.t(table),
        scale,
        out=out,
        partition_size=part,
        runtime=runner.runtime,
    )
    ref = reference_rows(query, cache, lens, list(range(len(lens))), table, scale)
    got = out.cpu()
    assert torch.isfinite(got).all()
    assert rel_err(got, ref) < 1e-2
    names = runner.launched()
    if names is not None:
        assert names[0].startswith("paged_attention_decode_")
        assert (len(names) == 2) == (part > 0)  # split context adds the reduce launch


@pytest.mark.parametrize("v_std", [1.0, 1e-3, 1e-5, 1e-6, 3e4, "mixed"], ids=str)
@pytest.mark.parametrize("part", [0, 32])
def test_int8_values_of_any_magnitude_match_the_torch_backend(
    runner: Runner, v_std: float | str, part: int
) -> None:
    # The int8 V scales once went through f16: |v| ~ 1e-5 lost precision, ~ 1e-6 read as 0 and
    # |v| >= 65520 gave inf/NaN. The torch backend dequantises in fp32, so must the kernel;
    # "mixed" alternates 1e-4 and 1e2 rows inside every 16-token tile.
    gen = torch.Generator().manual_seed(7)
    bs, hkv, group, d, n = 16, 2, 4, 128, 80
    cache = allocate_layer_cache(8, bs, hkv, d, torch.bfloat16, "int8")
    if v_std == "mixed":
        std = torch.tensor([1e-4, 1e2]).repeat(n // 2)[:, None, None]
    else:
        std = torch.tensor(float(v_std))
    key = torch.randn(n, hkv, d, generator=gen).bfloat16()
    value = (torch.randn(n, hkv, d, generator=gen) * std).bfloat16()
    slots = torch.arange(n, dtype=torch.int64)
    table = torch.randperm(8, generator=gen).to(torch.int32)[None, : -(-n // bs)]
    slots = (table[0].long()[slots // bs] * bs + slots % bs).contiguous()
    query = torch.randn(1, hkv * group, d, generator=gen).bfloat16()
    lens = torch.tensor([n], dtype=torch.int32)
    scale = 1 / math.sqrt(d)
    TorchBackend().write_kv(key, value, cache, slots)
    got = cb.paged_decode(
        runner.t(query),
        runner.cache(cache),
        runner.t(lens),
        runner.t(table),
        scale,
        partition_size=part,
        runtime=runner.runtime,
    ).cpu()
    ref = TorchBackend().decode(query, cache, lens, table, scale)
    assert torch.isfinite(got).all()
    assert rel_err(got, ref) < 2e-3, (rel_err(got, ref), float(ref.float().abs().max()))


def test_decode_with_strided_query(runner: Runner) -> None:
    """A query sliced out of a fused QKV projection (row stride > heads * head_dim)."""
    gen = torch.Generator().manual_seed(7)
    lens, bs, hkv, group, d = [20, 33], 16, 2, 2, 64
    cache = make_cache(8, bs, hkv, d, torch.bfloat16, "auto", gen)
    table = make_tables(lens, bs, 8, gen)
    fill_slots(cache, used_slots(lens, table, bs), torch.bfloat16, gen)
    qkv = torch.randn(len(lens), (hkv * group + 2 * hkv) * d, generator=gen).to(torch.bfloat16)
    query = runner.t(qkv)[:, : hkv * group * d].view(len(lens), hkv * group, d)
    assert not query.is_contiguous()
    out = cb.paged_decode(
        query,
        runner.cache(cache),
        runner.t(torch.tensor(lens, dtype=torch.int32)),
        runner.t(table),
        0.125,
        runtime=runner.runtime,
    )
    ref = reference_rows(query.cpu(), cache, lens, [0, 1], table, 0.125)
    assert rel_err(out.cpu(), ref) < 1e-2


def test_decode_heuristic_split_matches_single_pass(runner: Runner) -> None:
    """Few CTAs and a long table make the heuristic split; both paths agree."""
    lens = [700]
    cache, table, query = _paged_setup(lens, 16, 1, 4, 64, torch.bfloat16, "auto", seed=11)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    args = (runner.t(query), runner.cache(cache), runner.t(seq_lens), runner.t(table), 0.125)
    split = cb.paged_decode(*args, runtime=runner.runtime)
    names = runner.launched()
    if names is not None:
        assert names[-1].startswith("paged_attention_reduce_")
    single = cb.paged_decode(*args, partition_size=0, runtime=runner.runtime)
    ref = reference_rows(query, cache, lens, [0], table, 0.125)
    assert rel_err(split.cpu(), ref) < 1e-2 and rel_err(single.cpu(), ref) < 1e-2


def test_zero_length_context_gives_zeros(runner: Runner) -> None:
    gen = torch.Generator().manual_seed(3)
    cache = make_cache(4, 16, 1, 64, torch.float16, "auto", gen)
    table = torch.tensor([[1], [2]], dtype=torch.int32)
    fill_slots(cache, used_slots([5], table[1:], 16), torch.float16, gen)
    query = torch.randn(2, 2, 64, generator=gen).to(torch.float16)
    for part in (0, 32):
        out = cb.paged_decode(
            runner.t(query),
            runner.cache(cache),
            runner.t(torch.tensor([0, 5], dtype=torch.int32)),
            runner.t(table),
            0.1,
            partition_size=part,
            runtime=runner.runtime,
        ).cpu()
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "int8"])
def test_prefill_causal_over_cached_prefix(runner: Runner, kv_dtype: str) -> None:
    """Chunk rows attend causally to the cached prefix and their own earlier rows."""
    gen = torch.Generator().manual_seed(5)
    bs, hkv, group, d = 16, 2, 2, 64
    seq_lens_l, chunk = [30, 9], [6, 9]  # seq 0: 24 cached + 6 new; seq 1: all new
    cache = make_cache(8, bs, hkv, d, torch.bfloat16, kv_dtype, gen)
    table = make_tables(seq_lens_l, bs, 8, gen)
    fill_slots(cache, used_slots(seq_lens_l, table, bs), torch.bfloat16, gen)
    query = torch.randn(sum(chunk), hkv * group, d, generator=gen).to(torch.bfloat16)
    qsl = torch.tensor([0, chunk[0], sum(chunk)], dtype=torch.int32)
    backend = cb.CudaBackend(runtime=runner.runtime)
    out = backend.prefill(
        runner.t(query),
        runner.cache(cache),
        runner.t(qsl),
        runner.t(torch.tensor(seq_lens_l, dtype=torch.int32)),
        runner.t(table),
        0.125,
    )
    row_lens = [24 + k + 1 for k in range(6)] + [k + 1 for k in range(9)]
    ref = reference_rows(query, cache, row_lens, [0] * 6 + [1] * 9, table, 0.125)
    assert rel_err(out.cpu(), ref) < 1e-2


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_write_kv_stores_reference_codes(runner: Runner, kv_dtype: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(9)
    bs, hkv, d, n = 16, 3, 64, 7
    cache = runner.cache(make_cache(4, bs, hkv, d, dtype, kv_dtype, gen))
    before_k = cache.key.cpu().clone()
    fused = torch.randn(n, 2 * hkv, d, generator=gen).to(dtype) * 3
    fused[2, 1] = 0  # an all-zero row: int8 scale 0, codes 0
    fused_dev = runner.t(fused)
    key, value = fused_dev[:, :hkv], fused_dev[:, hkv:]  # strided views, as from a fused QKV
    slots = torch.tensor([5, 17, -1, 40, 63, 0, 33], dtype=torch.int64)
    cb.CudaBackend(runtime=runner.runtime).write_kv(key, value, cache, runner.t(slots))
    keep = slots >= 0
    for x, stored, scales in (
        (fused[:, :hkv], cache.key, cache.k_scale),
        (fused[:, hkv:], cache.value, cache.v_scale),
    ):
        got = stored.cpu().view(-1, hkv, d)[slots[keep]]
        if kv_dtype == "auto":
            assert torch.equal(got, x[keep])
        elif kv_dtype == "fp8":
            assert scales is not None
            want, _ = quantize_reference(x[keep], "fp8", scales.cpu())
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        else:
            assert scales is not None
            want, s = quantize_reference(x[keep], "int8")
            assert (got.int() - want.int()).abs().max() <= 1  # x/s vs torch: one ulp apart
            assert torch.equal(scales.cpu().view(-1, hkv)[slots[keep]], s)
    # the skipped token and untouched slots keep their old contents
    untouched = torch.ones(cache.num_blocks * bs, dtype=torch.bool)
    untouched[slots[keep]] = False
    flat_before, flat_after = before_k.view(-1, hkv, d), cache.key.cpu().view(-1, hkv, d)
    assert torch.equal(
        flat_after[untouched].view(torch.uint8), flat_before[untouched].view(torch.uint8)
    )


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_copy_blocks_all_layers_and_scales(runner: Runner, kv_dtype: str) -> None:
    gen = torch.Generator().manual_seed(13)
    caches = []
    for _ in range(3):
        c = allocate_layer_cache(6, 16, 2, 64, torch.float16, kv_dtype)  # type: ignore[arg-type]
        c.key.view(torch.uint8).copy_(
            torch.randint(0, 120, c.key.view(torch.uint8).shape, generator=gen, dtype=torch.uint8)
        )
        c.value.view(torch.uint8).copy_(
            torch.randint(0, 120, c.value.view(torch.uint8).shape, generator=gen, dtype=torch.uint8)
        )
        if c.k_scale is not None and c.v_scale is not None:
            c.k_scale.copy_(torch.rand(c.k_scale.shape, generator=gen))
            c.v_scale.copy_(torch.rand(c.v_scale.shape, generator=gen))
        caches.append(runner.cache(c))
    before = [
        (
            c.key.cpu().clone(),
            c.value.cpu().clone(),
            c.k_scale.cpu().clone() if c.k_scale is not None else None,
        )
        for c in caches
    ]
    src, dst = torch.tensor([0, 4], dtype=torch.int64), torch.tensor([3, 1], dtype=torch.int64)
    cb.CudaBackend(runtime=runner.runtime).copy_blocks(caches, runner.t(src), runner.t(dst))
    names = runner.launched()
    if names is not None:
        assert names == ["copy_blocks"]  # one launch for every layer and pair
    for c, (k0, v0, s0) in zip(caches, before, strict=True):
        key, value = c.key.cpu(), c.value.cpu()
        for s, t in ((0, 3), (4, 1)):
            assert torch.equal(key[t], k0[s]) and torch.equal(value[t], v0[s])
            if s0 is not None:
                assert c.k_scale is not None and torch.equal(c.k_scale.cpu()[t], s0[s])
        for untouched in (0, 2, 4, 5):
            assert torch.equal(key[untouched], k0[untouched])


# ---------------------------------------------------------------- the emulation's own checks

_BARRIER = "__syncthreads();"
_BARRIER_SEEDS = (1, 2, 3, 4, 5, 6, 7, 8)
_BARRIER_PRELUDE = """
static int g_skip_barrier = -1;
extern "C" void emu_skip_barrier(int k) { g_skip_barrier = k; }
#define HEADROOM_TEST_BARRIER(k) \\
  do {                           \\
    if ((k) != g_skip_barrier) { \\
      __syncthreads();           \\
    }                            \\
  } while (0)
"""


@pytest.fixture(scope="module")
def barrier_lab(tmp_path_factory: pytest.TempPathFactory) -> tuple[ctypes.CDLL, int]:
    """A copy of paged_attention.cu whose k-th `__syncthreads();` the test can remove
    (`emu_skip_barrier(k)`; -1 keeps them all), built with the bf16 d64 decode and reduce."""
    parts = (kc.KERNEL_DIR / "paged_attention.cu").read_text().split(_BARRIER)
    mutated = parts[0] + "".join(f"HEADROOM_TEST_BARRIER({k});{p}" for k, p in enumerate(parts[1:]))
    folder = tmp_path_factory.mktemp("barrier-lab")
    (folder / "paged_attention.cu").write_text(mutated)
    variants = [kc.decode_variant("bf16", "auto", 64), kc.reduce_variant("bf16")]
    lib = build_emulated(_driver_source(variants, prelude=_BARRIER_PRELUDE), folder)
    lib.emu_skip_barrier.argtypes = [ctypes.c_int]
    return lib, len(parts) - 1


# (lens, partition_size): 2 tiles per partition, so two warps of a decode CTA hold tiles;
# then 38 partitions in row 1, so every warp of the reduce kernel holds some.
_LAB_CASES = (([37, 100], 32), ([37, 600], 16))


def _split_decode(
    lib: ctypes.CDLL, seed: int, race_check: bool, lens: list[int], part: int
) -> tuple[float, list[str]]:
    """Split-context decode (decode + reduce) on schedule `seed`: error vs fp32, failed checks."""
    cache, table, query = _paged_setup(lens, 16, 2, 4, 64, torch.bfloat16, "auto", seed=17)
    runtime = EmulatedRuntime(lib, strict=False)
    lib.emu_configure(seed, int(race_check))
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cb.paged_decode(
        query, cache, seq_lens, table, 0.125, out=out, partition_size=part, runtime=runtime
    )
    assert [n for n, _ in runtime.launches] == [
        "paged_attention_decode_bf16_auto_d64",
        "paged_attention_reduce_bf16",
    ]
    ref = reference_rows(query, cache, lens, [0, 1], table, 0.125)
    err = rel_err(out, ref) if torch.isfinite(out).all() else math.inf
    return err, runtime.errors


def test_kernels_with_every_barrier_pass_on_several_schedules(
    barrier_lab: tuple[ctypes.CDLL, int],
) -> None:
    lib, _ = barrier_lab
    lib.emu_skip_barrier(-1)
    for seed in _BARRIER_SEEDS:
        for lens, part in _LAB_CASES:
            err, errors = _split_decode(lib, seed, True, lens, part)
            assert errors == [] and err < 1e-2, (seed, lens, err, errors)


@pytest.mark.parametrize("k", range(6))
def test_a_removed_barrier_is_caught(barrier_lab: tuple[ctypes.CDLL, int], k: int) -> None:
    """Each of paged_attention.cu's barriers is needed: without it the race check fires on
    every schedule, and with the check off some schedule computes a wrong result."""
    lib, count = barrier_lab
    assert count == 6, "paged_attention.cu's barrier count changed: update the parametrize"
    lib.emu_skip_barrier(k)
    try:
        for seed in _BARRIER_SEEDS[:2]:
            errors = [e for c in _LAB_CASES for e in _split_decode(lib, seed, True, *c)[1]]
            assert errors, f"barrier {k} removed, seed {seed}: no race reported"
            assert "shared-memory race" in errors[0] or "uninitialised" in errors[0], errors
        wrong = next(
            (
                (seed, lens)
                for seed in _BARRIER_SEEDS
                for lens, part in _LAB_CASES
                if _split_decode(lib, seed, False, lens, part)[0] > 1e-2
            ),
            None,
        )
        assert wrong, f"barrier {k} removed: every schedule still computed the right result"
    finally:
        lib.emu_skip_barrier(-1)


_ALIGN_SOURCE = r"""
#include "common.cuh"

extern "C" const char* emu_error() { return emu::launch_error(); }
extern "C" void emu_configure(unsigned long long seed, int race_check) {
  emu::configure(seed, race_check != 0);
}

// 32 threads copy 32 vectors of 16 (wide) or 8 bytes from `src` to `dst` with the kernels'
// load16 / load8 and a vector store.
extern "C" int copy_vectors(const unsigned char* src, unsigned char* dst, int wide) {
  auto body = [&]() {
    const int i = threadIdx.x;
    if (wide) {
      const uint4 v = headroom::load16(src + 16 * i);
      *reinterpret_cast<uint4*>(dst + 16 * i) = v;
    } else {
      const uint2 v = headroom::load8(src + 8 * i);
      *reinterpret_cast<uint2*>(dst + 8 * i) = v;
    }
  };
  using F = decltype(body);
  return emu::launch({1, 1, 1}, {32, 1, 1}, 0, [](void* p) { (*static_cast<F*>(p))(); }, &body)
             ? 0
             : 2;
}
"""


@pytest.mark.parametrize(
    ("wide", "src_off", "dst_off", "message"),
    [
        (1, 0, 0, None),
        (0, 8, 8, None),
        (1, 4, 0, "misaligned 16-byte load at 0x"),
        (1, 8, 0, "(address % 16 = 8)"),
        (1, 0, 8, "misaligned 16-byte store"),
        (0, 4, 0, "misaligned 8-byte load"),
    ],
)
def test_vector_access_alignment_is_checked(
    wide: int, src_off: int, dst_off: int, message: str | None
) -> None:
    lib = build_emulated(_ALIGN_SOURCE)
    width = 16 if wide else 8
    src = np.arange(1024, dtype=np.uint8)
    dst = np.zeros(1024, dtype=np.uint8)
    s0 = (-src.ctypes.data) % 16 + src_off
    d0 = (-dst.ctypes.data) % 16 + dst_off
    rc = lib.copy_vectors(
        ctypes.c_void_p(src.ctypes.data + s0), ctypes.c_void_p(dst.ctypes.data + d0), wide
    )
    error = lib.emu_error().decode()
    n = 32 * width
    assert np.array_equal(dst[d0 : d0 + n], src[s0 : s0 + n])  # done byte-wise, not faulted
    if message is None:
        assert rc == 0 and error == ""
    else:
        assert rc == 2 and message in error, error
        assert error.startswith("block (0,0,0) thread ")


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "int8"])
def test_gpu_long_ragged_contexts(kv_dtype: str) -> None:
    """Llama-3.1-8B head shapes, ragged contexts up to 5k, heuristic partitions (GPU only)."""
    if not _gpu_present():
        pytest.skip("no CUDA GPU visible to torch and CuPy")
    runner = Runner(torch.device("cuda"), None)
    lens = [1, 15, 16, 17, 511, 1024, 3000, 5000]
    cache, table, query = _paged_setup(lens, 16, 8, 4, 128, torch.bfloat16, kv_dtype, seed=21)
    out = cb.paged_decode(
        runner.t(query),
        runner.cache(cache),
        runner.t(torch.tensor(lens, dtype=torch.int32)),
        runner.t(table),
        1 / math.sqrt(128),
    )
    ref = reference_rows(query, cache, lens, list(range(len(lens))), table, 1 / math.sqrt(128))
    assert rel_err(out.cpu(), ref) < 1e-2


@pytest.mark.slow
def test_bench_correctness_sweep_runs_on_the_emulator(
    emulator: ctypes.CDLL, capsys: pytest.CaptureFixture[str]
) -> None:
    """bench/gpu_kernels.py's sweep end to end (write_kv-filled caches, three partitionings,
    prefill), shrunk to CPU size, so a GPU session does not find its bugs first."""
    from bench import gpu_kernels as bench

    backend = cb.CudaBackend(runtime=EmulatedRuntime(emulator))
    verdicts = bench.Verdicts()
    ok = bench.correctness(
        True, 4321, backend, torch.device("cpu"), max_context=40, use_torch_backend=False,
        verdicts=verdicts,
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert ok, printed
    # The quick sweep: each KV dtype at D 128 / BS 16 for GQA 1, 4, 8, one D 64 / BS 32 row,
    # then the prefill row; each row graded once.
    expected = 3 * 3 + 1 + 1
    assert (verdicts.passed, verdicts.missed) == (expected, []), printed
    assert printed.count("PASS") == expected
