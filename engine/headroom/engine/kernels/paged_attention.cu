// Paged decode attention over the `[num_blocks, block_size, num_kv_heads, head_dim]` cache.
//
// One CTA (4 warps) owns one (query row, kv head, context partition) and every query head of
// that kv head (up to 16; more heads take more CTAs), so the partition's K/V bytes are read
// once for the whole GQA group. Each warp streams 16-token tiles with tensor-core MMAs:
//   S^T tile   = Q[16 heads x D] . K[16 tokens x D]^T      (m16n8k16, two 8-token N blocks)
//   O[16 x D] += P[16 heads x 16 tokens] . V[16 tokens x D] (m16n8k16, D/8 N blocks)
// with the online softmax in fp32 between the two, so any context length runs in fixed
// shared memory. The head-dim and token orders inside a fragment are permuted so that every
// lane loads 16 contiguous bytes of a K or V row straight from global memory into MMA
// registers (the dot product does not care about the order of its terms as long as Q uses
// the same one). The 4 warps' partial softmax states are merged through shared memory at the
// end. With a partition grid (z > 1, "v2") each CTA writes its normalised partial output and
// log2-domain max and sum; `paged_attention_reduce` combines the partitions.
//
// KV dequantisation stays in registers: fp8 e4m3 and int8 convert exactly to f16, the fp8
// per-head scales fold into the score scale and the output, int8 per-token scales into the
// scores (K) and P (V). Softmax and accumulation are fp32; P enters the second MMA as bf16
// (bf16 cache) or f16 (all other caches), like FlashAttention. int8 V scales never pass through
// f16, which cannot hold them (|v| ~ 1e-6 underflows) or their products with the codes
// (|v| >= 65520 overflows): each tile multiplies P in fp32 by scale / (the tile's largest
// scale), a factor in [0, 1], and its PV product by that largest scale, in fp32.
#include "common.cuh"

namespace headroom {

constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = kDecodeWarps * kWarpSize;
constexpr int kTileTokens = 16;
constexpr int kHeadsPerCta = 16;

template <typename QT, int KV, int D>
struct DecodeConfig {
  // The MMA input type: bf16 only when both Q and the cache are bf16; fp8/int8 K and V are
  // exact in f16 and f16 keeps three more mantissa bits of P.
  static constexpr bool kBf16 = is_same<QT, __nv_bfloat16>::value && KV == KV_AUTO;
  static constexpr int kElemBytes = KV == KV_AUTO ? 2 : 1;
  static constexpr int kRowBytes = D * kElemBytes;
  // K: a lane reads kKUnits 16-byte units of each of its 2 tokens (tokens g and 8 + g).
  static constexpr int kKUnits = kRowBytes / 64;
  static constexpr int kKElemsPerUnit = 16 / kElemBytes;
  static constexpr int kKStepsPerUnit = kKElemsPerUnit / 4;
  static constexpr int kKSteps = D / 16;
  // V: a lane reads kVBytes of each of its 4 tokens (2t, 2t+1, 8+2t, 9+2t) in kVUnits units.
  static constexpr int kVBytes = kRowBytes / 8;
  static constexpr int kVUnitBytes = kVBytes < 16 ? kVBytes : 16;
  static constexpr int kVUnits = kVBytes / kVUnitBytes;
  static constexpr int kVWords = kVUnitBytes / 4;
  static constexpr int kVElemsPerUnit = kVUnitBytes / kElemBytes;
  static constexpr int kNBlocks = D / 8;
  static_assert(D % 64 == 0, "head_dim must be a multiple of 64");
  static_assert(kKUnits * kKStepsPerUnit == kKSteps, "K fragment mapping");
};

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// The head-dim index that V unit element (j-th N block) of lane group `n` holds.
template <typename C>
__device__ __forceinline__ int v_dim(int j, int n) {
  const int u = j / C::kVElemsPerUnit;
  const int e = j % C::kVElemsPerUnit;
  return (u * 8 + n) * C::kVElemsPerUnit + e;
}

template <typename C>
__device__ __forceinline__ void load_k_tile(u32 (&kraw)[2][C::kKUnits][4],
                                            const unsigned char* base, i64 token_bytes, int g,
                                            int t) {
#pragma unroll
  for (int nb = 0; nb < 2; ++nb) {
    const unsigned char* row = base + (nb * 8 + g) * token_bytes;
#pragma unroll
    for (int u = 0; u < C::kKUnits; ++u) {
      uint4 x = load16(row + (4 * u + t) * 16);
      kraw[nb][u][0] = x.x;
      kraw[nb][u][1] = x.y;
      kraw[nb][u][2] = x.z;
      kraw[nb][u][3] = x.w;
    }
  }
}

// The lane's 4 V rows; rows at or past `valid` tokens read as zero so stale or poisoned
// slots of a partly filled block cannot leak NaN through the zero softmax weights.
template <typename C>
__device__ __forceinline__ void load_v_tile(u32 (&vraw)[4][C::kVUnits][C::kVWords],
                                            const unsigned char* base, i64 token_bytes,
                                            int valid, int g, int t) {
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const int tok = (s & 1) + 2 * t + (s >> 1) * 8;
    const bool ok = tok < valid;
    const unsigned char* row = base + tok * token_bytes;
#pragma unroll
    for (int u = 0; u < C::kVUnits; ++u) {
      const unsigned char* p = row + (u * 8 + g) * C::kVUnitBytes;
      if constexpr (C::kVWords == 4) {
        uint4 x = ok ? load16(p) : make_uint4(0u, 0u, 0u, 0u);
        vraw[s][u][0] = x.x;
        vraw[s][u][1] = x.y;
        vraw[s][u][2] = x.z;
        vraw[s][u][3] = x.w;
      } else {
        uint2 x = ok ? load8(p) : make_uint2(0u, 0u);
        vraw[s][u][0] = x.x;
        vraw[s][u][1] = x.y;
      }
    }
  }
}

