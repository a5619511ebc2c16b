// GQA prefill: tiled flash attention (mma.sync m16n8k16, f32 accumulation) over the cached
// past plus the T new tokens, with causal and window block skipping and the append fused in.
//
// Grid (ceil(T / 64), Hq, B), 4 warps, 16 query rows per warp; in the packed form (q [N, Hq, D],
// cu_seqlens) (ceil(N / 64) + B, Hq): one block per (sequence, query tile) that can hold work,
// found from cu_seqlens by the block itself (PackedBlockOf), the spare ones leaving at once.
// Keys at positions < L come from the cache, keys at positions >= L straight from
// k_new/v_new: no CTA reads a cache slot this launch writes, so the fused append (by the first
// query head of each group) races with nothing. K/V tiles stream through a 2-stage cp.async
// pipeline. f32 inputs take a plain one-warp-per-row path (no f32 tensor-core MMA worth
// having; it is the accuracy path).
#include <algorithm>
#include <atomic>
#include <type_traits>

#include "cuda/cp_async.cuh"
#include "cuda/device_info.h"
#include "cuda/gqa_prefill.cuh"
#include "cuda/gqa_prefill_common.cuh"
#include "cuda/head_dims.h"
#include "cuda/kernel_common.cuh"
#include "cuda/mma.cuh"

