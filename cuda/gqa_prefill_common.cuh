// What the prefill kernels share: the per-sequence status, NaN rows for a bad sequence, zero
// rows past its new tokens and the fused append of the new K/V (PrefillPrologue), for the
// padded and the packed form alike, plus the Hopper kernel's launcher
// (cuda/gqa_prefill_wgmma.cu).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/gqa_params.h"
#include "cuda/kernel_common.cuh"
#include "cuda/mma.cuh"

namespace jax_kv {
namespace prefill {

// Whether a packed call's cu_seqlens keeps its contract (always true in the padded form). Each
// warp checks all B + 1 entries itself, a lane per entry, and votes; every lane of every warp
// calls it. A warp vote, not a CTA barrier (__syncthreads_or): with the barrier the mma.sync
// kernel took 165 registers at D = 128 and 137 at D = 64, with the vote 136 and 128 (138 and
// 102 before the packed form; nvcc --resource-usage, sm_90a), and 128 keeps D = 64 at the 4
// CTAs per SM its shared memory allows.
// NOTE(perf): (B + 1) / 32 loads per lane in each CTA that gets this far (L1 hits: every CTA
// reads the same array). In the packed grid every block reads cu_seqlens twice, here and in
// PackedBlockOf; passing that scan's result on would save the second read.
template <typename T>
__device__ __forceinline__ bool CuSeqlensOk(const GqaParams<T>& p) {
  if (p.cu_seqlens == nullptr) return true;
  bool bad = false;
  for (int i = threadIdx.x % 32; i <= p.batch; i += 32) bad |= cu_seqlens_entry_bad(p, i);
  return !__any_sync(0xffffffffu, bad);
}

template <typename T>
__device__ __forceinline__ T NanOf() {
  return from_f32<T>(__int_as_float(0x7fc00000));
}

// Status, NaN rows for a bad b, zero rows past its new tokens and the fused append: the part
// both prefill kernels share. The CTA owns rows [t0, t0 + block_rows) of sequence b's rows of
// out (packed row row0 + t for row t), query head qh. Returns the live row range [t0, t1) it
// must compute, or t0 >= t1 when it has nothing left to do; sets row0.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ int2 PrefillPrologue(const GqaParams<T>& p, int b, int qh, int t0,
                                                int block_rows, bool status_writer, int64_t& row0) {
  // Packed: a tile at or past a non-last sequence's tokens has nothing to write whatever
  // cu_seqlens holds (were it malformed, only the last sequence's tiles would write), so it
  // leaves before the scan: with many slots of few tokens, that is most of the grid.
  // (The packed grid holds few such CTAs: see PrefillBlockOf.)
  if (p.cu_seqlens != nullptr && b < p.batch - 1 && !status_writer && t0 >= row_new_tokens(p, b)) {
    return make_int2(0, 0);
  }
  const PrefillRows r = prefill_rows(p, b, CuSeqlensOk(p));
  row0 = r.row0;
  if (status_writer && threadIdx.x == 0) p.status[b] = r.status;
  const int t_end = min(t0 + block_rows, r.out_rows);
  constexpr int V = VecOf<T>::kElems, NV = HEAD_DIM / V;
  auto out_row = [&](int t) { return p.out + ((r.row0 + t) * p.num_q_heads + qh) * HEAD_DIM; };
  const bool ok = r.status == JKV_STATUS_OK;
  const int live_end = min(t_end, ok ? r.n_new : 0);
  if (!ok) {
    const int nan_end = min(t_end, r.nan_rows);
    for (int i = threadIdx.x; i < (nan_end - t0) * HEAD_DIM; i += blockDim.x) {
      out_row(t0 + i / HEAD_DIM)[i % HEAD_DIM] = NanOf<T>();
    }
  }
  const int zero_from = max(t0, ok ? live_end : r.nan_rows);
  for (int i = threadIdx.x; i < (t_end - zero_from) * NV; i += blockDim.x) {
    const int t = zero_from + i / NV;
    stg16(out_row(t) + (i % NV) * V, make_uint4(0, 0, 0, 0));
  }
  if (t0 >= live_end) return make_int2(0, 0);
  const int group = p.num_q_heads / p.num_kv_heads;
  if (qh % group == 0) {
    const int hkv = qh / group, L = p.lengths[b];
    for (int i = threadIdx.x; i < (live_end - t0) * NV; i += blockDim.x) {
      const int t = t0 + i / NV, c = (i % NV) * V;
      const int64_t src = ((r.row0 + t) * p.num_kv_heads + hkv) * HEAD_DIM + c;
      const int64_t dst = kv_offset(p.cache, b, L + t, hkv) + c;
      stg16(p.k_cache + dst, ldg16(p.k_new + src));
      stg16(p.v_cache + dst, ldg16(p.v_new + src));
    }
  }
  return make_int2(t0, live_end);
}

// Packed form: the query blocks sequence b's rows of out can hold work in, at least one (its
// status). The last sequence owns the padding rows up to N too; with a malformed cu_seqlens it
// owns all N rows (NaN) and every other sequence only its status.
template <typename T>
__device__ __forceinline__ int PackedBlocks(const GqaParams<T>& p, int b, int block_m, bool cu_ok) {
  int rows = 0;
  if (b == p.batch - 1) {
    rows = cu_ok ? p.num_tokens - p.cu_seqlens[b] : p.num_tokens;
  } else if (cu_ok) {
    rows = row_new_tokens(p, b);
  }
  return max(1, (max(0, rows) + block_m - 1) / block_m);
}

// The grid's packed extent: sum over b of PackedBlocks <= ceil(N / block_m) + B (the rows of
// all sequences are N, and each adds at most one partial block).
JKV_HOST_DEVICE int PackedGridBlocks(int num_tokens, int batch, int block_m) {
  return (num_tokens + block_m - 1) / block_m + batch;
}

// The launch grid of a prefill kernel with query blocks of block_m rows: see PrefillCta.
template <typename T>
inline dim3 PrefillGrid(const GqaParams<T>& p, int block_m) {
  if (p.cu_seqlens != nullptr) {
    return dim3(PackedGridBlocks(p.num_tokens, p.batch, block_m), p.num_q_heads, 1);
  }
  return dim3(std::max(1, (p.num_tokens + block_m - 1) / block_m), p.num_q_heads, p.batch);
}

// Which (sequence, query block) the packed grid's block w is: each warp walks the sequences 32
// at a time, a scan of PackedBlocks over its lanes, and finds w's owner by a vote (no CTA
// barrier: see CuSeqlensOk). False: w is past the last sequence's blocks.
template <typename T>
__device__ __forceinline__ bool PackedBlockOf(const GqaParams<T>& p, int block_m, int w, int& b,
                                              int& block) {
  constexpr unsigned kAll = 0xffffffffu;
  const bool cu_ok = CuSeqlensOk(p);
  const int lane = threadIdx.x % 32;
  int base = 0;  // blocks of the sequences before this group of 32
  for (int b0 = 0; b0 < p.batch; b0 += 32) {
    const int own = b0 + lane < p.batch ? PackedBlocks(p, b0 + lane, block_m, cu_ok) : 0;
    int upto = own;  // inclusive scan over the lanes
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(kAll, upto, d);
      if (lane >= d) upto += v;
    }
    const int group = __shfl_sync(kAll, upto, 31);
    if (w < base + group) {
      const int owner = __ffs(__ballot_sync(kAll, base + upto > w)) - 1;
      b = b0 + owner;
      block = w - base - __shfl_sync(kAll, upto - own, owner);
      return true;
    }
    base += group;
  }
  return false;
}