// The two B registers of k-step `i` of a K unit (16 bytes of one token's row).
template <int KV>
__device__ __forceinline__ void k_frag(const u32 (&w)[4], int i, u32& b0, u32& b1) {
  if constexpr (KV == KV_AUTO) {
    b0 = w[2 * i];
    b1 = w[2 * i + 1];
  } else if constexpr (KV == KV_FP8) {
    b0 = fp8x2_to_f16x2(w[i]);
    b1 = fp8x2_to_f16x2(w[i] >> 16);
  } else {
    const u32 x = w[i] ^ 0x80808080u;
    b0 = int8x2_to_f16x2(x, 0x4140u);
    b1 = int8x2_to_f16x2(x, 0x4342u);
  }
}

template <typename QT, int KV, int D>
__device__ __forceinline__ void decode_impl(
    QT* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_max,
    float* __restrict__ part_sum, const QT* __restrict__ query,
    const unsigned char* __restrict__ k_cache, const unsigned char* __restrict__ v_cache,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale,
    const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
    const int* __restrict__ row_to_seq, int num_heads, int num_kv_heads, int block_size,
    int max_blocks_per_seq, i64 q_row_stride, i64 q_head_stride, int partition_size,
    int max_partitions, float scale) {
  using C = DecodeConfig<QT, KV, D>;
  constexpr bool BF = C::kBf16;

  HEADROOM_SHARED(float, smem, [kDecodeWarps * kHeadsPerCta * D]);
  HEADROOM_SHARED(float, smem_max, [kDecodeWarps][kHeadsPerCta]);
  HEADROOM_SHARED(float, smem_sum, [kDecodeWarps][kHeadsPerCta]);

  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int g = lane >> 2;
  const int t = lane & 3;

  const int group = num_heads / num_kv_heads;
  const int chunks = (group + kHeadsPerCta - 1) / kHeadsPerCta;
  const int kv_head = blockIdx.x / chunks;
  const int chunk = blockIdx.x % chunks;
  const int head0 = kv_head * group + chunk * kHeadsPerCta;
  const int rows = min(kHeadsPerCta, group - chunk * kHeadsPerCta);
  const int qrow = blockIdx.y;
  const int part = blockIdx.z;
  const int seq = row_to_seq != nullptr ? row_to_seq[qrow] : qrow;
  const int ctx = seq_lens[qrow];
  const int start = part * partition_size;
  if (start > 0 && start >= ctx) {
    return;  // a partition past this row's context: the reduce kernel never reads it
  }
  const int end = partition_size > 0 ? min(ctx, start + partition_size) : ctx;

  // Stage Q (16 heads x D, fp32) and build the A fragments of the first MMA.
  for (int i = threadIdx.x; i < kHeadsPerCta * D; i += kDecodeThreads) {
    const int r = i / D;
    const int d = i % D;
    float v = 0.0f;
    if (r < rows) {
      v = to_float(query[qrow * q_row_stride + (head0 + r) * q_head_stride + d]);
    }
    if constexpr (!BF && is_same<QT, __nv_bfloat16>::value) {
      v = fminf(fmaxf(v, -65504.0f), 65504.0f);  // bf16 Q meets an f16 MMA: stay finite
    }
    smem[i] = v;
  }
  __syncthreads();
  u32 qa[C::kKSteps][4];
#pragma unroll
  for (int ks = 0; ks < C::kKSteps; ++ks) {
    const int u = ks / C::kKStepsPerUnit;
    const int i = ks % C::kKStepsPerUnit;
    const int d = (4 * u + t) * C::kKElemsPerUnit + 4 * i;
    const auto q0 = smem + g * D + d;
    const auto q8 = smem + (g + 8) * D + d;
    qa[ks][0] = pack2<BF>(q0[0], q0[1]);
    qa[ks][1] = pack2<BF>(q8[0], q8[1]);
    qa[ks][2] = pack2<BF>(q0[2], q0[3]);
    qa[ks][3] = pack2<BF>(q8[2], q8[3]);
  }
  __syncthreads();  // `smem` is reused for the merge below

  float qk_scale = scale * 1.4426950408889634f;  // softmax in the log2 domain
  float out_scale = 1.0f;
  if constexpr (KV == KV_FP8) {
    qk_scale *= k_scale[kv_head];
    out_scale = v_scale[kv_head];
  }

  const int n_tiles = end > start ? (end - start + kTileTokens - 1) / kTileTokens : 0;
  const int* table = block_tables + static_cast<i64>(seq) * max_blocks_per_seq;
  const i64 token_bytes = static_cast<i64>(num_kv_heads) * C::kRowBytes;
  const i64 head_bytes = static_cast<i64>(kv_head) * C::kRowBytes;

  float m_run[2] = {neg_inf(), neg_inf()};
  float l_run[2] = {0.0f, 0.0f};
  float acc[C::kNBlocks][4];
#pragma unroll
  for (int j = 0; j < C::kNBlocks; ++j) {
    acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  }

  // Software pipeline: K of the next tile and the block id of the one after are in flight
  // while the current tile's softmax and PV run.
  u32 kraw[2][C::kKUnits][4];
  int tile = warp;
  int phys = 0;
  int phys_next = 0;
  if (tile < n_tiles) {
    const int pos = start + tile * kTileTokens;
    phys = table[pos / block_size];
    load_k_tile<C>(kraw, k_cache + (static_cast<i64>(phys) * block_size + pos % block_size) *
                                       token_bytes + head_bytes,
                   token_bytes, g, t);
  }
  if (tile + kDecodeWarps < n_tiles) {
    phys_next = table[(start + (tile + kDecodeWarps) * kTileTokens) / block_size];
  }

  for (; tile < n_tiles; tile += kDecodeWarps) {
    const int pos = start + tile * kTileTokens;
    const int valid = end - pos;  // >= 1: tokens of this tile inside the partition
    const i64 slot0 = static_cast<i64>(phys) * block_size + pos % block_size;

    u32 vraw[4][C::kVUnits][C::kVWords];
    load_v_tile<C>(vraw, v_cache + slot0 * token_bytes + head_bytes, token_bytes, valid, g, t);
    // Per token s of the lane (token (s & 1) + 2t + (s >> 1) * 8, the same 4 tokens in P's A
    // fragment and V's B fragment): the K scale and the V scale relative to the tile's largest.
    float ksc[4];
    float vrel[4];
    float v_tile = 1.0f;
    if constexpr (KV == KV_INT8) {
      float vs[4];
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const int tok = (s & 1) + 2 * t + (s >> 1) * 8;
        const i64 idx = (slot0 + tok) * num_kv_heads + kv_head;
        ksc[s] = tok < valid ? __ldg(k_scale + idx) : 0.0f;
        vs[s] = tok < valid ? __ldg(v_scale + idx) : 0.0f;
      }
      v_tile = fmaxf(fmaxf(vs[0], vs[1]), fmaxf(vs[2], vs[3]));
      v_tile = fmaxf(v_tile, __shfl_xor_sync(kFullMask, v_tile, 1));  // lanes t hold all 16
      v_tile = fmaxf(v_tile, __shfl_xor_sync(kFullMask, v_tile, 2));
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        vrel[s] = v_tile > 0.0f ? vs[s] / v_tile : 0.0f;  // IEEE division: exact at the max
      }
    } else {
      ksc[0] = ksc[1] = ksc[2] = ksc[3] = 1.0f;
      vrel[0] = vrel[1] = vrel[2] = vrel[3] = 1.0f;
    }

    // S^T for 16 heads x 16 tokens: s[nb] holds (head g | g+8, token nb*8 + 2t | 2t+1).
    float s[2][4];
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
      s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < C::kKSteps; ++ks) {
        u32 b0;
        u32 b1;
        k_frag<KV>(kraw[nb][ks / C::kKStepsPerUnit], ks % C::kKStepsPerUnit, b0, b1);
        mma_16816<BF>(s[nb], qa[ks], b0, b1);
      }
    }

    int phys_after = 0;
    if (tile + kDecodeWarps < n_tiles) {
      const int npos = pos + kDecodeWarps * kTileTokens;
      load_k_tile<C>(kraw, k_cache + (static_cast<i64>(phys_next) * block_size +
                                      npos % block_size) * token_bytes + head_bytes,
                     token_bytes, g, t);
    }
    if (tile + 2 * kDecodeWarps < n_tiles) {
      phys_after = table[(pos + 2 * kDecodeWarps * kTileTokens) / block_size];
    }

    // Online softmax per head row (hr 0: head g, hr 1: head g + 8).
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int tok = nb * 8 + 2 * t + (r & 1);
        const float x = s[nb][r] * qk_scale * ksc[nb * 2 + (r & 1)];
        s[nb][r] = tok < valid ? x : neg_inf();
      }
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float mx = fmaxf(fmaxf(s[0][2 * hr], s[0][2 * hr + 1]), fmaxf(s[1][2 * hr], s[1][2 * hr + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
      const float m_new = fmaxf(m_run[hr], mx);  // finite: token 0 of a tile is always valid
      const float alpha = fast_exp2(m_run[hr] - m_new);
      m_run[hr] = m_new;
      float psum = 0.0f;
#pragma unroll
      for (int nb = 0; nb < 2; ++nb) {
        s[nb][2 * hr] = fast_exp2(s[nb][2 * hr] - m_new);
        s[nb][2 * hr + 1] = fast_exp2(s[nb][2 * hr + 1] - m_new);
        psum += s[nb][2 * hr] + s[nb][2 * hr + 1];
      }
      l_run[hr] = l_run[hr] * alpha + psum;
#pragma unroll
      for (int j = 0; j < C::kNBlocks; ++j) {
        acc[j][2 * hr] *= alpha;
        acc[j][2 * hr + 1] *= alpha;
      }
    }

    // P as the A operand: its C layout of the first MMA is the A layout of the second. For
    // int8, P times the relative V scale of its token (s[nb][r] is token nb * 8 + 2t + (r & 1)).
    if constexpr (KV == KV_INT8) {
#pragma unroll
      for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          s[nb][r] *= vrel[nb * 2 + (r & 1)];
        }
      }
    }
    const u32 pa[4] = {pack2<BF>(s[0][0], s[0][1]), pack2<BF>(s[0][2], s[0][3]),
                       pack2<BF>(s[1][0], s[1][1]), pack2<BF>(s[1][2], s[1][3])};

    if constexpr (KV == KV_AUTO) {
#pragma unroll
      for (int j = 0; j < C::kNBlocks; ++j) {
        const int u = j / C::kVElemsPerUnit;
        const int e = j % C::kVElemsPerUnit;
        const u32 sel = (e & 1) ? 0x7632u : 0x5410u;
        const u32 b0 = byte_perm(vraw[0][u][e / 2], vraw[1][u][e / 2], sel);
        const u32 b1 = byte_perm(vraw[2][u][e / 2], vraw[3][u][e / 2], sel);
        mma_16816<BF>(acc[j], pa, b0, b1);
      }
    } else {
#pragma unroll
      for (int j = 0; j < C::kNBlocks; j += 2) {
        const int u = j / C::kVElemsPerUnit;
        const int e = j % C::kVElemsPerUnit;
        const u32 k = static_cast<u32>(e % 4);
        const u32 sel = k | ((4u + k) << 4) | ((k + 1u) << 8) | ((5u + k) << 12);
        u32 x01 = byte_perm(vraw[0][u][e / 4], vraw[1][u][e / 4], sel);
        u32 x23 = byte_perm(vraw[2][u][e / 4], vraw[3][u][e / 4], sel);
        if constexpr (KV == KV_FP8) {
          mma_16816<BF>(acc[j], pa, fp8x2_to_f16x2(x01), fp8x2_to_f16x2(x23));
          mma_16816<BF>(acc[j + 1], pa, fp8x2_to_f16x2(x01 >> 16), fp8x2_to_f16x2(x23 >> 16));
        } else {
          // The int8 codes as exact f16; the tile's V scale multiplies their product in fp32.
          x01 ^= 0x80808080u;
          x23 ^= 0x80808080u;
          float pv_e[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          float pv_o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          mma_16816<BF>(pv_e, pa, int8x2_to_f16x2(x01, 0x4140u), int8x2_to_f16x2(x23, 0x4140u));
          mma_16816<BF>(pv_o, pa, int8x2_to_f16x2(x01, 0x4342u), int8x2_to_f16x2(x23, 0x4342u));
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            acc[j][c] += pv_e[c] * v_tile;
            acc[j + 1][c] += pv_o[c] * v_tile;
          }
        }
      }
    }

    phys = phys_next;
    phys_next = phys_after;
  }

  // Merge the 4 warps' (max, sum, acc) per head row.
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    l_run[hr] += __shfl_xor_sync(kFullMask, l_run[hr], 1);
    l_run[hr] += __shfl_xor_sync(kFullMask, l_run[hr], 2);
  }
  const auto wacc = smem + warp * kHeadsPerCta * D;
