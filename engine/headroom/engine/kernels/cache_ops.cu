// Cache writes (`reshape_and_cache`) and copy-on-write block copies (`copy_blocks`).
//
// Slot s of a `[num_blocks, block_size, num_kv_heads, head_dim]` cache starts at element
// s * num_kv_heads * head_dim, so writes need no block size. Quantisation follows
// attention/base.py: fp8 stores x / scale[head] saturated to +-448 (round to nearest even);
// int8 stores round(x / scale) with scale = absmax / 127 per (token, head), scale 0 and zero
// codes for an all-zero row. Division is IEEE (`x / s`, no fast math) so the codes equal the
// torch reference's bit for bit. The absmax keeps NaN as torch's amax does (fmaxf would drop
// it): a row holding NaN stores scale NaN and reads back NaN on both backends.
#include "common.cuh"

namespace headroom {

constexpr int kCacheWarps = 4;
constexpr int kCacheThreads = kCacheWarps * kWarpSize;

// max(a, b), NaN when either is NaN (fmaxf returns the other operand).
__device__ __forceinline__ float max_keep_nan(float a, float b) {
  return a != a ? a : (b != b ? b : fmaxf(a, b));
}

__device__ __forceinline__ float warp_max_keep_nan(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v = max_keep_nan(v, __shfl_xor_sync(kFullMask, v, offset));
  }
  return v;
}

template <typename IT, int KV>
__device__ __forceinline__ void write_row(const IT* __restrict__ src,
                                          unsigned char* __restrict__ cache,
                                          float* __restrict__ scales, i64 slot, int head,
                                          int num_kv_heads, int head_dim, int lane) {
  const i64 row = (slot * num_kv_heads + head) * head_dim;
  if constexpr (KV == KV_AUTO) {
    IT* dst = reinterpret_cast<IT*>(cache) + row;
    for (int d = lane; d < head_dim; d += kWarpSize) {
      dst[d] = src[d];
    }
  } else if constexpr (KV == KV_FP8) {
    const float s = scales[head];
    __nv_fp8_storage_t* dst = reinterpret_cast<__nv_fp8_storage_t*>(cache) + row;
    for (int d = lane; d < head_dim; d += kWarpSize) {
      dst[d] = __nv_cvt_float_to_fp8(to_float(src[d]) / s, __NV_SATFINITE, __NV_E4M3);
    }
  } else {
    float amax = 0.0f;
    for (int d = lane; d < head_dim; d += kWarpSize) {
      amax = max_keep_nan(amax, fabsf(to_float(src[d])));
    }
    amax = warp_max_keep_nan(amax);
    const float s = amax / 127.0f;
    if (lane == 0) {
      scales[slot * num_kv_heads + head] = s;
    }
    signed char* dst = reinterpret_cast<signed char*>(cache) + row;
    for (int d = lane; d < head_dim; d += kWarpSize) {
      int q = 0;
      if (s > 0.0f) {
        q = max(-127, min(127, __float2int_rn(to_float(src[d]) / s)));
      }
      dst[d] = static_cast<signed char>(q);
    }
  }
}

// Grid: one CTA per token; each warp writes whole (token, head) rows of K and V.
template <typename IT, int KV>
__device__ __forceinline__ void cache_write_impl(
    const IT* __restrict__ key, const IT* __restrict__ value, unsigned char* __restrict__ k_cache,
    unsigned char* __restrict__ v_cache, float* __restrict__ k_scale,
    float* __restrict__ v_scale, const i64* __restrict__ slot_mapping, int num_kv_heads,
    int head_dim, i64 k_token_stride, i64 k_head_stride, i64 v_token_stride,
    i64 v_head_stride) {
  const int token = blockIdx.x;
  const i64 slot = slot_mapping[token];
  if (slot < 0) {
    return;  // padding token: nothing to store
  }
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  for (int h = warp; h < num_kv_heads; h += kCacheWarps) {
    write_row<IT, KV>(key + token * k_token_stride + h * k_head_stride, k_cache, k_scale, slot,
                      h, num_kv_heads, head_dim, lane);
    write_row<IT, KV>(value + token * v_token_stride + h * v_head_stride, v_cache, v_scale,
                      slot, h, num_kv_heads, head_dim, lane);
  }
}

}  // namespace headroom

#define HEADROOM_CACHE_WRITE_KERNEL(NAME, IT, KV)                                            \
  extern "C" __global__ void __launch_bounds__(headroom::kCacheThreads) NAME(              \
      const IT* key, const IT* value, unsigned char* k_cache, unsigned char* v_cache,        \
      float* k_scale, float* v_scale, const long long* slot_mapping, int num_kv_heads,       \
      int head_dim, long long k_token_stride, long long k_head_stride,                       \
      long long v_token_stride, long long v_head_stride) {                                   \
    headroom::cache_write_impl<IT, KV>(key, value, k_cache, v_cache, k_scale, v_scale,       \
                                       slot_mapping, num_kv_heads, head_dim,                 \
                                       k_token_stride, k_head_stride, v_token_stride,        \
                                       v_head_stride);                                       \
  }

// Copy-on-write: grid (pair, layer); `layers` is [num_layers][4] byte addresses of K, V,
// K scales, V scales (0 where a layer has no per-block scales), `pairs` is [num_pairs][2]
// (src, dst) block ids. Both byte counts are multiples of 16 (checked by the launcher).
extern "C" __global__ void __launch_bounds__(256)
    copy_blocks(const long long* layers, const long long* pairs, long long block_bytes,
                long long scale_block_bytes) {
  const long long src = pairs[2 * blockIdx.x];
  const long long dst = pairs[2 * blockIdx.x + 1];
  for (int which = 0; which < 4; ++which) {
    const long long base = layers[4 * blockIdx.y + which];
    if (base == 0) {
      continue;
    }
    const long long nbytes = which < 2 ? block_bytes : scale_block_bytes;
    const uint4* from = reinterpret_cast<const uint4*>(base + src * nbytes);
    uint4* to = reinterpret_cast<uint4*>(base + dst * nbytes);
    for (long long i = threadIdx.x; i < nbytes / 16; i += blockDim.x) {
      to[i] = from[i];
    }
  }
}
