"""GPU kernel benchmark: correctness sweep and decode bandwidth of headroom's CUDA kernels.

    .venv/bin/python -m bench.gpu_kernels                 # everything (under 5 minutes on an H200)
    .venv/bin/python -m bench.gpu_kernels --quick         # fewer correctness shapes
    .venv/bin/python -m bench.gpu_kernels --compile-only  # what needs no GPU (NVRTC and ptxas)

Always prints the NVRTC/ptxas table first, which needs no GPU: compile warnings for
compute_80/89/90 and each kernel's registers and spill bytes from ptxas for sm_80, sm_89 and
sm_90 (target: no warnings, 0 spill bytes on every architecture). With a GPU it then prints:
1. correctness: the CUDA backend against a self-contained fp32 reference (and against
   `TorchBackend` when that module exists) on fresh random inputs each run (the seed is
   printed), with every output poisoned with NaN before each launch and stale cache slots
   poisoned too; head dims 64/128, GQA 1/4/8, block sizes 16/32, ragged contexts up to 32k.
   bf16 KV must be within 1e-2 relative (Frobenius) error; fp8/int8 KV within the quantisation
   error the reference itself measures in the same run (reference on dequantised K/V vs on
   the unquantised bf16 K/V) plus 1e-2.
2. timing (CUDA events, warm-up, median of 20 samples of 10 back-to-back launches): decode at
   Llama-3.1-8B shapes (32 q heads, 8 kv heads, head_dim 128, block 16), batch 64, 4k context,
   effective bandwidth (K+V bytes read once / time) against a device-to-device copy measured
   in the same run (read + write bytes / time), and torch SDPA on the same K/V laid out
   contiguously. Targets: bf16 decode >= 70 % of copy bandwidth; fp8 >= 1.7x bf16 tokens/s.

Every PASS/MISS is counted; a MISS fails the run unless its row says "(informational)"
(--timing-informational labels the timing targets so, for GPUs or shared machines the
targets were not set for). Exit status: 0 every counted verdict passed; 1 at least one MISS,
or a verdict that could not be checked (no ptxas for the spill verdicts); 77 (the "skipped"
code of automake-style test drivers) no GPU visible, so correctness and timing did not run,
while every compile and spill verdict passed (--compile-only stops there and exits 0).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from bench.verdicts import Verdicts
from headroom.engine.attention import cuda_backend as cb
from headroom.engine.attention.base import KVDtype, LayerKVCache, allocate_layer_cache
from headroom.engine.kernels import compile as kc

BF16_TOL = 1e-2
COPY_FRACTION_TARGET = 0.70
FP8_SPEEDUP_TARGET = 1.7
# A100, L4/L40/RTX 4090, H100/H200: the architectures the spill verdicts cover.
SPILL_ARCHS: tuple[str, ...] = ("sm_80", "sm_89", "sm_90")
EXIT_PASS, EXIT_MISS, EXIT_NEEDS_GPU = 0, 1, 77


# ---------------------------------------------------------------- compile table (no GPU)


def compile_table(verdicts: Verdicts) -> None:
    """NVRTC warnings per architecture and ptxas registers/spills per kernel and architecture."""
    ptxas = kc.find_ptxas()
    usage: dict[str, dict[str, kc.RegisterUsage]] = {}
    version = ".".join(map(str, kc.nvrtc_version()))
    for gpu in SPILL_ARCHS:
        arch = "compute_" + gpu.removeprefix("sm_")
        t0 = time.perf_counter()
        results = kc.compile_variants(kc.all_variants(), arch)
        secs = time.perf_counter() - t0
        warnings = [r.log for r in results.values() if r.log]
        print(
            f"NVRTC {version}: {len(kc.all_variants())} kernels for {arch} in {secs:.1f} s, "
            f"warnings: {len(warnings)} (target 0) "
            f"{verdicts(not warnings, f'{arch} compile warnings')}"
        )
        if ptxas is not None:
            usage[gpu] = {u.kernel: u for r in results.values() for u in kc.ptxas_usage(r.ptx, gpu)}
    if ptxas is None:
        print(
            "ptxas not installed (pip install nvidia-cuda-nvcc): the spill verdicts cannot be "
            f"checked {verdicts(False, 'spills unchecked: no ptxas')}"
        )
        return
    ptxas_release = ".".join(map(str, kc.ptxas_version(ptxas)))
    print(
        f"ptxas {ptxas_release}: registers and spill bytes (stored + loaded) per kernel; "
        "CTA/SM: resident decode CTAs per sm_90 SM"
    )
    cols = "".join(f" {gpu + ' regs':>10s} {'spill':>5s}" for gpu in SPILL_ARCHS)
    print(f"{'kernel':42s}{cols} {'smem B':>7s} {'CTA/SM':>6s}")
    for name in sorted(usage[SPILL_ARCHS[0]]):
        cells = ""
        for gpu in SPILL_ARCHS:
            u = usage[gpu][name]
            cells += f" {u.registers:10d} {u.spill_store_bytes + u.spill_load_bytes:5d}"
        u = usage["sm_90"][name]
        per_sm = ""
        if name.startswith("paged_attention_decode_"):
            regs_warp = -(-u.registers * 32 // 256) * 256
            per_sm = str(min(65536 // (regs_warp * 4), 233472 // max(u.shared_bytes, 1)))
        print(f"{name:42s}{cells} {u.shared_bytes:7d} {per_sm:>6s}")
    for gpu in SPILL_ARCHS:
        stores = sum(u.spill_store_bytes for u in usage[gpu].values())
        loads = sum(u.spill_load_bytes for u in usage[gpu].values())
        worst = max(usage[gpu].values(), key=lambda u: u.registers)
        print(
            f"{gpu}: spill bytes {stores + loads} ({stores} stored, {loads} loaded; target 0) "
            f"{verdicts(stores + loads == 0, f'{gpu} spills {stores + loads} B')}; most "
            f"registers {worst.registers} ({worst.kernel})"
        )


# ---------------------------------------------------------------- fp32 reference


def reference_decode(
    query: torch.Tensor,
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    lens: list[int],
    table: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """fp32 attention of query row i over the first lens[i] tokens of sequence i."""
    hkv, d = k_all.shape[2], k_all.shape[3]
    k_flat, v_flat = k_all.reshape(-1, hkv, d), v_all.reshape(-1, hkv, d)
    group = query.shape[1] // hkv
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    for i, n in enumerate(lens):
        if n == 0:
            continue
        pos = torch.arange(n, device=query.device)
        slots = table[i].long()[pos // block_size] * block_size + pos % block_size
        k = k_flat[slots].repeat_interleave(group, dim=1)
        v = v_flat[slots].repeat_interleave(group, dim=1)
        logits = torch.einsum("hd,nhd->hn", query[i].float(), k) * scale
        out[i] = torch.einsum("hn,nhd->hd", logits.softmax(-1), v)
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


# ---------------------------------------------------------------- inputs


@dataclass
class Paged:
    cache: LayerKVCache
    plain: LayerKVCache  # the same tokens, unquantised (bf16), same slots
    table: torch.Tensor
    lens: list[int]
    query: torch.Tensor


def make_paged(
    lens: list[int],
    block_size: int,
    hkv: int,
    group: int,
    d: int,
    kv_dtype: str,
    gen: torch.Generator,
    backend: cb.CudaBackend,
    dev: torch.device,
) -> Paged:
    """A NaN-poisoned paged cache whose used slots are written through `write_kv`."""
    need = [max(1, -(-n // block_size)) for n in lens]
    num_blocks = sum(need) + 4
    cache = allocate_layer_cache(
        num_blocks,
        block_size,
        hkv,
        d,
        torch.bfloat16,
        cast(KVDtype, kv_dtype),
        device=dev,
    )
    plain = allocate_layer_cache(num_blocks, block_size, hkv, d, torch.bfloat16, "auto", device=dev)
    for c in (cache, plain):
        if c.kv_dtype == "auto":
            c.key.fill_(float("nan"))
            c.value.fill_(float("nan"))
        elif c.kv_dtype == "fp8":
            c.key.view(torch.uint8).fill_(0x7F)
            c.value.view(torch.uint8).fill_(0x7F)
        else:
            assert c.k_scale is not None and c.v_scale is not None
            c.k_scale.fill_(float("nan"))
            c.v_scale.fill_(float("nan"))
    if kv_dtype == "fp8":
        # static per-head scales as a calibration would set them (absmax / 448 of ~N(0, 2))
        assert cache.k_scale is not None and cache.v_scale is not None
        cache.k_scale.fill_(8.0 / 448)
        cache.v_scale.fill_(8.0 / 448)
    perm = torch.randperm(num_blocks, generator=gen, device=dev).to(torch.int32).cpu()
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    at = 0
    for i, nb in enumerate(need):
        table[i, :nb] = perm[at : at + nb]
        at += nb
    table = table.to(dev)
    slots = []
    for i, n in enumerate(lens):
        pos = torch.arange(n, device=dev)
        slots.append(table[i].long()[pos // block_size] * block_size + pos % block_size)
    slot_mapping = torch.cat(slots)
    total = slot_mapping.numel()
    chunk = 65536
    for s0 in range(0, total, chunk):
        sl = slot_mapping[s0 : s0 + chunk]
        k = (torch.randn(sl.numel(), hkv, d, generator=gen, device=dev) * 2).bfloat16()
        v = (torch.randn(sl.numel(), hkv, d, generator=gen, device=dev) * 2).bfloat16()
        backend.write_kv(k, v, cache, sl)
        backend.write_kv(k, v, plain, sl)
    query = torch.randn(len(lens), hkv * group, d, generator=gen, device=dev).bfloat16()
    return Paged(cache, plain, table, lens, query)


# ---------------------------------------------------------------- correctness


def torch_backend() -> Any | None:
    try:
        from headroom.engine.attention.torch_backend import TorchBackend
    except ImportError:
        return None
    try:
        return TorchBackend()
    except Exception as exc:  # a constructor we do not know how to call
        print(f"TorchBackend() could not be built ({exc}); comparing with the fp32 reference only")
        return None


def correctness(
    quick: bool,
    seed: int,
    backend: cb.CudaBackend,
    dev: torch.device,
    max_context: int = 32768,
    use_torch_backend: bool = True,
    verdicts: Verdicts | None = None,
) -> bool:
    """The sweep; `backend`/`dev`/`max_context` let it run small on the CPU emulator too.
    True when every row passed; each row's verdict also lands in `verdicts`."""
    verdicts = Verdicts() if verdicts is None else verdicts
    missed_before = len(verdicts.missed)
    gen = torch.Generator(device=dev).manual_seed(seed)
    tb = torch_backend() if use_torch_backend else None
    print(f"\ncorrectness (seed {seed}; TorchBackend {'present' if tb else 'absent'})")
    print(
        f"{'kv':5s} {'D':>4s} {'GQA':>4s} {'BS':>3s} {'seqs':>4s} {'max ctx':>7s} "
        f"{'parts':>5s} {'err vs ref(q)':>13s} {'quant err':>9s} {'err vs bf16':>11s} "
        f"{'bound':>6s} {'torch be':>9s}  result"
    )
    configs = [
        (kv, d, g, bs)
        for kv in ("auto", "fp8", "int8")
        for d in (64, 128)
        for g in (1, 4, 8)
        for bs in (16, 32)
    ]
    if quick:
        configs = [c for c in configs if c[1] == 128 and c[3] == 16] + [("auto", 64, 4, 32)]
    for kv, d, g, bs in configs:
        hkv = 8 if g < 8 else 4
        hi = min(max_context, 32768 if (d, g) in ((128, 4), (64, 1)) else 8192)
        mid = min(2048, max(19, hi // 2))
        lens = [
            1,
            15,
            16,
            17,
            *torch.randint(18, mid, (2,), generator=gen, device=dev).tolist(),
            int(torch.randint(hi // 2, hi + 1, (1,), generator=gen, device=dev)),
        ]
        p = make_paged(lens, bs, hkv, g, d, kv, gen, backend, dev)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        scale = 1 / math.sqrt(d)
        kq, vq = p.cache.dequantized()
        ref_q = reference_decode(p.query, kq, vq, lens, p.table, bs, scale)
        kp, vp = p.plain.dequantized()
        ref_plain = reference_decode(p.query, kp, vp, lens, p.table, bs, scale)
        quant_err = rel_err(ref_q, ref_plain)
        worst = 0.0
        worst_plain = 0.0
        finite = True
        split = 512 if max_context >= 1024 else 32
        for part in (None, 0, split):  # heuristic, forced single pass, forced split
            out = torch.full_like(p.query, float("nan"))  # poisoned before every launch
            cb.paged_decode(
                p.query,
                p.cache,
                seq_lens,
                p.table,
                scale,
                out=out,
                partition_size=part,
                runtime=backend.runtime,
            )
            finite = finite and bool(torch.isfinite(out).all())
            worst = max(worst, rel_err(out, ref_q))
            worst_plain = max(worst_plain, rel_err(out, ref_plain))
        bound = quant_err + BF16_TOL
        torch_cmp = "-"
        if tb is not None:
            try:
                ref_tb = tb.decode(p.query, p.cache, seq_lens, p.table, scale)
                torch_cmp = f"{rel_err(ref_tb, ref_q):.1e}"
            except Exception as exc:  # the torch backend may not run on CUDA tensors
                torch_cmp = f"n/a ({type(exc).__name__})"
        ok = finite and worst <= BF16_TOL and worst_plain <= bound
        parts = cb.num_partitions(max(lens), split)
        print(
            f"{kv:5s} {d:4d} {g:4d} {bs:3d} {len(lens):4d} {max(lens):7d} {parts:5d} "
            f"{worst:13.2e} {quant_err:9.2e} {worst_plain:11.2e} {bound:6.3f} "
            f"{torch_cmp:>9s}  {verdicts(ok, f'correctness {kv} D{d} GQA{g} BS{bs}')}"
        )
        del p, kq, vq, kp, vp
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    # prefill (decode kernel per query row) against the same reference
    prefix = min(600, max_context // 2)
    c0, c1 = min(100, max(2, max_context // 8)), min(64, max(2, max_context // 8))
    lens, chunk = [prefix + c0, c1], [c0, c1]
    p = make_paged(lens, 16, 8, 4, 128, "auto", gen, backend, dev)
    qsl = torch.tensor([0, chunk[0], sum(chunk)], dtype=torch.int32, device=dev)
    query = torch.randn(sum(chunk), 32, 128, generator=gen, device=dev).bfloat16()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    out = backend.prefill(query, p.cache, qsl, seq_lens, p.table, 0.088)
    k_all, v_all = p.cache.dequantized()
    row_lens = [prefix + k + 1 for k in range(c0)] + [k + 1 for k in range(c1)]
    rows_seq = [0] * c0 + [1] * c1
    table_rows = p.table[torch.tensor(rows_seq, device=dev)]
    ref = reference_decode(query, k_all, v_all, row_lens, table_rows, 16, 0.088)
    err = rel_err(out, ref)
    print(
        f"prefill bf16 D128 GQA4 (chunks after a {prefix}-token prefix): err {err:.2e} "
        f"(target <= {BF16_TOL}) {verdicts(err <= BF16_TOL, 'correctness prefill')}"
    )
    return len(verdicts.missed) == missed_before


# ---------------------------------------------------------------- timing


def cuda_time_ms(fn: Callable[[], object], samples: int = 20, per_sample: int = 10) -> float:
    """Median time of one call: CUDA events around `per_sample` back-to-back calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        for _ in range(per_sample):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / per_sample)
    return float(statistics.median(times))


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write bytes."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    src.fill_(1)
    ms = cuda_time_ms(lambda: dst.copy_(src), samples=20, per_sample=5)
    return 2 * n / (ms * 1e-3)


def timing(verdicts: Verdicts, informational: bool = False) -> None:
    """Decode timing; its two targets land in `verdicts` (informational if asked)."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    batch, ctx, hq, hkv, d, bs = 64, 4096, 32, 8, 128, 16
    copy_bw = copy_bandwidth()
    print(
        f"\ntiming: batch {batch}, context {ctx}, {hq} q heads / {hkv} kv heads, D {d}, "
        f"block {bs} (Llama-3.1-8B); device-to-device copy {copy_bw / 1e9:.0f} GB/s"
    )
    print(
        f"{'kernel':34s} {'parts':>5s} {'time us':>8s} {'GB/s':>7s} {'of copy':>8s} "
        f"{'Mtok/s':>7s}  target"
    )
    backend = cb.CudaBackend(check_values=False)
    scale = 1 / math.sqrt(d)
    results: dict[str, float] = {}
    for kv in ("auto", "fp8", "int8"):
        p = make_paged([ctx] * batch, bs, hkv, hq // hkv, d, kv, gen, backend, dev)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        out = torch.empty_like(p.query)
        elem = p.cache.key.element_size()
        kv_bytes = 2 * batch * ctx * hkv * d * elem
        if kv == "int8":
            kv_bytes += 2 * batch * ctx * hkv * 4
        auto_size = cb.choose_partition_size(
            batch * hkv,
            ctx,
            cb.default_runtime().resident_slots(
                cb.default_runtime().function(
                    kc.decode_variant("bf16", kv, d), torch.device("cuda")
                ),
                torch.device("cuda"),
            ),
        )
        for label, part in (("heuristic", None), ("single pass", 0), ("split 1024", 1024)):

            def run(
                part: int | None = part,
                p: Paged = p,
                seq_lens: torch.Tensor = seq_lens,
                out: torch.Tensor = out,
            ) -> None:
                cb.paged_decode(
                    p.query,
                    p.cache,
                    seq_lens,
                    p.table,
                    scale,
                    out=out,
                    partition_size=part,
                    check_values=False,
                )

            ms = cuda_time_ms(run)
            bw = kv_bytes / (ms * 1e-3)
            frac = bw / copy_bw
            tok_s = batch / (ms * 1e-3)
            shown = auto_size if part is None else part
            parts = cb.num_partitions(ctx, shown)
            target = "(no target)"
            if kv == "auto" and part is None:
                mark = verdicts(
                    frac >= COPY_FRACTION_TARGET, "timing bf16 of copy", informational=informational
                )
                target = f">= {COPY_FRACTION_TARGET:.0%} of copy {mark}"
            if part is None:
                results[kv] = tok_s
            print(
                f"decode {kv:4s} ({label:11s})        {parts:5d} {ms * 1e3:8.1f} "
                f"{bw / 1e9:7.0f} {frac:8.1%} {tok_s / 1e6:7.3f}  {target}"
            )
        torch.cuda.empty_cache()
    speedup = results["fp8"] / results["auto"]
    mark = verdicts(speedup >= FP8_SPEEDUP_TARGET, "timing fp8 / bf16", informational=informational)
    print(
        f"fp8 / bf16 tokens/s: {speedup:.2f}x (target >= {FP8_SPEEDUP_TARGET}x) {mark}; "
        f"int8 / bf16: {results['int8'] / results['auto']:.2f}x (no target)"
    )
    # torch SDPA on the same K/V laid out contiguously ([batch, kv heads, ctx, D])
    q = torch.randn(batch, hq, 1, d, generator=gen, device=dev).bfloat16()
    k = torch.randn(batch, hkv, ctx, d, generator=gen, device=dev).bfloat16()
    v = torch.randn_like(k)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ms = cuda_time_ms(lambda: sdpa(q, k, v, enable_gqa=True))
    bw = 2 * k.numel() * 2 / (ms * 1e-3)
    print(
        f"torch SDPA bf16 (contiguous, GQA)         {ms * 1e3:8.1f} {bw / 1e9:7.0f} "
        f"{bw / copy_bw:8.1%} {batch / (ms * 1e-3) / 1e6:7.3f}  (for comparison, no target)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer correctness shapes")
    parser.add_argument("--seed", type=int, default=None, help="fix the input seed")
    parser.add_argument(
        "--compile-only", action="store_true", help="only the NVRTC/ptxas verdicts (no GPU)"
    )
    parser.add_argument(
        "--timing-informational",
        action="store_true",
        help="label the timing targets informational: reported, not counted",
    )
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    verdicts = Verdicts()
    compile_table(verdicts)
    if args.compile_only:
        return finish(verdicts, t0, EXIT_PASS)
    if not cb.cuda_available():
        why = cb.cuda_unavailable_reason() or "no CUDA GPU visible to torch and CuPy"
        print(
            f"\n{why}: correctness and timing need a GPU and did not run "
            f"(exit {EXIT_NEEDS_GPU} unless a verdict above missed)"
        )
        return finish(verdicts, t0, EXIT_NEEDS_GPU)
    torch.backends.cuda.matmul.allow_tf32 = False  # keep the fp32 reference fp32
    name = torch.cuda.get_device_name()
    print(f"\ndevice: {name}")
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    backend = cb.CudaBackend(check_values=True)
    correctness(args.quick, seed, backend, torch.device("cuda"), verdicts=verdicts)
    timing(verdicts, informational=args.timing_informational)
    return finish(verdicts, t0, EXIT_PASS)


def finish(verdicts: Verdicts, t0: float, clean: int) -> int:
    """Prints the count of verdicts; EXIT_MISS on any counted MISS, else `clean`."""
    code = EXIT_MISS if verdicts.missed else clean
    print(f"\nverdicts: {verdicts.summary()}; {time.perf_counter() - t0:.0f} s in all; exit {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
