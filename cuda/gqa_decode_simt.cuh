// GQA decode, simt (CUDA-core math): the kernel and its launch templates; one .cu per dtype
// instantiates them (cuda/gqa_decode_simt{,_bf16,_f16}.cu), so no nvcc job compiles all 120
// kernels. Split-K flash decoding fed by per-warp cp.async pipelines, the splits merged by the
// last CTA of each (b, KV head, head chunk). The contract is cuda/gqa_decode.cuh's; this kernel
// runs every call the mma kernel does not take (f32, head dim 256) and any call forced onto it.
//
// bench/NOTES.md measures it as "kernel 2" (against the split-K kernel with a combine kernel it
// replaced, since deleted); bf16, Hq=32, Hkv=8, D=128, H200:
// 1. Bytes in flight. Each warp streams its own 8-row K+V tiles (4 KB) through a 3-stage
//    cp.async ring in shared memory (LDGSTS.E.BYPASS.128): two tiles (8 KB) are in flight per
//    warp while it computes the third, 4 CTAs x 4 warps per SM -> ~128 KB in flight per SM.
//    Little's law wants ~26 KB at 4.3 TB/s and ~0.8 us.
// 2. Few shuffles per score. 4 lanes per K row (4 x 16-byte vectors each for D=128 bf16):
//    2 shuffle+add rounds per score. q lives in shared memory as pre-scaled f32 (a broadcast
//    LDS.128 per 4 FMAs) so 4 lanes per row costs no q registers. P.V reads V with 16 lanes per
//    row (8 columns each): no shuffles at all in P.V, acc is 8 floats per query head per lane.
//    The running max is reduced over the warp's 8 rows once per tile and acc is rescaled only
//    when it grew (a warp-uniform branch). ~76 issued instructions per K/V row at group 4
//    (bench/sass_loop.py); the mma kernel's tensor-core loop issues ~20.
// 3. One launch. The last CTA of each (b, KV head, head chunk) to finish (an atomic counter)
//    merges the splits: no combine kernel, no grid-wide drain. The counters must be zero at
//    launch. The workspace cannot keep them so between calls (an XLA result buffer: buffer
//    assignment reuses that memory for other ops), so they live in a per-device pool in device
//    memory whose words the last CTA resets (split_decode::TakeCounterRegion); calls too large
//    for it (or that ask for it: SplitCounters::kWorkspace) use workspace words zeroed by a
//    one-CTA kernel node first.
// Registers: capped at 128 per thread (__launch_bounds__(128, 4)); shared memory ~53 KB per
// CTA at bf16 D=128 group 8, so 4 CTAs fit an SM's 228 KB.
#pragma once

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "cuda/cp_async.cuh"
#include "cuda/gqa_decode_split.cuh"