namespace jax_kv {
namespace {

constexpr int kBlockM = 64;
constexpr int kThreads = 128;

template <int HEAD_DIM>
struct PrefillShape {
  static constexpr int kBlockN = HEAD_DIM > 128 ? 32 : 64;  // keeps O + S under 255 registers
  // Row stride in elements: +16 bytes makes the 8 rows an ldmatrix reads hit distinct banks.
  static constexpr int kStride = HEAD_DIM + 8;
  static constexpr int kVecs = HEAD_DIM / 8;  // 16-byte vectors per row (bf16 / f16)
  static constexpr int kSmemBytes = (kBlockM + 4 * kBlockN) * kStride * 2;
  static constexpr int kNTiles = kBlockN / 8;
  static constexpr int kDTiles = HEAD_DIM / 8;
  static constexpr int kKSteps = HEAD_DIM / 16;
};

template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kThreads) GqaPrefillMmaKernel(const GqaParams<T> p) {
  using Sh = PrefillShape<HEAD_DIM>;
  constexpr int BN = Sh::kBlockN, ST = Sh::kStride, NV = Sh::kVecs;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sq = reinterpret_cast<T*>(smem_raw);  // [kBlockM][ST]
  T* sk = sq + kBlockM * ST;               // [2][BN][ST]
  T* sv = sk + 2 * BN * ST;                // [2][BN][ST]

  prefill::PrefillCta cta;
  if (!prefill::BeginPrefillCta<T, HEAD_DIM>(p, kBlockM, cta)) return;
  const int b = cta.b, qh = cta.qh, hkv = cta.hkv, L = cta.L, m0 = cta.m0;
  const int live_end = cta.live_end;
  const int64_t q_row0 = cta.q_row0;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int gid = lane / 4, tig = lane % 4;
  for (int i = tid; i < kBlockM * NV; i += kThreads) {
    const int r = i / NV, c = (i % NV) * 8, t = m0 + r;
    const bool pred = t < live_end;
    const T* src = pred ? p.q + ((q_row0 + t) * p.num_q_heads + qh) * HEAD_DIM + c : p.q;
    CpAsync16(sq + r * ST + c, src, pred);
  }
  const int p_lo = L + m0, p_hi = L + live_end - 1;  // positions of the first / last live row
  const int kv_lo = p.window > 0 ? max(0, p_lo + 1 - p.window) : 0;
  const int kv_hi = p_hi;  // inclusive: keys past the last live row are never needed
  const int nblocks = (kv_hi - kv_lo + BN) / BN;
  auto load_kv = [&](int j, int stage) {
    const int n0 = kv_lo + j * BN;
    for (int i = tid; i < BN * NV; i += kThreads) {
      const int r = i / NV, c = (i % NV) * 8, pos = n0 + r;
      const bool pred = pos <= kv_hi;
      const T* ks = p.k_new;
      const T* vs = p.v_new;
      if (pred && pos < L) {
        const int64_t off = kv_offset(p.cache, b, pos, hkv) + c;
        ks = p.k_cache + off;
        vs = p.v_cache + off;
      } else if (pred) {
        const int64_t off = ((q_row0 + pos - L) * p.num_kv_heads + hkv) * HEAD_DIM + c;
        ks = p.k_new + off;
        vs = p.v_new + off;
      }
      CpAsync16(sk + (stage * BN + r) * ST + c, ks, pred);
      CpAsync16(sv + (stage * BN + r) * ST + c, vs, pred);
    }
  };
  load_kv(0, 0);
  CpAsyncCommit();

  const prefill::ScoreScaling sc = prefill::MakeScoreScaling(p.scale, p.softcap);
  const int row_pos[2] = {L + m0 + warp * 16 + gid, L + m0 + warp * 16 + gid + 8};
  float o[Sh::kDTiles][4];
#pragma unroll
  for (int d = 0; d < Sh::kDTiles; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
  float m[2] = {kMaxSentinel, kMaxSentinel}, l[2] = {0.0f, 0.0f};

  for (int j = 0; j < nblocks; ++j) {
    if (j + 1 < nblocks) {
      load_kv(j + 1, (j + 1) & 1);
      CpAsyncCommit();
      CpAsyncWait<1>();
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();
    const T* ks = sk + (j & 1) * BN * ST;
    const T* vs = sv + (j & 1) * BN * ST;
    float s[Sh::kNTiles][4];
#pragma unroll
    for (int n = 0; n < Sh::kNTiles; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < Sh::kKSteps; ++kk) {
      uint32_t a[4];
      LdMatrixX4(
          a, sq + (warp * 16 + (lane % 8) + ((lane / 8) & 1) * 8) * ST + kk * 16 + (lane / 16) * 8);
#pragma unroll
      for (int np = 0; np < Sh::kNTiles / 2; ++np) {
        uint32_t kb[4];
        LdMatrixX4(
            kb, ks + (np * 16 + (lane / 16) * 8 + lane % 8) * ST + kk * 16 + ((lane / 8) & 1) * 8);
        Mma16816<T>(s[2 * np], a, kb[0], kb[1]);
        Mma16816<T>(s[2 * np + 1], a, kb[2], kb[3]);
      }
    }
    // Mask only the blocks that cross the diagonal, the window edge or the last key.
    const int n0 = kv_lo + j * BN;
    prefill::SoftmaxBlock(reinterpret_cast<float (&)[BN / 2]>(s),
                          reinterpret_cast<float (&)[HEAD_DIM / 2]>(o), m, l, sc,
                          n0 + BN - 1 > p_lo || (p.window > 0 && n0 < p_hi + 1 - p.window),
                          n0 + tig * 2, row_pos, p.window);
    // O += P V: the S accumulators of two adjacent n-tiles are exactly an A fragment.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const uint32_t a[4] = {Pack2<T>(s[2 * kk][0], s[2 * kk][1]),
                             Pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                             Pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             Pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < Sh::kDTiles / 2; ++dp) {
        uint32_t vb[4];
        LdMatrixX4Trans(
            vb, vs + (kk * 16 + ((lane / 8) & 1) * 8 + lane % 8) * ST + dp * 16 + (lane / 16) * 8);
        Mma16816<T>(o[2 * dp], a, vb[0], vb[1]);
        Mma16816<T>(o[2 * dp + 1], a, vb[2], vb[3]);
      }
    }
    __syncthreads();  // the next iteration's loads overwrite this stage
  }

  prefill::StoreWarpRows<T, HEAD_DIM>(p, cta, m0 + warp * 16,
                                      reinterpret_cast<const float (&)[HEAD_DIM / 2]>(o), l);
}

// One warp per query row: the f32 path (and the reference-style fallback). Its query blocks are
// single rows (prefill::PrefillGrid with block_m 1).
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(32) GqaPrefillRowKernel(const GqaParams<T> p) {
  constexpr int kPer = (HEAD_DIM + 31) / 32;
  const int qh = blockIdx.y, lane = threadIdx.x;
  int b = 0, t = 0;
  bool status_writer = false;
  if (!prefill::PrefillBlockOf(p, 1, b, t, status_writer)) return;
  int64_t q_row0 = 0;  // the row of sequence b's token 0 in q, k_new, v_new and out
  const int2 rows = prefill::PrefillPrologue<T, HEAD_DIM>(p, b, qh, t, 1, status_writer, q_row0);
  if (rows.x >= rows.y) return;
  const int L = p.lengths[b];
  const int group = p.num_q_heads / p.num_kv_heads, hkv = qh / group;
  const bool use_softcap = p.softcap > 0.0f;
  const float qk_mul = use_softcap ? p.scale / p.softcap : p.scale * kLog2e;
  const float cap_log2 = p.softcap * kLog2e;
  const T* qp = p.q + ((q_row0 + t) * p.num_q_heads + qh) * HEAD_DIM;
  float q[kPer], acc[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int d = lane + 32 * i;
    q[i] = d < HEAD_DIM ? to_f32(qp[d]) * qk_mul : 0.0f;
    acc[i] = 0.0f;
  }
  const int P = L + t;
  const int lo = p.window > 0 ? max(0, P + 1 - p.window) : 0;
  float m = kMaxSentinel, l = 0.0f;
  for (int pos = lo; pos <= P; ++pos) {
    const int64_t off = pos < L ? kv_offset(p.cache, b, pos, hkv)
                                : ((q_row0 + pos - L) * p.num_kv_heads + hkv) * HEAD_DIM;
    const T* kp = (pos < L ? p.k_cache : p.k_new) + off;
    const T* vp = (pos < L ? p.v_cache : p.v_new) + off;
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int d = lane + 32 * i;
      if (d < HEAD_DIM) dot = fmaf(q[i], to_f32(kp[d]), dot);
    }
#pragma unroll
    for (int off2 = 16; off2 >= 1; off2 >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off2);
    if (use_softcap) dot = cap_log2 * TanhBranchless(dot);
    const float mn = fmaxf(m, dot);
    const float corr = exp2f(m - mn), w = exp2f(dot - mn);
    l = l * corr + w;
    m = mn;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int d = lane + 32 * i;
      acc[i] = acc[i] * corr + (d < HEAD_DIM ? w * to_f32(vp[d]) : 0.0f);
    }
  }
  T* out = p.out + ((q_row0 + t) * p.num_q_heads + qh) * HEAD_DIM;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int d = lane + 32 * i;
    if (d < HEAD_DIM) out[d] = from_f32<T>(acc[i] / l);
  }
}

}  // namespace

