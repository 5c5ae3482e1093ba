// Host emulation of the CUDA subset headroom's kernels use, for tests on machines with no GPU.
//
// Compiled by a host C++ compiler with -DHEADROOM_HOST_EMULATION, the kernel sources run
// unchanged: every CUDA thread of a CTA is a cooperative fiber (ucontext), __syncthreads and
// the warp collectives (__shfl_xor_sync, mma.sync) are barriers over the fibers, and shared
// memory is static storage (one CTA runs at a time). The MMA follows the fragment layout of
// the PTX ISA for mma.m16n8k16 (.bf16/.f16 inputs, .f32 accumulators); it is the one piece of
// the kernels this emulation cannot check against hardware.
//
// Switching fibers only at barriers would hide a missing __syncthreads (every thread would
// run its stretch between two barriers in one go), so the emulation hunts for them twice:
// - Schedule: seeded random priorities (a permutation of the fibers); the highest-priority
//   runnable fiber runs, and every shared-memory load or store (arrays declared with
//   HEADROOM_SHARED) and every barrier release is a yield point where, one time in
//   kDemoteOneIn, the running fiber swaps priorities with a random one. Each seed is another
//   interleaving, and a missing barrier gives a wrong result under some of them.
// - Race check: every shared word remembers which thread last wrote it and who read it since
//   the last __syncthreads. A read of a word another thread wrote, or a write to a word
//   another thread read or wrote, with no __syncthreads in between, is a race; so is reading
//   a word no thread of the CTA wrote (hardware leaves it undefined; here it holds 0xff
//   bytes, a NaN). Warp collectives do not order shared accesses here: the kernels exchange
//   through shared memory only across __syncthreads, so the check is that strict.
// Vector loads and stores (uint4, uint2, __ldg) must be naturally aligned as on the GPU.
// Errors do not stop the process: the first message is kept (`launch_error()`) and
// `launch()` returns false, except a deadlock, which abandons the launch.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <unordered_map>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

namespace emu {

constexpr int kDemoteOneIn = 8;

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
  int rank = 0;  // scheduling priority: the runnable fiber of highest rank runs
};

// What the race check remembers of one 4-byte shared word within the current CTA.
struct Shadow {
  int writer = -1;  // last writer; -1: no thread of this CTA wrote the word yet
  unsigned write_epoch = 0;
  int reader = -1;  // first reader in `read_epoch`
  unsigned read_epoch = 0;
  bool many_readers = false;  // a second thread read it in `read_epoch`
};

struct SharedRange {
  const unsigned char* begin;
  size_t bytes;
  const char* name;
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
  std::vector<float> shfl;             // [warps][32]
  std::vector<unsigned> mma_a, mma_b;  // [warps][32][4], [warps][32][2]
  unsigned long long rng = 0;
  std::vector<int> by_rank;                  // fiber index of each rank
  std::vector<unsigned long long> runnable;  // bit r: the fiber of rank r can run
  unsigned epoch = 1;                        // +1 at every __syncthreads
  std::unordered_map<uintptr_t, Shadow> shadow;
};

struct Config {
  unsigned long long seed = 1;
  bool race_check = true;
};

struct Status {
  bool in_launch = false;
  bool abandoned = false;
  int errors = 0;
  unsigned long long launches = 0;  // since configure(): part of each CTA's schedule seed
  char message[1024] = "";
};

inline Cta& cta() {
  static Cta c;
  return c;
}
inline Config& config() {
  static Config c;
  return c;
}
inline Status& status() {
  static Status s;
  return s;
}
inline std::vector<SharedRange>& shared_ranges() {
  static std::vector<SharedRange> r;
  return r;
}

// Seed of the schedule (and whether the race check runs) for the launches that follow.
inline void configure(unsigned long long seed, bool race_check) {
  config().seed = seed;
  config().race_check = race_check;
  status().launches = 0;
}
inline const char* launch_error() { return status().message; }

inline int linear_tid() {
  Cta& c = cta();
  const Dim3& t = c.fibers[c.current].tid;
  return static_cast<int>(t.x + c.block_dim.x * (t.y + c.block_dim.y * t.z));
}

// Records an error of the running thread; only the first message is kept.
inline void report(const char* fmt, ...) {
  Status& s = status();
  char what[768];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(what, sizeof(what), fmt, ap);
  va_end(ap);
  if (!s.in_launch) {
    std::fprintf(stderr, "emulation error outside a launch: %s\n", what);
    std::abort();
  }
  if (s.errors++ == 0) {
    const Cta& c = cta();
    std::snprintf(s.message, sizeof(s.message), "block (%u,%u,%u) thread %d: %s", c.block_idx.x,
                  c.block_idx.y, c.block_idx.z, linear_tid(), what);
  }
}