namespace jax_kv {

namespace {

using namespace split_decode;

// Two CTA shapes. Narrow: 4 warps, up to 4 CTAs per SM, for grids with at least one
// (b, KV head) per SM. Wide: one CTA per SM with 16 warps (8 at group 8, whose ~150 registers
// per thread would not fit 16), for B * Hkv under the SM count: the same warps per SM in 4x
// fewer splits, so the last CTA merges 4x fewer partials and a short chunk is spread over 16
// warps instead of run by 4 (bench/NOTES.md, "kernel 2, wide CTAs").
constexpr int kNarrowWarps = 4;
template <int GROUP>
constexpr int WideWarps() {
  return GROUP >= 8 ? 8 : 16;
}

// Resident CTAs per SM the register cap is set for. Narrow: 8 query heads need ~150 registers
// (acc alone is 32), so their cap is 168 (3 CTAs) rather than 128 with spills. Wide: one.
template <int GROUP, int WARPS>
constexpr int MinBlocks() {
  return WARPS > kNarrowWarps ? 1 : GROUP >= 8 ? 3 : kMaxCtasPerSm;
}

constexpr int kStageBytes = 4096;  // K+V bytes of one warp's pipeline stage (target)

// Lanes that share one K row in q.k: enough rows per warp tile that a stage holds ~kStageBytes,
// and a divisor of the row's 16-byte units so every lane holds whole vectors.
constexpr int RowLanes(int units, int row_bytes) {
  int r = Pow2Ceil((32 * 2 * row_bytes + kStageBytes - 1) / kStageBytes);
  if (r > 32) r = 32;
  while (r > 1 && units % r != 0) r /= 2;
  return r;
}

// How a warp covers its tiles. q.k: kR lanes per K row (kUnitsPerLane 16-byte vectors each),
// kRows rows per tile. P.V: kVLanes lanes per V row, each reading kVpt pieces of kVBytes (a
// whole warp per row where the row splits into 4/8/16-byte pieces: acc stays small).
// Shared-memory rows are kStride 16-byte units; when a row is a multiple of 8 units, unit u of
// row r sits at u ^ ((r * kR) & 7) (XOR swizzle) so the kR-lane groups of one q.k load hit 8
// distinct 16-byte bank groups; otherwise the stride is padded to make units/kR odd.
template <typename T, int HEAD_DIM, int WARPS>
struct SimtShape {
  static constexpr int kWarps = WARPS;
  static constexpr int kThreads = 32 * WARPS;
  static constexpr int kVec = VecOf<T>::kElems;
  static constexpr int kUnits = HEAD_DIM / kVec;
  static constexpr int kR = RowLanes(kUnits, HEAD_DIM* static_cast<int>(sizeof(T)));
  static constexpr int kRows = 32 / kR;
  static constexpr int kUnitsPerLane = kUnits / kR;
  static constexpr bool kSwizzle = kUnits % 8 == 0;
  static constexpr int kStride =
      kSwizzle || kR >= 8 || (kUnits / kR) % 2 == 1 ? kUnits : kUnits + kR;
  static constexpr int kTensorUnits = kRows * kStride;  // K (or V) of one stage
  static constexpr int kStageUnits = 2 * kTensorUnits;
  static constexpr int kStages = kStageUnits * 16 <= kStageBytes ? 3 : 2;
  static constexpr int kRowBytes = HEAD_DIM * static_cast<int>(sizeof(T));
  static constexpr bool kWarpPerVRow =
      kRowBytes == 128 || kRowBytes == 256 || kRowBytes == 512 || kRowBytes == 1024;
  static constexpr int kVBytes = kWarpPerVRow ? (kRowBytes >= 512 ? 16 : kRowBytes / 32) : 16;
  static constexpr int kVLanes = kWarpPerVRow ? 32 : Pow2Ceil(kUnits);
  static constexpr int kVRows = 32 / kVLanes;
  static constexpr int kVpt = kWarpPerVRow ? kRowBytes / (32 * kVBytes) : 1;
  static constexpr int kVElems = kVBytes / static_cast<int>(sizeof(T));  // per piece
  static constexpr int kAcc = kVpt * kVElems;
  static constexpr int kCtaRows = kRows * kWarps;
  // cp.async: kLdLanes lanes per row (lanes past kUnits idle), kLdRows rows per pass, kLdCols
  // vectors per lane and row; the lane's (row, unit) pattern is fixed, only the tile moves.
  static constexpr int kLdLanes = Pow2Ceil(kUnits) > 32 ? 32 : Pow2Ceil(kUnits);
  static constexpr int kLdRows = 32 / kLdLanes;
  static constexpr int kLdPasses = kRows / kLdRows;
  static constexpr int kLdCols = (kUnits + kLdLanes - 1) / kLdLanes;
  static constexpr int kStageAreaBytes = kWarps * kStages * kStageUnits * 16;
  static_assert(HEAD_DIM % kVec == 0, "a row must be whole 16-byte vectors");
  static_assert(kUnits % kR == 0, "every q.k lane holds whole vectors");
  static_assert(kVLanes >= kR && kRows % kVRows == 0, "P.V covers the tile's rows evenly");
  static_assert(kVLanes <= 32 && kVElems >= 1, "P.V pieces");
  static_assert(kLdPasses >= 1 && kRows % kLdRows == 0, "cp.async passes cover the tile");
  static_assert(!kSwizzle || kR >= 8 || (kLdRows * kR) % 8 == 0,
                "a lane's cp.async targets differ from its first one by constants");

