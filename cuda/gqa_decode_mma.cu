// GQA decode, mma: the simt kernel's one-launch split-K grid and per-warp cp.async rings
// (cuda/gqa_decode_split.cuh), with the tile math on tensor cores (mma.sync m16n8k16, f32
// accumulation). bf16 and f16 at head dims 64/80/96/128 (MmaDecodeTakes, cuda/gqa_decode.cuh):
// every such call runs it; f32 and head dim 256 run simt.
//
// Why (bench/NOTES.md, "Decode kernel 3", where simt is "kernel 2"): simt spends ~76 issued
// instructions per K/V row at group 4 (64 FFMA, 16 unpacks, q reads from shared memory,
// shuffles) against an issue budget of ~124 per row at 4.3 TB/s, and its large rows tracked its
// instruction count (3.1 TB/s at 98 per row in the kernel before it, 3.8 at 76). Here one warp
// tile is 16 rows; per tile and k-step of 16 head-dim columns, one ldmatrix of K and two mmas
// give every score of the CTA's query heads, and per 16 columns of V one transposed ldmatrix and
// one mma the P.V update: 17 issued instructions per row at D=128 whatever the group (SASS; most
// of them the copies' addresses).
//
// The mma shapes (M=16, N=8, K=16; q.k with the query heads as M):
//   S^T [g, rows]  = q [g, D] . K^T [D, rows]    A = q (rows g >= 8 zero), B = K via ldmatrix
//   O^T [D, g]    += V^T [D, rows] . P^T [rows, g]  A = V via ldmatrix.trans, B = P
// S^T's accumulator layout (lane holds query head lane / 4, rows 2 (lane % 4) + {0, 1} of each
// 8-row half) is exactly the B fragment of P^T, so P never leaves registers: no shared memory,
// no shuffles between the two products. P is rounded to the input type for the second mma (as
// FlashAttention does); its row sums stay f32. Scores are scaled in f32 after the product, so q
// enters the mma as given.
#include <algorithm>
#include <atomic>
#include <type_traits>

#include "cuda/cp_async.cuh"
#include "cuda/gqa_decode_split.cuh"
#include "cuda/head_dims.h"
#include "cuda/mma.cuh"