inline unsigned long long splitmix64(unsigned long long& state) {
  unsigned long long z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
inline unsigned long long next_random() { return splitmix64(cta().rng); }

// ---------------------------------------------------------------- scheduler

inline void set_runnable(int fiber, bool on) {
  Cta& c = cta();
  const int r = c.fibers[fiber].rank;
  const unsigned long long bit = 1ull << (r % 64);
  c.runnable[r / 64] = on ? c.runnable[r / 64] | bit : c.runnable[r / 64] & ~bit;
}

inline int highest_runnable() {
  const Cta& c = cta();
  for (int w = static_cast<int>(c.runnable.size()) - 1; w >= 0; --w) {
    if (c.runnable[w] != 0) return c.by_rank[w * 64 + 63 - __builtin_clzll(c.runnable[w])];
  }
  return -1;
}

// Fiber `a` takes the rank of fiber `b` and `b` that of `a`.
inline void swap_ranks(int a, int b) {
  Cta& c = cta();
  Fiber& fa = c.fibers[a];
  Fiber& fb = c.fibers[b];
  const bool run_a = !fa.done && !fa.blocked;
  const bool run_b = !fb.done && !fb.blocked;
  set_runnable(a, false);
  set_runnable(b, false);
  std::swap(fa.rank, fb.rank);
  c.by_rank[fa.rank] = a;
  c.by_rank[fb.rank] = b;
  set_runnable(a, run_a);
  set_runnable(b, run_b);
}

inline void switch_to(int next) {
  Cta& c = cta();
  const int me = c.current;
  c.current = next;
  swapcontext(&c.fibers[me].ctx, &c.fibers[next].ctx);
}

// The running fiber blocked or finished: run another, or return to launch() when none can.
inline void schedule_next() {
  Cta& c = cta();
  const int next = highest_runnable();
  if (next >= 0) {
    switch_to(next);
    return;
  }
  bool all_done = true;
  for (const Fiber& f : c.fibers) all_done = all_done && f.done;
  if (!all_done) {
    report("deadlock: every live thread waits at a barrier the others never reach");
    status().abandoned = true;
  }
  swapcontext(&c.fibers[c.current].ctx, &c.main_ctx);
}

// Gives way to the highest-priority runnable fiber, if that is not the running one.
inline void reschedule() {
  const int next = highest_runnable();
  if (next != cta().current) switch_to(next);
}

// A yield point: one time in kDemoteOneIn the running fiber swaps priorities with a random
// fiber and may give way to a higher one.
inline void yield() {
  Cta& c = cta();
  if (next_random() % kDemoteOneIn != 0) return;
  swap_ranks(c.current, static_cast<int>(next_random() % c.fibers.size()));
  reschedule();
}

inline void arrive(Barrier& b, bool whole_cta) {
  Cta& c = cta();
  if (++b.arrived == b.needed) {
    b.arrived = 0;
    for (int w : b.waiters) {
      c.fibers[w].blocked = false;
      set_runnable(w, true);
    }
    b.waiters.clear();
    if (whole_cta) ++c.epoch;
    yield();
    reschedule();  // a released waiter may outrank the releasing fiber
    return;
  }
  b.waiters.push_back(c.current);
  c.fibers[c.current].blocked = true;
  set_runnable(c.current, false);
  schedule_next();
}

inline void fiber_entry() {
  Cta& c = cta();
  c.body(c.body_arg);
  c.fibers[c.current].done = true;
  set_runnable(c.current, false);
  schedule_next();
}

// Fills every shared array with 0xff bytes (a NaN as float): a CTA starts with undefined
// shared memory, and the race check reports any read of a word the CTA did not write.
inline void poison_shared() {
  for (const SharedRange& r : shared_ranges()) {
    std::memset(const_cast<unsigned char*>(r.begin), 0xff, r.bytes);
  }
  std::fill(cta().dynamic_shared.begin(), cta().dynamic_shared.end(), 0xff);
}

// Runs `body` for every thread of every CTA of the grid, one CTA at a time; false (see
// launch_error()) when an emulation check failed.
inline bool launch(Dim3 grid, Dim3 block, size_t dynamic_shared_bytes, void (*body)(void*),
                   void* arg) {
  Cta& c = cta();
  Status& s = status();
  s.in_launch = true;
  s.abandoned = false;
  s.errors = 0;
  s.message[0] = '\0';
  const unsigned long long launch_no = s.launches++;
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
  for (unsigned bz = 0; bz < grid.z && !s.abandoned; ++bz)
    for (unsigned by = 0; by < grid.y && !s.abandoned; ++by)
      for (unsigned bx = 0; bx < grid.x && !s.abandoned; ++bx) {
        c.block_idx = {bx, by, bz};
        c.rng = config().seed;
        c.rng = splitmix64(c.rng) ^ launch_no;
        c.rng = splitmix64(c.rng) ^ (bx + grid.x * (by + static_cast<unsigned long long>(grid.y) * bz));
        c.epoch = 1;
        c.shadow.clear();
        poison_shared();
        c.warp_barriers.assign(warps, Barrier{});
        for (int w = 0; w < warps; ++w) c.warp_barriers[w].needed = 32;
        c.cta_barrier = Barrier{};
        c.cta_barrier.needed = threads;
        c.by_rank.resize(threads);
        for (int r = 0; r < threads; ++r) c.by_rank[r] = r;
        for (int r = threads - 1; r > 0; --r) {  // a random permutation (Fisher-Yates)
          std::swap(c.by_rank[r], c.by_rank[next_random() % (r + 1)]);
        }
        c.runnable.assign((threads + 63) / 64, 0);
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
        for (int r = 0; r < threads; ++r) {
          c.fibers[c.by_rank[r]].rank = r;
          set_runnable(c.by_rank[r], true);
        }
        c.current = highest_runnable();
        swapcontext(&c.main_ctx, &c.fibers[c.current].ctx);
      }
  s.in_launch = false;
  return s.errors == 0;
}

inline Dim3& thread_idx() { return cta().fibers[cta().current].tid; }
inline void* dynamic_shared() { return cta().dynamic_shared.data(); }

inline void syncthreads() { arrive(cta().cta_barrier, true); }

// ---------------------------------------------------------------- alignment

inline bool check_aligned(const void* p, size_t align, size_t bytes, const char* what) {
  const size_t off = reinterpret_cast<uintptr_t>(p) % align;
  if (off == 0) return true;
  report("misaligned %zu-byte %s at %p (address %% %zu = %zu); the GPU faults on it", bytes, what,
         p, align, off);
  return false;
}

// A `bytes`-long copy that must be `align`-aligned at both ends; misaligned, it is reported
// and done byte by byte (never with the aligned instructions the compiler would pick).
inline void checked_copy(void* dst, const void* src, size_t bytes, size_t align) {
  const bool ok_src = check_aligned(src, align, bytes, "load");
  const bool ok_dst = check_aligned(dst, align, bytes, "store");
  if (ok_src && ok_dst) {
    std::memcpy(dst, src, bytes);
    return;
  }
  volatile unsigned char* d = static_cast<volatile unsigned char*>(dst);
  const volatile unsigned char* s = static_cast<const volatile unsigned char*>(src);
  for (size_t i = 0; i < bytes; ++i) d[i] = s[i];
}

// ---------------------------------------------------------------- shared memory

inline void register_shared(const void* p, size_t bytes, const char* name) {
  shared_ranges().push_back({static_cast<const unsigned char*>(p), bytes, name});
  std::memset(const_cast<void*>(p), 0xff, bytes);
}

// "`smem` byte 492" for a shared address.
inline void describe_shared(const void* p, char* out, size_t n) {
  const unsigned char* b = static_cast<const unsigned char*>(p);
  const std::vector<unsigned char>& dyn = cta().dynamic_shared;
  if (!dyn.empty() && b >= dyn.data() && b < dyn.data() + dyn.size()) {
    std::snprintf(out, n, "dynamic shared memory byte %td", b - dyn.data());
    return;
  }
  for (const SharedRange& r : shared_ranges()) {
    if (b >= r.begin && b < r.begin + r.bytes) {
      std::snprintf(out, n, "`%s` byte %td", r.name, b - r.begin);
      return;
    }
  }
  std::snprintf(out, n, "shared address %p", p);
}

inline void check_shared(const void* p, size_t bytes, bool write) {
  Cta& c = cta();
  const int me = linear_tid();
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) / 4;
  const uintptr_t last = (reinterpret_cast<uintptr_t>(p) + bytes - 1) / 4;
  for (uintptr_t w = first; w <= last; ++w) {
    Shadow& s = c.shadow[w];
    char where[160];
    const void* addr = reinterpret_cast<const void*>(w * 4);
    const bool wrote_now = s.writer >= 0 && s.write_epoch == c.epoch && s.writer != me;
    if (!write) {
      if (s.writer < 0) {
        describe_shared(addr, where, sizeof(where));
        report("reads %s before any thread of its block wrote it (uninitialised shared memory)",
               where);
      } else if (wrote_now) {
        describe_shared(addr, where, sizeof(where));
        report("reads %s, which thread %d wrote with no __syncthreads() in between "
               "(shared-memory race)", where, s.writer);
      }
      if (s.read_epoch != c.epoch) {
        s.read_epoch = c.epoch;
        s.reader = me;
        s.many_readers = false;
      } else if (s.reader != me) {
        s.many_readers = true;
      }
      continue;
    }
    const bool read_now = s.read_epoch == c.epoch && (s.many_readers || s.reader != me);
    if (read_now || wrote_now) {
      describe_shared(addr, where, sizeof(where));
      if (read_now) {
        report("writes %s, which thread %d%s read with no __syncthreads() in between "
               "(shared-memory race)", where, s.reader, s.many_readers ? " and others" : "");
      } else {
        report("writes %s, which thread %d also wrote with no __syncthreads() in between "
               "(shared-memory race)", where, s.writer);
      }
    }
    s.writer = me;
    s.write_epoch = c.epoch;
  }
}