// The sequence, query head and query block of this CTA, past the shared prologue. False: the
// CTA has no live query row left to compute. Padded grid: query blocks of block_m rows in
// reverse order (the late, long ones start first), Hq, B. Packed grid: PackedGridBlocks blocks
// over the (sequence, query block) pairs that can hold work, also in reverse, Hq, 1; a grid of
// ceil(N / block_m) per sequence was nearly all CTAs that leave at once (64 slots, N = 4096:
// 131k CTAs for ~2k with work).
struct PrefillCta {
  int b, qh, hkv, L, m0, live_end;
  int64_t q_row0;  // the row of this sequence's token 0 in q, k_new, v_new and out
};

// (b, m0, status writer) of this CTA's query block: see PrefillCta. False: a packed CTA past
// the last sequence's blocks.
template <typename T>
__device__ __forceinline__ bool PrefillBlockOf(const GqaParams<T>& p, int block_m, int& b, int& m0,
                                               bool& status_writer) {
  const int w = gridDim.x - 1 - blockIdx.x;
  if (p.cu_seqlens == nullptr) {
    b = blockIdx.z;
    m0 = w * block_m;
    status_writer = blockIdx.x == 0 && blockIdx.y == 0;
    return true;
  }
  int block = 0;
  if (!PackedBlockOf(p, block_m, w, b, block)) return false;
  m0 = block * block_m;
  status_writer = block == 0 && blockIdx.y == 0;
  return true;
}