#pragma unroll
  for (int j = 0; j < C::kNBlocks; ++j) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int r = g + 8 * (c >> 1);
      wacc[r * D + v_dim<C>(j, 2 * t + (c & 1))] = acc[j][c];
    }
  }
  if (t == 0) {
    smem_max[warp][g] = m_run[0];
    smem_max[warp][g + 8] = m_run[1];
    smem_sum[warp][g] = l_run[0];
    smem_sum[warp][g + 8] = l_run[1];
  }
  __syncthreads();

  for (int i = threadIdx.x; i < rows * D; i += kDecodeThreads) {
    const int r = i / D;
    const int d = i % D;
    float m_all = neg_inf();
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      m_all = fmaxf(m_all, smem_max[w][r]);
    }
    float l_all = 0.0f;
    float o = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      const float mw = smem_max[w][r];
      const float f = mw == neg_inf() ? 0.0f : fast_exp2(mw - m_all);
      l_all += smem_sum[w][r] * f;
      o += smem[(w * kHeadsPerCta + r) * D + d] * f;
    }
    const float value = l_all > 0.0f ? o / l_all * out_scale : 0.0f;
    const i64 oh = static_cast<i64>(qrow) * num_heads + head0 + r;
    if (part_out == nullptr) {
      out[oh * D + d] = from_float<QT>(value);
    } else {
      const i64 pidx = oh * max_partitions + part;
      part_out[pidx * D + d] = value;
      if (d == 0) {
        part_max[pidx] = m_all;
        part_sum[pidx] = l_all;
      }
    }
  }
}

