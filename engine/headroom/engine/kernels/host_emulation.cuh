// Host emulation of the CUDA subset headroom's kernels use, for tests on machines with no GPU.
//
// Compiled by a host C++ compiler with -DHEADROOM_HOST_EMULATION, the kernel sources run
// unchanged: every CUDA thread of a CTA is a cooperative fiber (ucontext), __syncthreads and
// the warp collectives (__shfl_xor_sync, mma.sync) are barriers over the fibers, and
// __shared__ variables are statics (one CTA runs at a time). The MMA follows the fragment
// layout of the PTX ISA for mma.m16n8k16 (.bf16/.f16 inputs, .f32 accumulators); it is the
// one piece of the kernels this emulation cannot check against hardware.
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct uint4 {
  unsigned int x, y, z, w;
};
struct uint2 {
  unsigned int x, y;
};
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }

struct __nv_bfloat16 {
  unsigned short x;
};
struct __half {
  unsigned short x;
};
struct __half2 {
  __half x, y;
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
struct __half2_raw {
  unsigned short x, y;
};
typedef unsigned char __nv_fp8_storage_t;
typedef unsigned short __nv_fp8x2_storage_t;
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };

inline unsigned f32_bits(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float __bfloat162float(__nv_bfloat16 b) { return bits_f32(unsigned(b.x) << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  unsigned u = f32_bits(f);
  if (std::isnan(f)) return {static_cast<unsigned short>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return {static_cast<unsigned short>(u >> 16)};
}
inline float __half2float(__half h) {
  _Float16 v;
  std::memcpy(&v, &h.x, 2);
  return static_cast<float>(v);
}
inline __half __float2half_rn(float f) {
  _Float16 v = static_cast<_Float16>(f);  // IEEE round to nearest even
  __half h;
  std::memcpy(&h.x, &v, 2);
  return h;
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}
inline __half2 __floats2half2_rn(float a, float b) {
  return {__float2half_rn(a), __float2half_rn(b)};
}
inline __half2 __hsub2(__half2 a, __half2 b) {
  return {__float2half_rn(__half2float(a.x) - __half2float(b.x)),
          __float2half_rn(__half2float(a.y) - __half2float(b.y))};
}
inline __half2 __hmul2(__half2 a, __half2 b) {
  return {__float2half_rn(__half2float(a.x) * __half2float(b.x)),
          __float2half_rn(__half2float(a.y) * __half2float(b.y))};
}

inline float e4m3_to_float(unsigned char v) {
  const int sign = v >> 7;
  const int e = (v >> 3) & 15;
  const int m = v & 7;
  float mag;
  if (e == 15 && m == 7) {
    mag = NAN;
  } else if (e == 0) {
    mag = std::ldexp(m / 8.0f, -6);
  } else {
    mag = std::ldexp(1.0f + m / 8.0f, e - 7);
  }
  return sign ? -mag : mag;
}
inline __half2_raw __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t x, __nv_fp8_interpretation_t) {
  __half lo = __float2half_rn(e4m3_to_float(x & 0xff));
  __half hi = __float2half_rn(e4m3_to_float(x >> 8));
  return {lo.x, hi.x};
}
// Nearest e4m3 code, ties to the even code, saturating at +-448.
inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float x, __nv_saturation_t,
                                                __nv_fp8_interpretation_t) {
  if (std::isnan(x)) return 0x7f;
  const unsigned char sign = x < 0 ? 0x80 : 0;
  const float a = std::fabs(x);
  int best = 0;
  float best_err = INFINITY;
  for (int c = 0; c <= 0x7e; ++c) {
    const float err = std::fabs(e4m3_to_float(static_cast<unsigned char>(c)) - a);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = c;
      best_err = err;
    }
  }
  return static_cast<unsigned char>(sign | best);
}

inline unsigned __byte_perm(unsigned a, unsigned b, unsigned s) {
  const unsigned long long both = (static_cast<unsigned long long>(b) << 32) | a;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned sel = (s >> (4 * i)) & 7u;
    r |= static_cast<unsigned>((both >> (8 * sel)) & 0xffu) << (8 * i);
  }
  return r;
}
inline float __int_as_float(int i) { return bits_f32(static_cast<unsigned>(i)); }
inline int __float2int_rn(float f) { return static_cast<int>(std::nearbyint(f)); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}

namespace emu {

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

struct Barrier {
  int needed = 0;
  int arrived = 0;
  std::vector<int> waiters;
};

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  Dim3 tid;
  bool done = false;
  bool blocked = false;
};

struct Cta {
  Dim3 block_idx, block_dim, grid_dim;
  std::vector<Fiber> fibers;
  std::vector<Barrier> warp_barriers;
  Barrier cta_barrier;
  int current = 0;
  ucontext_t main_ctx;
  std::vector<unsigned char> dynamic_shared;
  void (*body)(void*) = nullptr;
  void* body_arg = nullptr;
  // Per-warp exchange slots for the collectives.
  std::vector<float> shfl;            // [warps][32]
  std::vector<unsigned> mma_a, mma_b;  // [warps][32][4], [warps][32][2]
};

inline Cta& cta() {
  static Cta c;
  return c;
}

inline void schedule_next() {
  Cta& c = cta();
  const int n = static_cast<int>(c.fibers.size());
  const int me = c.current;
  for (int step = 1; step <= n; ++step) {
    const int i = (me + step) % n;
    if (!c.fibers[i].done && !c.fibers[i].blocked) {
      if (i == me) return;
      c.current = i;
      swapcontext(&c.fibers[me].ctx, &c.fibers[i].ctx);
      return;
    }
  }
  bool all_done = true;
  for (const Fiber& f : c.fibers) all_done = all_done && f.done;
  if (!all_done) {
    std::fprintf(stderr, "emulation deadlock: fibers blocked with none runnable\n");
    std::abort();
  }
  swapcontext(&c.fibers[me].ctx, &c.main_ctx);
}