template <typename T, int HEAD_DIM>
__device__ __forceinline__ bool BeginPrefillCta(const GqaParams<T>& p, int block_m, PrefillCta& c) {
  c.qh = blockIdx.y;
  c.hkv = c.qh / (p.num_q_heads / p.num_kv_heads);
  c.q_row0 = 0;
  bool status_writer = false;
  if (!PrefillBlockOf(p, block_m, c.b, c.m0, status_writer)) return false;
  const int2 rows =
      PrefillPrologue<T, HEAD_DIM>(p, c.b, c.qh, c.m0, block_m, status_writer, c.q_row0);
  c.live_end = rows.y;
  if (rows.x >= rows.y) return false;
  c.L = p.lengths[c.b];
  return true;
}

// How raw scores (q.k) become log2-domain logits: x * qk_mul, or cap_log2 * tanh(x * qk_mul)
// under softcap (qk_mul then maps to units of the softcap).
struct ScoreScaling {
  float qk_mul, cap_log2;
  bool use_softcap;
  bool prescale;  // softcap, or a scale that is not positive (it would flip the max)
};

__device__ __forceinline__ ScoreScaling MakeScoreScaling(float scale, float softcap) {
  ScoreScaling sc;
  sc.use_softcap = softcap > 0.0f;
  sc.qk_mul = sc.use_softcap ? scale / softcap : scale * kLog2e;
  sc.cap_log2 = softcap * kLog2e;
  sc.prescale = sc.use_softcap || !(sc.qk_mul > 0.0f);
  return sc;
}

