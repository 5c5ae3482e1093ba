// Shared device helpers for headroom's kernels: element types, bit packing, tensor-core MMA.
//
// Compiled with NVRTC (no host compiler, no CUDA runtime headers beyond the fp16/bf16/fp8
// ones), so this file uses only builtin integer types and device intrinsics.
#pragma once

// Shared memory is declared through two macros, `HEADROOM_SHARED(float, red, [4])` (a
// 16-byte aligned array) and `HEADROOM_DYNAMIC_SHARED(float, weights)`: on the GPU plain
// `__shared__` arrays; in the host emulation handles whose every load and store is a
// scheduling point and passes the race check (see host_emulation.cuh). Index them, or add an
// offset and keep the result in an `auto` (not a `float*`).
#ifdef HEADROOM_HOST_EMULATION
#include "host_emulation.cuh"  // CPU tests: see that file
#define HEADROOM_SHARED(T, name, ...)                                \
  static ::emu::SharedArray<T __VA_ARGS__> name##_storage(#name); \
  const auto name = name##_storage.view()
#define HEADROOM_DYNAMIC_SHARED(T, name) const auto name = ::emu::dynamic_shared_view<T>()
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#define HEADROOM_SHARED(T, name, ...) __shared__ __align__(16) T name __VA_ARGS__
#define HEADROOM_DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif

namespace headroom {

typedef unsigned int u32;
typedef long long i64;

// KV storage kinds; the numbers are the template arguments compile.py instantiates.
enum KvKind { KV_AUTO = 0, KV_FP8 = 1, KV_INT8 = 2 };

constexpr int kWarpSize = 32;
constexpr u32 kFullMask = 0xffffffffu;

template <typename A, typename B>
struct is_same {
  static constexpr bool value = false;
};
template <typename A>
struct is_same<A, A> {
  static constexpr bool value = true;
};

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

// Two floats packed into one 32-bit MMA operand register (`lo` in the low half).
template <bool BF16>
__device__ __forceinline__ u32 pack2(float lo, float hi);
template <>
__device__ __forceinline__ u32 pack2<true>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<u32*>(&v);
}
template <>
__device__ __forceinline__ u32 pack2<false>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<u32*>(&v);
}

__device__ __forceinline__ u32 byte_perm(u32 a, u32 b, u32 selector) {
  return __byte_perm(a, b, selector);
}

// Two e4m3 bytes (low 16 bits of `x`) to an f16x2 register; exact, e4m3 is a subset of f16.
// Uses the sm_89+ `cvt.rn.f16x2.e4m3x2` instruction and a software path on sm_80.
__device__ __forceinline__ u32 fp8x2_to_f16x2(u32 x) {
  __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x & 0xffffu),
                                             __NV_E4M3);
  return static_cast<u32>(h.x) | (static_cast<u32>(h.y) << 16);
}

// Two offset-binary int8 bytes (already XORed with 0x80) to f16x2, exact: f16 0x64XX is
// 1024 + XX, so subtracting 1152 = 1024 + 128 restores the signed value with no rounding.
// `selector` picks the two source bytes (0x4140: bytes 0/1, 0x4342: bytes 2/3).
__device__ __forceinline__ u32 int8x2_to_f16x2(u32 offset_binary, u32 selector) {
  u32 magic = byte_perm(offset_binary, 0x64646464u, selector);
  __half2 h = *reinterpret_cast<__half2*>(&magic);
  __half2 r = __hsub2(h, __floats2half2_rn(1152.0f, 1152.0f));
  return *reinterpret_cast<u32*>(&r);
}

// D = A(16x16, row) * B(16x8, col) + D with fp32 accumulation, the sm_80+ warp-level MMA.
// Fragment ownership (lane = 4 * g + t): A regs {(g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..),
// (g+8, 2t+8..)}, B regs {(k 2t..2t+1, n g), (k 2t+8.., n g)}, D {(g, 2t), (g, 2t+1),
// (g+8, 2t), (g+8, 2t+1)}.
template <bool BF16>
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1);
#ifdef HEADROOM_HOST_EMULATION
template <>
__device__ __forceinline__ void mma_16816<true>(float (&d)[4], const u32 (&a)[4], u32 b0,
                                                u32 b1) {
  ::emu::mma_16816(d, a, b0, b1, true);
}
template <>
__device__ __forceinline__ void mma_16816<false>(float (&d)[4], const u32 (&a)[4], u32 b0,
                                                 u32 b1) {
  ::emu::mma_16816(d, a, b0, b1, false);
}
__device__ __forceinline__ float fast_exp2(float x) { return exp2f(x); }
#else
template <>
__device__ __forceinline__ void mma_16816<true>(float (&d)[4], const u32 (&a)[4], u32 b0,
                                                u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<false>(float (&d)[4], const u32 (&a)[4], u32 b0,
                                                 u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x; ex2.approx has ~2 ulp error and maps -inf to +0, which the masking relies on.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
#endif

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  }
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(kFullMask, v, offset);
  }
  return v;
}

// 16 bytes from global memory through the read-only path; the KV cache is never written
// while an attention kernel reads it.
__device__ __forceinline__ uint4 load16(const unsigned char* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}
__device__ __forceinline__ uint2 load8(const unsigned char* p) {
  return __ldg(reinterpret_cast<const uint2*>(p));
}

}  // namespace headroom