// Combines the partitions of each (query row, head): weights sum_p * 2^(max_p - max).
template <typename QT>
__device__ __forceinline__ void reduce_impl(QT* __restrict__ out,
                                            const float* __restrict__ part_out,
                                            const float* __restrict__ part_max,
                                            const float* __restrict__ part_sum,
                                            const int* __restrict__ seq_lens, int num_heads,
                                            int head_dim, int partition_size,
                                            int max_partitions) {
  HEADROOM_DYNAMIC_SHARED(float, weights);  // [max_partitions]
  HEADROOM_SHARED(float, red, [kDecodeWarps]);
  const int head = blockIdx.x;
  const int qrow = blockIdx.y;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int ctx = seq_lens[qrow];
  const int n_parts = ctx > 0 ? min(max_partitions, (ctx + partition_size - 1) / partition_size) : 0;
  const i64 oh = static_cast<i64>(qrow) * num_heads + head;
  const i64 base = oh * max_partitions;

  float m = neg_inf();
  for (int p = threadIdx.x; p < n_parts; p += blockDim.x) {
    m = fmaxf(m, part_max[base + p]);
  }
  m = warp_max(m);
  if (lane == 0) {
    red[warp] = m;
  }
  __syncthreads();
  float m_all = red[0];
  for (int w = 1; w < kDecodeWarps; ++w) {
    m_all = fmaxf(m_all, red[w]);
  }
  __syncthreads();

  float total = 0.0f;
  for (int p = threadIdx.x; p < n_parts; p += blockDim.x) {
    const float mp = part_max[base + p];
    const float w = mp == neg_inf() ? 0.0f : part_sum[base + p] * fast_exp2(mp - m_all);
    weights[p] = w;
    total += w;
  }
  total = warp_sum(total);
  if (lane == 0) {
    red[warp] = total;
  }
  __syncthreads();
  float l_all = 0.0f;
  for (int w = 0; w < kDecodeWarps; ++w) {
    l_all += red[w];
  }
  const float inv = l_all > 0.0f ? 1.0f / l_all : 0.0f;

  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float o = 0.0f;
    for (int p = 0; p < n_parts; ++p) {
      o += weights[p] * part_out[(base + p) * head_dim + d];
    }
    out[oh * head_dim + d] = from_float<QT>(o * inv);
  }
}

}  // namespace headroom