  __device__ static __forceinline__ int Unit(int row, int u) {
    if constexpr (kSwizzle) {
      return row * kStride + (u ^ ((row * kR) & 7));
    } else {
      return row * kStride + u;
    }
  }
};

// The fewest rows a split covers. Narrow: 8 CTA tiles (256 rows at bf16 D=128). Measured on
// the H200 at (B=1, live 4096, Hkv=8): 23.9 us with a one-tile floor (65 splits of 64 rows),
// 26.4 us with 8 (16 splits: 128 CTAs, under one 4-warp CTA per SM, so no warp's latency is
// hidden); such grids now take the wide shape. Wide: kWideMinSplitBytes of K+V (whole tiles).
template <typename T, int HEAD_DIM, int WARPS>
constexpr int MinChunkRows() {
  using Sh = SimtShape<T, HEAD_DIM, WARPS>;
  if (WARPS == kNarrowWarps) return 8 * Sh::kCtaRows;
  const int tiles = (kWideMinSplitBytes / (2 * Sh::kRowBytes) + Sh::kCtaRows - 1) / Sh::kCtaRows;
  return (tiles > 1 ? tiles : 1) * Sh::kCtaRows;
}

template <typename T, int HEAD_DIM, int GROUP, int WARPS>
__host__ __device__ constexpr int SmemBytes() {
  using Sh = SimtShape<T, HEAD_DIM, WARPS>;
  // stages | q [GROUP][HEAD_DIM] f32 | p [kWarps][kRows][GROUP] f32
  return Sh::kStageAreaBytes + GROUP * HEAD_DIM * 4 + WARPS * Sh::kRows * GROUP * 4;
}

// One P.V piece (4, 8 or 16 bytes of shared memory) -> floats.
template <typename T, int BYTES>
__device__ __forceinline__ void LoadPiece(const void* smem, float (&f)[BYTES / sizeof(T)]) {
  constexpr int W = BYTES / 4;  // 32-bit words
  uint32_t w[W];
  if constexpr (W == 4) {
    const uint4 r = *reinterpret_cast<const uint4*>(smem);
    w[0] = r.x, w[1] = r.y, w[2] = r.z, w[3] = r.w;
  } else if constexpr (W == 2) {
    const uint2 r = *reinterpret_cast<const uint2*>(smem);
    w[0] = r.x, w[1] = r.y;
  } else {
    w[0] = *reinterpret_cast<const uint32_t*>(smem);
  }
  unpack_words<T>(w, f);
}

template <typename T, int HEAD_DIM, int GROUP, int WARPS>
__global__ void __launch_bounds__(32 * WARPS, MinBlocks<GROUP, WARPS>())
    GqaDecodeSimtKernel(const GqaParams<T> p, int num_splits, int head_chunks, int min_chunk,
                        int counter_region) {
  using Sh = SimtShape<T, HEAD_DIM, WARPS>;
  constexpr int kWarps = WARPS;
  constexpr int kThreads = Sh::kThreads;
  constexpr int V = Sh::kVec;
  constexpr int R = Sh::kR;
  static_assert(kWarps * GROUP * HEAD_DIM * 4 <= Sh::kStageAreaBytes, "merge fits the stages");
  static_assert(GROUP * kMaxSplits * 4 <= Sh::kStageAreaBytes, "combine weights fit the stages");
  static_assert(SmemBytes<T, HEAD_DIM, GROUP, WARPS>() <= 227 * 1024, "an SM's opt-in limit");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint4* stages = reinterpret_cast<uint4*>(smem_raw);
  float* q_s = reinterpret_cast<float*>(smem_raw + Sh::kStageAreaBytes);  // [GROUP][HEAD_DIM]
  float* p_s = q_s + GROUP * HEAD_DIM;                                    // [kWarps][kRows][G]
  __shared__ float sm_m[kWarps][GROUP], sm_l[kWarps][GROUP];

  DecodeCta cta;
  if (!BeginDecodeCta<T, HEAD_DIM, GROUP, kThreads>(p, num_splits, head_chunks, Sh::kCtaRows,
                                                    min_chunk, cta)) {
    return;
  }
  const int tid = threadIdx.x;
  const int b = cta.b, hkv = cta.hkv, L = cta.L, c0 = cta.c0, c1 = cta.c1;
  const T* k_new = p.k_new + cta.new_off;
  const T* v_new = p.v_new + cta.new_off;

  // Scores in log2 units: scale (and log2 e) folded into q, or with softcap q carries
  // scale / softcap and the score is softcap * log2(e) * tanh(q.k).
  const bool use_softcap = p.softcap > 0.0f;
  const float q_mul = use_softcap ? p.scale / p.softcap : p.scale * kLog2e;
  const float cap_log2 = p.softcap * kLog2e;
  {
    const T* qg = p.q + (static_cast<int64_t>(b) * p.num_q_heads + cta.qh0) * HEAD_DIM;
    for (int i = tid; i < GROUP * HEAD_DIM; i += kThreads) {
      q_s[i] = i < cta.ng * HEAD_DIM ? to_f32(qg[i]) * q_mul : 0.0f;
    }
  }

  const int warp = tid / 32, lane = tid % 32;
  const int r = lane / R, c = lane % R;                        // q.k: row, lane in row
  const int vr = lane / Sh::kVLanes, vc = lane % Sh::kVLanes;  // P.V: row, lane in row
  uint4* my_stages = stages + warp * Sh::kStages * Sh::kStageUnits;
  float* my_p = p_s + warp * Sh::kRows * GROUP;
  const float4* q4 = reinterpret_cast<const float4*>(q_s);
  // Warp w takes tiles c0 + (w + kWarps t) * kRows: the warps interleave, so a short chunk
  // still spreads over every warp.
  const int first = c0 + warp * Sh::kRows;
  const int num_tiles = first < c1 ? (c1 - first + Sh::kCtaRows - 1) / Sh::kCtaRows : 0;
  const int64_t head_off = kv_offset(p.cache, b, 0, hkv);
  const T* k_head = p.k_cache + head_off;
  const T* v_head = p.v_cache + head_off;

  // Issues the next tile's K and V rows into its ring slot; always commits a group (possibly
  // empty) so wait_group counts stay aligned with tiles. Rows from min(c1, L) on are
  // zero-filled: past the chunk they are masked, and row L (the new token: this launch appends
  // it to slot L) is patched from k/v once the copies land. Addresses move by one tile stride
  // per call; nothing 64-bit is recomputed per vector.
  const int lim = min(c1, L);
  const int ld_row = lane / Sh::kLdLanes, ld_u = lane % Sh::kLdLanes;
  const int64_t pass_step = static_cast<int64_t>(Sh::kLdRows) * p.cache.s;
  // Shared addresses: the lane's first K target; every other target is a constant away.
  const uint32_t smem_lane = SmemAddr(my_stages + Sh::Unit(ld_row, ld_u));
  int issue_left = num_tiles, issue_row = first + ld_row;
  uint32_t issue_slot = 0;  // byte offset of the slot the next tile goes to
  auto issue = [&]() {
    if (issue_left > 0) {
      const uint32_t dst = smem_lane + issue_slot;
      // Source rows stop advancing at the last live one (and start no later than L), so even
      // a zero-filled copy never names an address outside [0, S).
      const int64_t off = static_cast<int64_t>(min(issue_row, L)) * p.cache.s + ld_u * V;
      const T* kp = k_head + off;
      const T* vp = v_head + off;
#pragma unroll
      for (int i = 0; i < Sh::kLdPasses; ++i) {
        const bool row_ok = issue_row + i * Sh::kLdRows < lim;
#pragma unroll
        for (int j = 0; j < Sh::kLdCols; ++j) {
          if (Sh::kUnits % Sh::kLdLanes == 0 || ld_u + j * Sh::kLdLanes < Sh::kUnits) {
            const uint32_t so = dst + (i * Sh::kLdRows * Sh::kStride + j * Sh::kLdLanes) * 16;
            const int e = j * Sh::kLdLanes * V;
            CpAsync16(so, kp + e, row_ok);
            CpAsync16(so + Sh::kTensorUnits * 16, vp + e, row_ok);
          }
        }
        if (i + 1 < Sh::kLdPasses) {
          const int64_t step = issue_row + (i + 1) * Sh::kLdRows < lim ? pass_step : 0;
          kp += step;
          vp += step;
        }
      }
      issue_row += Sh::kCtaRows;
      issue_slot += Sh::kStageUnits * 16;
      if (issue_slot == Sh::kStages * Sh::kStageUnits * 16) issue_slot = 0;
      --issue_left;
    }
    CpAsyncCommit();
  };

  float m[GROUP], l[GROUP], acc[GROUP][Sh::kAcc];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    m[g] = kMaxSentinel;
    l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < Sh::kAcc; ++e) acc[g][e] = 0.0f;
  }

#pragma unroll
  for (int t = 0; t < Sh::kStages - 1; ++t) issue();
  __syncthreads();  // q_s