// Every shared load and store comes here first: a yield point, then the checks.
inline void shared_access(const void* p, size_t bytes, size_t align, bool write) {
  yield();
  check_aligned(p, align, bytes, write ? "shared store" : "shared load");
  if (config().race_check) check_shared(p, bytes, write);
}

template <typename T>
struct SharedRef {
  T* p;
  operator T() const {
    shared_access(p, sizeof(T), alignof(T), false);
    return *p;
  }
  const SharedRef& operator=(T v) const {
    shared_access(p, sizeof(T), alignof(T), true);
    *p = v;
    return *this;
  }
  const SharedRef& operator=(const SharedRef& o) const { return *this = static_cast<T>(o); }
  const SharedRef& operator+=(T v) const { return *this = static_cast<T>(*this) + v; }
};

// A pointer into shared memory whose element accesses go through shared_access.
template <typename E>
struct SharedPtr {
  E* p;
  auto operator[](long long i) const {
    if constexpr (std::is_array_v<E>) {
      return SharedPtr<std::remove_extent_t<E>>{p[i]};
    } else {
      return SharedRef<E>{p + i};
    }
  }
  auto operator*() const { return (*this)[0]; }
  SharedPtr operator+(long long i) const { return {p + i}; }
};

// The storage of one HEADROOM_SHARED array (`A` is the array type, e.g. float[4][16]).
template <typename A>
struct SharedArray {
  alignas(16) A data;
  explicit SharedArray(const char* name) { register_shared(&data, sizeof(A), name); }
  SharedPtr<std::remove_extent_t<A>> view() { return {data}; }
};

