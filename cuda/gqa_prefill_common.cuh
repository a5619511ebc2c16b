// What the prefill kernels share: the per-sequence status, NaN rows for a bad sequence, zero
// rows past new_lengths[b] and the fused append of the new K/V (PrefillPrologue), plus the
// Hopper kernel's launcher (cuda/gqa_prefill_wgmma.cu).
#pragma once

#include <cuda_runtime.h>

#include "cuda/gqa_params.h"
#include "cuda/kernel_common.cuh"
#include "cuda/mma.cuh"

namespace jax_kv {
namespace prefill {

__device__ __forceinline__ int32_t PrefillStatus(int L, int n_new, int T, int S) {
  if (n_new < 0 || n_new > T) return JKV_STATUS_NEW_LENGTH_OUT_OF_RANGE;
  if (L < 0 || static_cast<int64_t>(L) + n_new > S) return JKV_STATUS_LENGTH_OUT_OF_RANGE;
  return JKV_STATUS_OK;
}

template <typename T>
__device__ __forceinline__ T NanOf() {
  return from_f32<T>(__int_as_float(0x7fc00000));
}

// Status, NaN rows for a bad b, zero rows past new_lengths[b] and the fused append: the part
// both prefill kernels share. Returns the live row range [t0, t1) this CTA must compute, or
// t0 >= t1 when it has nothing left to do.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ int2 PrefillPrologue(const GqaParams<T>& p, int b, int qh, int t0,
                                                int t_end, bool status_writer, int L, int n_new) {
  const int T_ = p.num_tokens;
  const int code = PrefillStatus(L, n_new, T_, p.capacity);
  if (status_writer && threadIdx.x == 0) p.status[b] = code;
  constexpr int V = VecOf<T>::kElems, NV = HEAD_DIM / V;
  auto out_row = [&](int t) {
    return p.out + ((static_cast<int64_t>(b) * T_ + t) * p.num_q_heads + qh) * HEAD_DIM;
  };
  if (code != JKV_STATUS_OK) {
    for (int i = threadIdx.x; i < (t_end - t0) * HEAD_DIM; i += blockDim.x) {
      out_row(t0 + i / HEAD_DIM)[i % HEAD_DIM] = NanOf<T>();
    }
    return make_int2(0, 0);
  }
  const int live_end = min(t_end, n_new);
  for (int i = threadIdx.x; i < (t_end - max(t0, live_end)) * NV; i += blockDim.x) {
    const int t = max(t0, live_end) + i / NV;
    stg16(out_row(t) + (i % NV) * V, make_uint4(0, 0, 0, 0));
  }
  if (t0 >= live_end) return make_int2(0, 0);
  const int group = p.num_q_heads / p.num_kv_heads;
  if (qh % group == 0) {
    const int hkv = qh / group;
    for (int i = threadIdx.x; i < (live_end - t0) * NV; i += blockDim.x) {
      const int t = t0 + i / NV, c = (i % NV) * V;
      const int64_t src =
          ((static_cast<int64_t>(b) * T_ + t) * p.num_kv_heads + hkv) * HEAD_DIM + c;
      const int64_t dst = kv_offset(p.cache, b, L + t, hkv) + c;
      stg16(p.k_cache + dst, ldg16(p.k_new + src));
      stg16(p.v_cache + dst, ldg16(p.v_new + src));
    }
  }
  return make_int2(t0, live_end);
}

// The sequence, query head and query block of this CTA (grid: query blocks of block_m rows in
// reverse order, so the late, long ones start first; Hq; B), past the shared prologue. False:
// the CTA has no live query row left to compute.
struct PrefillCta {
  int b, qh, hkv, L, m0, live_end;
  int64_t q_row0;  // b * T: the row of this sequence's token 0 in q, k_new, v_new and out
};

template <typename T, int HEAD_DIM>
__device__ __forceinline__ bool BeginPrefillCta(const GqaParams<T>& p, int block_m, PrefillCta& c) {
  const int T_ = p.num_tokens;
  c.qh = blockIdx.y;
  c.b = blockIdx.z;
  c.hkv = c.qh / (p.num_q_heads / p.num_kv_heads);
  c.L = p.lengths[c.b];
  c.m0 = (gridDim.x - 1 - blockIdx.x) * block_m;
  c.q_row0 = static_cast<int64_t>(c.b) * T_;
  const int n_new = p.new_lengths ? p.new_lengths[c.b] : T_;
  const int2 rows = PrefillPrologue<T, HEAD_DIM>(p, c.b, c.qh, c.m0, min(c.m0 + block_m, T_),
                                                 blockIdx.x == 0 && c.qh == 0, c.L, n_new);
  c.live_end = rows.y;
  return rows.x < rows.y;
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
template <typename T, int HEAD_DIM, int WGS, int BLOCK_N, bool PIPELINE>
cudaError_t LaunchGqaPrefillWgmmaConfig(const GqaParams<T>& p, cudaStream_t stream);

}  // namespace jax_kv