  // The softcap choice is made once, outside the loop: the loop is compiled twice.
  auto attend = [&](auto softcap_tag) {
    constexpr bool SOFTCAP = decltype(softcap_tag)::value;
    int slot = 0, base = first;
    for (int t = 0; t < num_tiles; ++t, base += Sh::kCtaRows) {
      issue();
      CpAsyncWait<Sh::kStages - 1>();
      __syncwarp();  // every lane's copies of tile t are visible to the whole warp
      uint4* const kt = my_stages + slot * Sh::kStageUnits;
      const uint4* vt = kt + Sh::kTensorUnits;
      slot = slot + 1 == Sh::kStages ? 0 : slot + 1;
      const int row_l = L - base;
      if (row_l >= 0 && row_l < Sh::kRows) {  // warp-uniform: once, in the split that holds L
        PatchNewRow<Sh>(k_new, v_new, kt, row_l, lane);
      }

      float s[GROUP];
#pragma unroll
      for (int g = 0; g < GROUP; ++g) s[g] = 0.0f;
#pragma unroll
      for (int i = 0; i < Sh::kUnitsPerLane; ++i) {
        const int j = c + i * R;
        float kf[V];
        unpack_vec<T>(kt[Sh::Unit(r, j)], kf);
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
#pragma unroll
          for (int h = 0; h < V / 4; ++h) {
            const float4 qv = q4[(g * HEAD_DIM + j * V) / 4 + h];
            s[g] = fmaf(qv.x, kf[4 * h], s[g]);
            s[g] = fmaf(qv.y, kf[4 * h + 1], s[g]);
            s[g] = fmaf(qv.z, kf[4 * h + 2], s[g]);
            s[g] = fmaf(qv.w, kf[4 * h + 3], s[g]);
          }
        }
      }
      const bool valid = base + r < c1;
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
#pragma unroll
        for (int off = R / 2; off >= 1; off >>= 1) {
          s[g] += __shfl_xor_sync(0xffffffffu, s[g], off);
        }
        float x = s[g];
        if constexpr (SOFTCAP) x = cap_log2 * TanhBranchless(x);
        x = valid ? x : -INFINITY;
        float mx = x;
#pragma unroll
        for (int off = R; off < 32; off <<= 1)
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        if (mx > m[g]) {  // warp-uniform: mx is the max over all the warp's rows
          const float corr = Exp2Fast(m[g] - mx);
          m[g] = mx;
          l[g] *= corr;
#pragma unroll
          for (int e = 0; e < Sh::kAcc; ++e) acc[g][e] *= corr;
        }
        s[g] = Exp2Fast(x - m[g]);  // -inf (row past the chunk) -> 0
        l[g] += s[g];               // every lane of row r adds it: divided by R at the end
      }
      if (c == 0) {
        if constexpr (GROUP % 4 == 0) {
#pragma unroll
          for (int g = 0; g < GROUP; g += 4) {
            *reinterpret_cast<float4*>(my_p + r * GROUP + g) =
                make_float4(s[g], s[g + 1], s[g + 2], s[g + 3]);
          }
        } else {
#pragma unroll
          for (int g = 0; g < GROUP; ++g) my_p[r * GROUP + g] = s[g];
        }
      }
      __syncwarp();

#pragma unroll
      for (int rr0 = 0; rr0 < Sh::kRows; rr0 += Sh::kVRows) {
        const int rr = rr0 + vr;
        float pg[GROUP];
        if constexpr (GROUP % 4 == 0) {
#pragma unroll
          for (int g = 0; g < GROUP; g += 4) {
            const float4 pv = *reinterpret_cast<const float4*>(my_p + rr * GROUP + g);
            pg[g] = pv.x;
            pg[g + 1] = pv.y;
            pg[g + 2] = pv.z;
            pg[g + 3] = pv.w;
          }
        } else {
#pragma unroll
          for (int g = 0; g < GROUP; ++g) pg[g] = my_p[rr * GROUP + g];
        }
#pragma unroll
        for (int v = 0; v < Sh::kVpt; ++v) {
          constexpr int VE = Sh::kVElems;
          const int piece = v * Sh::kVLanes + vc;
          if (Sh::kWarpPerVRow || piece < Sh::kUnits) {
            const int byte = piece * Sh::kVBytes;
            float vf[VE];
            LoadPiece<T, Sh::kVBytes>(
                reinterpret_cast<const char*>(vt + Sh::Unit(rr, byte / 16)) + byte % 16, vf);
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
#pragma unroll
              for (int e = 0; e < VE; ++e) {
                acc[g][v * VE + e] = fmaf(pg[g], vf[e], acc[g][v * VE + e]);
              }
            }
          }
        }
      }
      __syncwarp();  // tile t's slot and my_p are rewritten by the next iteration
    }
  };
  if (use_softcap) {
    attend(std::true_type{});
  } else {
    attend(std::false_type{});
  }
  CpAsyncWait<0>();

  // Within a warp m is uniform: merging its P.V row groups is a plain sum.