inline void arrive(Barrier& b) {
  Cta& c = cta();
  if (++b.arrived == b.needed) {
    b.arrived = 0;
    for (int w : b.waiters) c.fibers[w].blocked = false;
    b.waiters.clear();
    return;
  }
  b.waiters.push_back(c.current);
  c.fibers[c.current].blocked = true;
  schedule_next();
}

inline void fiber_entry() {
  Cta& c = cta();
  c.body(c.body_arg);
  c.fibers[c.current].done = true;
  schedule_next();
}

// Runs `body` for every thread of every CTA of the grid, one CTA at a time.
inline void launch(Dim3 grid, Dim3 block, size_t dynamic_shared_bytes, void (*body)(void*),
                   void* arg) {
  Cta& c = cta();
  const int threads = static_cast<int>(block.x * block.y * block.z);
  const int warps = (threads + 31) / 32;
  c.grid_dim = grid;
  c.block_dim = block;
  c.body = body;
  c.body_arg = arg;
  c.dynamic_shared.assign(dynamic_shared_bytes + 16, 0);
  c.shfl.assign(static_cast<size_t>(warps) * 32, 0.0f);
  c.mma_a.assign(static_cast<size_t>(warps) * 32 * 4, 0u);
  c.mma_b.assign(static_cast<size_t>(warps) * 32 * 2, 0u);
  c.fibers.resize(threads);
  for (Fiber& f : c.fibers) f.stack.resize(1 << 16);
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        c.block_idx = {bx, by, bz};
        c.warp_barriers.assign(warps, Barrier{});
        for (int w = 0; w < warps; ++w) c.warp_barriers[w].needed = 32;
        c.cta_barrier = Barrier{};
        c.cta_barrier.needed = threads;
        for (int i = 0; i < threads; ++i) {
          Fiber& f = c.fibers[i];
          f.done = f.blocked = false;
          f.tid = {static_cast<unsigned>(i % block.x),
                   static_cast<unsigned>((i / block.x) % block.y),
                   static_cast<unsigned>(i / (block.x * block.y))};
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = f.stack.data();
          f.ctx.uc_stack.ss_size = f.stack.size();
          f.ctx.uc_link = nullptr;
          makecontext(&f.ctx, fiber_entry, 0);
        }
        c.current = 0;
        swapcontext(&c.main_ctx, &c.fibers[0].ctx);
      }
}

inline Dim3& thread_idx() { return cta().fibers[cta().current].tid; }
inline int linear_tid() {
  const Dim3& t = thread_idx();
  const Dim3& b = cta().block_dim;
  return static_cast<int>(t.x + b.x * (t.y + b.y * t.z));
}
inline void* dynamic_shared() { return cta().dynamic_shared.data(); }

inline void syncthreads() { arrive(cta().cta_barrier); }

inline float shfl_xor(float v, int mask) {
  Cta& c = cta();
  const int tid = linear_tid();
  const int warp = tid / 32;
  const int lane = tid % 32;
  c.shfl[warp * 32 + lane] = v;
  arrive(c.warp_barriers[warp]);
  const float r = c.shfl[warp * 32 + (lane ^ mask)];
  arrive(c.warp_barriers[warp]);
  return r;
}

inline float unpack16(unsigned reg, int half, bool bf16) {
  const unsigned short bits = static_cast<unsigned short>(half ? reg >> 16 : reg & 0xffffu);
  return bf16 ? __bfloat162float(__nv_bfloat16{bits}) : __half2float(__half{bits});
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: D += A * B with the PTX fragment layout.
inline void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1,
                      bool bf16) {
  Cta& c = cta();
  const int tid = linear_tid();
  const int warp = tid / 32;
  const int lane = tid % 32;
  unsigned* A = &c.mma_a[static_cast<size_t>(warp) * 128];
  unsigned* B = &c.mma_b[static_cast<size_t>(warp) * 64];
  for (int i = 0; i < 4; ++i) A[lane * 4 + i] = a[i];
  B[lane * 2] = b0;
  B[lane * 2 + 1] = b1;
  arrive(c.warp_barriers[warp]);
  const int g = lane >> 2;
  const int t = lane & 3;
  float out[4];
  for (int ci = 0; ci < 4; ++ci) {
    const int row = g + 8 * (ci >> 1);
    const int col = 2 * t + (ci & 1);
    float acc = d[ci];
    for (int k = 0; k < 16; ++k) {
      const int a_lane = (row % 8) * 4 + (k % 8) / 2;
      const int a_reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
      const int b_lane = col * 4 + (k % 8) / 2;
      const int b_reg = k >= 8 ? 1 : 0;
      acc += unpack16(A[a_lane * 4 + a_reg], k % 2, bf16) *
             unpack16(B[b_lane * 2 + b_reg], k % 2, bf16);
    }
    out[ci] = acc;
  }
  arrive(c.warp_barriers[warp]);
  for (int ci = 0; ci < 4; ++ci) d[ci] = out[ci];
}

}  // namespace emu

#define threadIdx (::emu::thread_idx())
#define blockIdx (::emu::cta().block_idx)
#define blockDim (::emu::cta().block_dim)
#define gridDim (::emu::cta().grid_dim)

inline void __syncthreads() { ::emu::syncthreads(); }
inline float __shfl_xor_sync(unsigned, float v, int mask) { return ::emu::shfl_xor(v, mask); }