// One key block of online softmax over this thread's flat m16n8 fragments (score 4n + e: row
// gid + 8 (e / 2), key key0 + 8n + e % 2 with key0 = the block's first key + 2 tig). On entry s
// holds raw scores; on exit exp2(logit - running max), keys past a row's position (or before
// its window) at 0. o is rescaled to the new max, m and l updated (l per thread: reduce it over
// the quad at the end). Raw scores go into the exponent as FFMA(s, qk_mul, -max) on the common
// path; softcap and masking each run as one loop under one uniform branch: written per score,
// the two `if`s compiled to two branches and a convergence barrier per score (SASS).
template <int N_SCORES, int N_OUT>
__device__ __forceinline__ void SoftmaxBlock(float (&s)[N_SCORES], float (&o)[N_OUT], float (&m)[2],
                                             float (&l)[2], const ScoreScaling& sc, bool need_mask,
                                             int key0, const int (&row_pos)[2], int window) {
  float mul = sc.qk_mul;  // raw score -> log2 units inside the exponent
  if (sc.prescale) {
#pragma unroll
    for (int i = 0; i < N_SCORES; ++i) {
      const float x = s[i] * sc.qk_mul;
      s[i] = sc.use_softcap ? sc.cap_log2 * TanhBranchless(x) : x;
    }
    mul = 1.0f;
  }
  if (need_mask) {
#pragma unroll
    for (int i = 0; i < N_SCORES; ++i) {
      const int key = key0 + (i / 4) * 8 + (i & 1), rp = row_pos[(i / 2) & 1];
      if (key > rp || (window > 0 && key <= rp - window)) s[i] = -INFINITY;
    }
  }
  // Four independent chains per row for the max and the sum: with few warps per scheduler a
  // long dependent chain of FMNMX / FADD stalls on latency.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx4[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < N_SCORES / 4; ++n) {
      mx4[2 * (n % 2)] = fmaxf(mx4[2 * (n % 2)], s[4 * n + 2 * r]);
      mx4[2 * (n % 2) + 1] = fmaxf(mx4[2 * (n % 2) + 1], s[4 * n + 2 * r + 1]);
    }
    float mx = fmaxf(fmaxf(mx4[0], mx4[1]), fmaxf(mx4[2], mx4[3]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    mx = fmaxf(m[r], mx * mul);  // mul > 0: the max of the scaled scores
    const float corr = Exp2Fast(m[r] - mx);
    m[r] = mx;
#pragma unroll
    for (int d = 0; d < N_OUT / 4; ++d) {
      o[4 * d + 2 * r] *= corr;
      o[4 * d + 2 * r + 1] *= corr;
    }
    float sum4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < N_SCORES / 4; ++n) {
      s[4 * n + 2 * r] = Exp2Fast(fmaf(s[4 * n + 2 * r], mul, -mx));
      s[4 * n + 2 * r + 1] = Exp2Fast(fmaf(s[4 * n + 2 * r + 1], mul, -mx));
      sum4[2 * (n % 2)] += s[4 * n + 2 * r];
      sum4[2 * (n % 2) + 1] += s[4 * n + 2 * r + 1];
    }
    l[r] = l[r] * corr + ((sum4[0] + sum4[1]) + (sum4[2] + sum4[3]));
  }
}

// Stores this thread's two rows of its warp's 16 output rows (row0 + gid and row0 + gid + 8)
// from flat m16n8 accumulators (element 4d + e: row gid + 8 (e / 2), column 8d + 2 tig + e % 2),
// divided by the row sums, each reduced over the quad first. Rows at or past live_end stay
// as the prologue left them.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void StoreWarpRows(const GqaParams<T>& p, const PrefillCta& c, int row0,
                                              const float (&o)[HEAD_DIM / 2], float (&l)[2]) {
  const int gid = (threadIdx.x % 32) / 4, tig = threadIdx.x % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    const int t = row0 + gid + 8 * r;
    if (t < c.live_end) {
      const float inv = 1.0f / l[r];
      T* out = p.out + ((c.q_row0 + t) * p.num_q_heads + c.qh) * HEAD_DIM;
#pragma unroll
      for (int d = 0; d < HEAD_DIM / 8; ++d) {
        *reinterpret_cast<uint32_t*>(out + d * 8 + tig * 2) =
            Pack2<T>(o[4 * d + 2 * r] * inv, o[4 * d + 2 * r + 1] * inv);
      }
    }
  }
}

}  // namespace prefill

// The wgmma kernel (bf16/f16, HEAD_DIM 64 or 128; sm_90a SASS, so compute capability 9.0 only)
// in its default configuration, and in any (cuda/gqa_prefill_wgmma.cu, WgmmaShape).
template <typename T, int HEAD_DIM>
cudaError_t LaunchGqaPrefillWgmma(const GqaParams<T>& p, cudaStream_t stream);
template <typename T, int HEAD_DIM, int WGS, int BLOCK_N, bool PINGPONG>
cudaError_t LaunchGqaPrefillWgmmaConfig(const GqaParams<T>& p, cudaStream_t stream);

}  // namespace jax_kv