template <typename T>
SharedPtr<T> dynamic_shared_view() {
  return {reinterpret_cast<T*>(dynamic_shared())};
}

}  // namespace emu

// ---------------------------------------------------------------- CUDA types and intrinsics

struct alignas(16) uint4 {
  unsigned int x, y, z, w;
  uint4() = default;
  uint4(unsigned a, unsigned b, unsigned c, unsigned d) : x(a), y(b), z(c), w(d) {}
  uint4(const uint4& o) { ::emu::checked_copy(this, &o, 16, 16); }
  uint4& operator=(const uint4& o) {
    ::emu::checked_copy(this, &o, 16, 16);
    return *this;
  }
};
struct alignas(8) uint2 {
  unsigned int x, y;
  uint2() = default;
  uint2(unsigned a, unsigned b) : x(a), y(b) {}
  uint2(const uint2& o) { ::emu::checked_copy(this, &o, 8, 8); }
  uint2& operator=(const uint2& o) {
    ::emu::checked_copy(this, &o, 8, 8);
    return *this;
  }
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
// A read-only global load, naturally aligned as the GPU requires.
template <typename T>
inline T __ldg(const T* p) {
  T v;
  ::emu::checked_copy(&v, p, sizeof(T), alignof(T));
  return v;
}

namespace emu {

inline float shfl_xor(float v, int mask) {
  Cta& c = cta();
  const int tid = linear_tid();
  const int warp = tid / 32;
  const int lane = tid % 32;
  c.shfl[warp * 32 + lane] = v;
  arrive(c.warp_barriers[warp], false);
  const float r = c.shfl[warp * 32 + (lane ^ mask)];
  arrive(c.warp_barriers[warp], false);
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
  arrive(c.warp_barriers[warp], false);
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
  arrive(c.warp_barriers[warp], false);
  for (int ci = 0; ci < 4; ++ci) d[ci] = out[ci];
}

}  // namespace emu

#define threadIdx (::emu::thread_idx())
#define blockIdx (::emu::cta().block_idx)
#define blockDim (::emu::cta().block_dim)
#define gridDim (::emu::cta().grid_dim)

inline void __syncthreads() { ::emu::syncthreads(); }
inline float __shfl_xor_sync(unsigned, float v, int mask) { return ::emu::shfl_xor(v, mask); }