namespace jax_kv {

namespace {

using namespace split_decode;

constexpr int kTileRows = 16;  // K/V rows of one warp tile: N of two q.k mmas, K of one P.V mma
constexpr int kStages = 3;     // ring depth: two tiles in flight while the third is computed
constexpr int kNarrowWarps = 4;
constexpr int kWideWarps = 8;  // one wide CTA per SM at D=128: 8 x 3 x 8 KB of rings

// A tile row is kUnits 16-byte units. Rows of a multiple of 8 units are XOR-swizzled (unit u of
// row r stored at u ^ (r & 7)), others padded to an odd stride: either way the 8 row addresses
// of one ldmatrix matrix fall in 8 distinct 16-byte bank groups.
template <typename T, int HEAD_DIM, int WARPS>
struct MmaShape {
  static_assert(sizeof(T) == 2, "tensor-core decode takes bf16 or f16");
  static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 128, "head dim: whole k-steps, acc in registers");
  static constexpr int kThreads = 32 * WARPS;
  static constexpr int kUnits = HEAD_DIM / 8;
  static constexpr int kSteps = HEAD_DIM / 16;  // q.k k-steps = P.V m-tiles
  static constexpr bool kSwizzle = kUnits % 8 == 0;
  static constexpr int kStride = kSwizzle || kUnits % 2 == 1 ? kUnits : kUnits + 1;
  static constexpr int kTensorUnits = kTileRows * kStride;  // K (or V) of one stage
  static constexpr int kStageUnits = 2 * kTensorUnits;
  static constexpr int kCtaRows = kTileRows * WARPS;
  // cp.async: kLdLanes lanes per row (8 per 128-byte line, so each copy instruction asks for
  // whole lines), kLdRows rows per pass, kLdCols 16-byte units per lane and row.
  static constexpr int kLdLanes = kUnits >= 32 ? 32 : kUnits > 8 ? 16 : 8;
  static constexpr int kLdRows = 32 / kLdLanes;
  static constexpr int kLdPasses = kTileRows / kLdRows;
  static constexpr int kLdCols = (kUnits + kLdLanes - 1) / kLdLanes;
  // Swizzle terms (row & 7) a lane meets over its passes: rows advance by kLdRows a pass.
  static constexpr int kLdPatterns = kSwizzle ? 8 / kLdRows : 1;
  static constexpr int kRingBytes = WARPS * kStages * kStageUnits * 16;
  // The ring is reused for the warps' merge and the combine weights once the loop is done.
  static constexpr int kMergeBytes = WARPS * kMaxGroup * HEAD_DIM * 4;
  static constexpr int kWeightBytes = kMaxGroup * kMaxSplits * 4;
  static constexpr int kSmemBytes = std::max({kRingBytes, kMergeBytes, kWeightBytes});
  // Resident CTAs the register cap is set for: what shared memory allows (1 KB reserved per CTA
  // plus ~0.6 KB of static shared memory), 1 to 4.
  static constexpr int kMinBlocks = std::clamp((227 * 1024) / (kSmemBytes + 2048), 1, 4);
  __host__ __device__ static constexpr int Unit(int row, int u) {
    return row * kStride + (kSwizzle ? (u ^ (row & 7)) : u);
  }
};

// The fewest rows a split covers. Narrow grids have a (b, KV head) per SM already: 4 CTA tiles.
// Wide: kWideMinSplitBytes of K+V, so a short context is one split with no merge.
template <typename T, int HEAD_DIM, int WARPS>
constexpr int MmaMinChunkRows() {
  using Sh = MmaShape<T, HEAD_DIM, WARPS>;
  if (WARPS == kNarrowWarps) return 4 * Sh::kCtaRows;
  const int tiles = (kWideMinSplitBytes / (2 * HEAD_DIM * 2) + Sh::kCtaRows - 1) / Sh::kCtaRows;
  return (tiles > 1 ? tiles : 1) * Sh::kCtaRows;
}

template <typename T, int HEAD_DIM, int WARPS>
__global__ void __launch_bounds__(32 * WARPS, (MmaShape<T, HEAD_DIM, WARPS>::kMinBlocks))
    GqaDecodeMmaKernel(const GqaParams<T> p, int num_splits, int head_chunks, int min_chunk,
                       int counter_region) {
  using Sh = MmaShape<T, HEAD_DIM, WARPS>;
  constexpr int G = kMaxGroup;
  constexpr int kSteps = Sh::kSteps;
  static_assert(Sh::kSmemBytes <= 227 * 1024, "an SM's opt-in limit");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __shared__ float sm_m[WARPS][G], sm_l[WARPS][G];

  DecodeCta c;
  if (!BeginDecodeCta<T, HEAD_DIM, G, Sh::kThreads>(p, num_splits, head_chunks, Sh::kCtaRows,
                                                    min_chunk, c)) {
    return;
  }
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int quad = lane / 4, ql = lane % 4;  // fragment row (a query head) and column pair

  const int first = c.c0 + warp * kTileRows;  // warps interleave over the chunk's tiles
  const int num_tiles = first < c.c1 ? (c.c1 - first + Sh::kCtaRows - 1) / Sh::kCtaRows : 0;
  const int64_t head_off = kv_offset(p.cache, c.b, 0, c.hkv);
  const T* k_head = p.k_cache + head_off;
  const T* v_head = p.v_cache + head_off;
  const int lim = min(c.c1, c.L);  // rows from here on are zero-filled (row L: patched below)

  // cp.async: the lane copies tile rows ld_row + kLdRows i into stored units ld_u + kLdLanes j.
  // Under the swizzle the stored unit s of row r holds row unit s ^ (r & 7): the XOR goes to the
  // global side (it stays inside one 128-byte line, so the 8 lanes of a line still ask for all
  // of it) and every shared target is a constant away from the lane's first. r & 7 repeats
  // every kLdPatterns passes: those element offsets are computed once here.
  const int ld_row = lane / Sh::kLdLanes, ld_u = lane % Sh::kLdLanes;
  int ld_elem[Sh::kLdPatterns][Sh::kLdCols];
#pragma unroll
  for (int q = 0; q < Sh::kLdPatterns; ++q) {
#pragma unroll
    for (int j = 0; j < Sh::kLdCols; ++j) {
      const int sw = Sh::kSwizzle ? (ld_row + q * Sh::kLdRows) & 7 : 0;
      ld_elem[q][j] = ((ld_u + j * Sh::kLdLanes) ^ sw) * 8;
    }
  }
  const uint32_t ring0 = SmemAddr(smem_raw);
  const uint32_t ring = ring0 + warp * kStages * Sh::kStageUnits * 16;
  const uint32_t ld_lane = ring + (ld_row * Sh::kStride + ld_u) * 16;
  int issue_left = num_tiles, issue_row = first + ld_row;
  uint32_t issue_slot = 0;
  auto issue = [&]() {
    if (issue_left > 0) {
#pragma unroll
      for (int i = 0; i < Sh::kLdPasses; ++i) {
        const int row = issue_row + Sh::kLdRows * i;
        const bool ok = row < lim;
        // Rows past L keep the address of row L (never read: zero-fill), so no copy ever names
        // a position outside [0, S).
        const int64_t off = static_cast<int64_t>(min(row, c.L)) * p.cache.s;
#pragma unroll
        for (int j = 0; j < Sh::kLdCols; ++j) {
          if (Sh::kUnits % Sh::kLdLanes == 0 || ld_u + j * Sh::kLdLanes < Sh::kUnits) {
            const uint32_t dst =
                ld_lane + issue_slot + (Sh::kLdRows * i * Sh::kStride + Sh::kLdLanes * j) * 16;
            const int e = ld_elem[i % Sh::kLdPatterns][j];
            CpAsync16(dst, k_head + off + e, ok);
            CpAsync16(dst + Sh::kTensorUnits * 16, v_head + off + e, ok);
          }
        }
      }
      issue_row += Sh::kCtaRows;
      issue_slot += Sh::kStageUnits * 16;
      if (issue_slot == kStages * Sh::kStageUnits * 16) issue_slot = 0;
      --issue_left;
    }
    CpAsyncCommit();
  };
#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) issue();

  // q as the A operand of S^T: lane holds head `quad`, columns 16 kk + 2 ql + {0, 1} and + 8;
  // rows 8..15 of A (a1, a3) are zero, as are heads past ng.
  uint32_t qa[kSteps][2];
  {
    const bool has = quad < c.ng;
    const T* qg =
        p.q + (static_cast<int64_t>(c.b) * p.num_q_heads + c.qh0 + (has ? quad : 0)) * HEAD_DIM;
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) {
      qa[kk][0] = has ? __ldg(reinterpret_cast<const uint32_t*>(qg + 16 * kk + 2 * ql)) : 0u;
      qa[kk][1] = has ? __ldg(reinterpret_cast<const uint32_t*>(qg + 16 * kk + 8 + 2 * ql)) : 0u;
    }
  }
  // Scores in log2 units: s * scale * log2 e, or with softcap, softcap * log2 e * tanh(s *
  // scale / softcap).
  const bool use_softcap = p.softcap > 0.0f;
  const float s_mul = use_softcap ? p.scale / p.softcap : p.scale * kLog2e;
  const float cap_log2 = p.softcap * kLog2e;