bool PrefillUsesWgmma(PrefillKernel kernel, int head_dim, int itemsize) {
  return kernel == PrefillKernel::kAuto && WgmmaPrefillTakes(head_dim, itemsize) &&
         CurrentDeviceComputeCapability() == 90;
}

template <typename T, int HEAD_DIM>
cudaError_t LaunchGqaPrefill(const GqaParams<T>& p, cudaStream_t stream, PrefillKernel kernel) {
  if (p.batch <= 0 || p.num_q_heads <= 0) return cudaSuccess;
  if (p.batch > 65535 || p.num_q_heads > 65535) return cudaErrorInvalidConfiguration;
  if constexpr (WgmmaPrefillTakes(HEAD_DIM, sizeof(T))) {
    if (PrefillUsesWgmma(kernel, HEAD_DIM, sizeof(T))) {
      return LaunchGqaPrefillWgmma<T, HEAD_DIM>(p, stream);
    }
  }
  if constexpr (std::is_same_v<T, float>) {
    GqaPrefillRowKernel<T, HEAD_DIM><<<prefill::PrefillGrid(p, 1), 32, 0, stream>>>(p);
  } else {
    using Sh = PrefillShape<HEAD_DIM>;
    static std::atomic<uint64_t> configured{0};
    const cudaError_t allowed =
        AllowDynamicSmem(reinterpret_cast<const void*>(GqaPrefillMmaKernel<T, HEAD_DIM>),
                         Sh::kSmemBytes, configured);
    if (allowed != cudaSuccess) return allowed;
    const dim3 grid = prefill::PrefillGrid(p, kBlockM);
    GqaPrefillMmaKernel<T, HEAD_DIM><<<grid, kThreads, Sh::kSmemBytes, stream>>>(p);
  }
  return cudaGetLastError();
}

#define JKV_PREFILL_INSTANTIATE(D, T) \
  template cudaError_t LaunchGqaPrefill<T, D>(const GqaParams<T>&, cudaStream_t, PrefillKernel);
JKV_FOR_EACH_HEAD_DIM(JKV_PREFILL_INSTANTIATE, float)
JKV_FOR_EACH_HEAD_DIM(JKV_PREFILL_INSTANTIATE, bf16_t)
JKV_FOR_EACH_HEAD_DIM(JKV_PREFILL_INSTANTIATE, f16_t)
#undef JKV_PREFILL_INSTANTIATE

}  // namespace jax_kv