#pragma unroll
  for (int off = Sh::kVLanes; off < 32; off <<= 1) {
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
#pragma unroll
      for (int e = 0; e < Sh::kAcc; ++e) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], off);
    }
  }
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    l[g] = WarpReduce(l[g], [](float a, float o) { return a + o; }) * (1.0f / R);
  }

  // Merge the warps through shared memory (the stage ring is free once every warp is done).
  __syncthreads();
  float* sm_acc = reinterpret_cast<float*>(smem_raw);  // [kWarps][GROUP][HEAD_DIM]
  if (vr == 0) {
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
#pragma unroll
      for (int v = 0; v < Sh::kVpt; ++v) {
        constexpr int VE = Sh::kVElems;
        const int piece = v * Sh::kVLanes + vc;
        if (piece * VE < HEAD_DIM) {
#pragma unroll
          for (int e = 0; e < VE; ++e) {
            sm_acc[(warp * GROUP + g) * HEAD_DIM + piece * VE + e] = acc[g][v * VE + e];
          }
        }
      }
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      sm_m[warp][g] = m[g];
      sm_l[warp][g] = l[g];
    }
  }
  __syncthreads();
  EndDecodeCta<T, HEAD_DIM, GROUP, kWarps>(p, cta, num_splits, counter_region, sm_m, sm_l,
                                           smem_raw);
}