  // ldmatrix: matrix i = lane / 8 of an x4 is tile rows (i / 2) * 8 + lane % 8, unit 2 x + i % 2
  // (x: the k-step for K, the m-tile for V). Offsets of x = 0..3; x + 4 adds 8 units (128 B).
  const int lm_row = (lane / 16) * 8 + lane % 8, lm_u = (lane / 8) % 2;
  uint32_t lm_off[4];
#pragma unroll
  for (int x = 0; x < 4; ++x) lm_off[x] = Sh::Unit(lm_row, 2 * x + lm_u) * 16;

  float m_run = kMaxSentinel, l_run = 0.0f;  // query head `quad`, same in its 4 lanes
  float acc[kSteps][4];  // O^T: d = 16 mt + quad (+ 8 for [2], [3]), head 2 ql (+ 1 for [1], [3])
#pragma unroll
  for (int mt = 0; mt < kSteps; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.0f;

  auto attend = [&](auto softcap_tag) {
    constexpr bool SOFTCAP = decltype(softcap_tag)::value;
    uint32_t slot = 0;
    int base = first;
    for (int t = 0; t < num_tiles; ++t, base += Sh::kCtaRows) {
      issue();
      CpAsyncWait<kStages - 1>();
      __syncwarp();  // every lane's copies of tile t are visible to the whole warp
      const uint32_t kt = ring + slot;
      const uint32_t vt = kt + Sh::kTensorUnits * 16;
      const int row_l = c.L - base;
      if (row_l >= 0 && row_l < kTileRows) {  // warp-uniform: once, in the split that holds L
        PatchNewRow<Sh>(p.k_new + c.new_off, p.v_new + c.new_off,
                        reinterpret_cast<uint4*>(smem_raw + (kt - ring0)), row_l, lane);
      }
      slot += Sh::kStageUnits * 16;
      if (slot == kStages * Sh::kStageUnits * 16) slot = 0;

      float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
      for (int kk = 0; kk < kSteps; ++kk) {
        uint32_t kb[4];  // rows 0-7 | units 2kk, 2kk+1; rows 8-15 | the same
        LdMatrixX4(kb, kt + lm_off[kk % 4] + 128 * (kk / 4));
        const uint32_t a[4] = {qa[kk][0], 0u, qa[kk][1], 0u};
        Mma16816<T>(s[0], a, kb[0], kb[1]);
        Mma16816<T>(s[1], a, kb[2], kb[3]);
      }
      // s[h][j]: head quad, tile row 8 h + 2 ql + j ([2], [3]: the zero rows of A, unused).
      float x[2][2], mx = -INFINITY;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          float v = s[h][j] * s_mul;
          if constexpr (SOFTCAP) v = cap_log2 * TanhBranchless(v);
          x[h][j] = base + 8 * h + 2 * ql + j < c.c1 ? v : -INFINITY;
          mx = fmaxf(mx, x[h][j]);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run, mx);
      const float corr = Exp2Fast(m_run - m_new);
      m_run = m_new;
      float pr[2][2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int j = 0; j < 2; ++j) pr[h][j] = Exp2Fast(x[h][j] - m_new);  // -inf -> 0
      }
      l_run = l_run * corr + ((pr[0][0] + pr[0][1]) + (pr[1][0] + pr[1][1]));
      // acc's heads are 2 ql + {0, 1}; their corrections sit in lanes 4 (2 ql + j).
      const float corr0 = __shfl_sync(0xffffffffu, corr, 8 * ql);
      const float corr1 = __shfl_sync(0xffffffffu, corr, 8 * ql + 4);
      if (!__all_sync(0xffffffffu, corr0 == 1.0f && corr1 == 1.0f)) {
#pragma unroll
        for (int mt = 0; mt < kSteps; ++mt) {
          acc[mt][0] *= corr0;
          acc[mt][1] *= corr1;
          acc[mt][2] *= corr0;
          acc[mt][3] *= corr1;
        }
      }
      // P^T's B fragment: rows 2 ql + {0, 1} and + 8, head quad: the accumulators just made.
      const uint32_t pb0 = Pack2<T>(pr[0][0], pr[0][1]);
      const uint32_t pb1 = Pack2<T>(pr[1][0], pr[1][1]);
#pragma unroll
      for (int mt = 0; mt < kSteps; ++mt) {
        uint32_t va[4];  // V^T [16 mt.., rows]: d 0-7 | rows 0-7, d 8-15 | rows 0-7, then 8-15
        LdMatrixX4Trans(va, vt + lm_off[mt % 4] + 128 * (mt / 4));
        Mma16816<T>(acc[mt], va, pb0, pb1);
      }
      __syncwarp();  // tile t's slot is refilled by the next iteration's issue
    }
  };
  if (use_softcap) {
    attend(std::true_type{});
  } else {
    attend(std::false_type{});
  }
  CpAsyncWait<0>();
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);

  // The warps' partials through shared memory (the ring is free once every warp is done).
  __syncthreads();
  float* sm_acc = reinterpret_cast<float*>(smem_raw);  // [WARPS][G][HEAD_DIM]