// C entry points, one per variant; compile.py appends the instantiation lines.
#define HEADROOM_DECODE_KERNEL(NAME, QT, KV, D)                                              \
  extern "C" __global__ void __launch_bounds__(headroom::kDecodeThreads) NAME(             \
      QT* out, float* part_out, float* part_max, float* part_sum, const QT* query,           \
      const unsigned char* k_cache, const unsigned char* v_cache, const float* k_scale,      \
      const float* v_scale, const int* block_tables, const int* seq_lens,                    \
      const int* row_to_seq, int num_heads, int num_kv_heads, int block_size,                \
      int max_blocks_per_seq, long long q_row_stride, long long q_head_stride,               \
      int partition_size, int max_partitions, float scale) {                                 \
    headroom::decode_impl<QT, KV, D>(out, part_out, part_max, part_sum, query, k_cache,      \
                                     v_cache, k_scale, v_scale, block_tables, seq_lens,      \
                                     row_to_seq, num_heads, num_kv_heads, block_size,        \
                                     max_blocks_per_seq, q_row_stride, q_head_stride,        \
                                     partition_size, max_partitions, scale);                 \
  }

#define HEADROOM_REDUCE_KERNEL(NAME, QT)                                                     \
  extern "C" __global__ void __launch_bounds__(headroom::kDecodeThreads) NAME(             \
      QT* out, const float* part_out, const float* part_max, const float* part_sum,          \
      const int* seq_lens, int num_heads, int head_dim, int partition_size,                  \
      int max_partitions) {                                                                  \
    headroom::reduce_impl<QT>(out, part_out, part_max, part_sum, seq_lens, num_heads,        \
                              head_dim, partition_size, max_partitions);                     \
  }