inline int GroupBucket(int group) { return group > kMaxGroup ? kMaxGroup : Pow2Ceil(group); }

// Split count and chunk granularity of one instantiation, without the workspace clamp.
template <typename T, int HEAD_DIM, int GROUP, int WARPS>
GqaDecodePlan PlanFor(int64_t ctas, int fixed_splits) {
  using Sh = SimtShape<T, HEAD_DIM, WARPS>;
  const int ctas_per_sm =
      CtasPerSm(SmemBytes<T, HEAD_DIM, GROUP, WARPS>(), MinBlocks<GROUP, WARPS>());
  return GqaDecodePlan{SplitsForCtas(ctas, ctas_per_sm, fixed_splits), Sh::kCtaRows,
                       MinChunkRows<T, HEAD_DIM, WARPS>()};
}

// Calls fn.template operator()<GROUP, WARPS>() for the group bucket and CTA shape of a grid of
// `ctas` (b, KV head, head chunk) CTAs: the one place the plan and the launch both choose. The
// group bucket is the group rounded up to a power of two, 8 for any larger group (head chunks).
template <typename Fn>
auto WithShape(int group, int64_t ctas, DecodeCtas shape, const Fn& fn) {
  const bool wide = UseWide(ctas, shape);
  switch (GroupBucket(group)) {
    case 1:
      return wide ? fn.template operator()<1, WideWarps<1>()>()
                  : fn.template operator()<1, kNarrowWarps>();
    case 2:
      return wide ? fn.template operator()<2, WideWarps<2>()>()
                  : fn.template operator()<2, kNarrowWarps>();
    case 4:
      return wide ? fn.template operator()<4, WideWarps<4>()>()
                  : fn.template operator()<4, kNarrowWarps>();
    default:  // 8: GroupBucket's largest
      return wide ? fn.template operator()<8, WideWarps<8>()>()
                  : fn.template operator()<8, kNarrowWarps>();
  }
}