#pragma unroll
  for (int mt = 0; mt < kSteps; ++mt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int g = 2 * ql + (e & 1), d = 16 * mt + quad + 8 * (e >> 1);
      sm_acc[(warp * G + g) * HEAD_DIM + d] = acc[mt][e];
    }
  }
  if (ql == 0) {
    sm_m[warp][quad] = m_run;
    sm_l[warp][quad] = l_run;
  }
  __syncthreads();
  EndDecodeCta<T, HEAD_DIM, G, WARPS>(p, c, num_splits, counter_region, sm_m, sm_l, smem_raw);
}

template <typename T, int HEAD_DIM, int WARPS>
GqaDecodePlan PlanFor(int64_t ctas, int fixed_splits) {
  using Sh = MmaShape<T, HEAD_DIM, WARPS>;
  return GqaDecodePlan{SplitsForCtas(ctas, CtasPerSm(Sh::kSmemBytes, Sh::kMinBlocks), fixed_splits),
                       Sh::kCtaRows, MmaMinChunkRows<T, HEAD_DIM, WARPS>()};
}

template <typename T, int HEAD_DIM, int WARPS>
cudaError_t LaunchInstance(const GqaParams<T>& p, int chunks, const DecodeOptions& o,
                           cudaStream_t stream) {
  using Sh = MmaShape<T, HEAD_DIM, WARPS>;
  const int64_t ctas = static_cast<int64_t>(p.batch) * p.num_kv_heads * chunks;
  return LaunchSplitDecode<GqaDecodeMmaKernel<T, HEAD_DIM, WARPS>>(
      p, chunks, Sh::kThreads, Sh::kSmemBytes, PlanFor<T, HEAD_DIM, WARPS>(ctas, o.splits),
      o.counters, stream);
}

}  // namespace