template <typename T, int HEAD_DIM>
struct Launch {
  const GqaParams<T>& p;
  int chunks;
  const DecodeOptions& o;
  cudaStream_t stream;
  template <int GROUP, int WARPS>
  cudaError_t operator()() const {
    const int64_t ctas = static_cast<int64_t>(p.batch) * p.num_kv_heads * chunks;
    return LaunchSplitDecode<GqaDecodeSimtKernel<T, HEAD_DIM, GROUP, WARPS>>(
        p, chunks, 32 * WARPS, SmemBytes<T, HEAD_DIM, GROUP, WARPS>(),
        PlanFor<T, HEAD_DIM, GROUP, WARPS>(ctas, o.splits), o.counters, stream);
  }
};

template <typename T, int HEAD_DIM>
struct Plan {
  int64_t ctas;
  int fixed_splits;
  template <int GROUP, int WARPS>
  GqaDecodePlan operator()() const {
    return PlanFor<T, HEAD_DIM, GROUP, WARPS>(ctas, fixed_splits);
  }
};

}  // namespace

template <typename T, int HEAD_DIM>
cudaError_t LaunchGqaDecodeSimt(const GqaParams<T>& p, const DecodeOptions& o,
                                cudaStream_t stream) {
  const int group = p.num_q_heads / p.num_kv_heads;
  const int chunks = DecodeHeadChunks(group);
  const int64_t ctas = static_cast<int64_t>(p.batch) * p.num_kv_heads * chunks;
  return WithShape(group, ctas, o.ctas, Launch<T, HEAD_DIM>{p, chunks, o, stream});
}

template <typename T, int HEAD_DIM>
GqaDecodePlan GqaDecodeSimtPlan(int batch, int num_q_heads, int num_kv_heads,
                                const DecodeOptions& o) {
  const int group = num_q_heads / std::max(1, num_kv_heads);
  const int64_t n = static_cast<int64_t>(batch) * num_kv_heads * DecodeHeadChunks(group);
  return WithShape(group, n, o.ctas, Plan<T, HEAD_DIM>{n, o.splits});
}

// The explicit instantiations of one element type, for every supported head dim.
#define JKV_DECODE_SIMT_INSTANTIATE(D, T)                                                   \
  template cudaError_t LaunchGqaDecodeSimt<T, D>(const GqaParams<T>&, const DecodeOptions&, \
                                                 cudaStream_t);                             \
  template GqaDecodePlan GqaDecodeSimtPlan<T, D>(int, int, int, const DecodeOptions&);

}  // namespace jax_kv