template <typename T, int HEAD_DIM>
cudaError_t LaunchGqaDecodeMma(const GqaParams<T>& p, const DecodeOptions& o, cudaStream_t stream) {
  if constexpr (MmaDecodeTakes(HEAD_DIM, sizeof(T))) {
    const int chunks = DecodeHeadChunks(p.num_q_heads / p.num_kv_heads);
    const int64_t ctas = static_cast<int64_t>(p.batch) * p.num_kv_heads * chunks;
    return UseWide(ctas, o.ctas) ? LaunchInstance<T, HEAD_DIM, kWideWarps>(p, chunks, o, stream)
                                 : LaunchInstance<T, HEAD_DIM, kNarrowWarps>(p, chunks, o, stream);
  } else {
    return cudaErrorInvalidValue;  // LaunchGqaDecode never calls it here (MmaDecodeTakes)
  }
}

template <typename T, int HEAD_DIM>
GqaDecodePlan GqaDecodeMmaPlan(int batch, int num_q_heads, int num_kv_heads,
                               const DecodeOptions& o) {
  if constexpr (MmaDecodeTakes(HEAD_DIM, sizeof(T))) {
    const int group = num_q_heads / std::max(1, num_kv_heads);
    const int64_t ctas = static_cast<int64_t>(batch) * num_kv_heads * DecodeHeadChunks(group);
    return UseWide(ctas, o.ctas) ? PlanFor<T, HEAD_DIM, kWideWarps>(ctas, o.splits)
                                 : PlanFor<T, HEAD_DIM, kNarrowWarps>(ctas, o.splits);
  } else {
    return GqaDecodePlan{0, 0, 0};  // PlanGqaDecode never calls it here (MmaDecodeTakes)
  }
}

#define JKV_DECODE_MMA_INSTANTIATE(D, T)                                                   \
  template cudaError_t LaunchGqaDecodeMma<T, D>(const GqaParams<T>&, const DecodeOptions&, \
                                                cudaStream_t);                             \
  template GqaDecodePlan GqaDecodeMmaPlan<T, D>(int, int, int, const DecodeOptions&);
JKV_FOR_EACH_HEAD_DIM(JKV_DECODE_MMA_INSTANTIATE, bf16_t)
JKV_FOR_EACH_HEAD_DIM(JKV_DECODE_MMA_INSTANTIATE, f16_t)
#undef JKV_DECODE_MMA_INSTANTIATE

}  // namespace jax_kv
