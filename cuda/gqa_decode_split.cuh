// What the two decode kernels share (simt, cuda/gqa_decode_simt.cuh: CUDA-core math; mma,
// cuda/gqa_decode_mma.cu: tensor-core math): the split plan computed on the device from lengths,
// the CTA's start (status, NaN rows for a bad length, the fused append), its end (the warps'
// partials merged, the split stored, the last CTA of each (b, KV head, head chunk) merging the
// splits) and the host's grid choice. Only the tile loop differs.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "cuda/device_info.h"
#include "cuda/gqa_decode.cuh"
#include "cuda/kernel_common.cuh"

namespace jax_kv {
namespace split_decode {

constexpr int kMaxGroup = kDecodeMaxGroup;  // query heads per CTA
constexpr int kMaxSplits = kDecodeMaxSplits;
constexpr int kMaxCtasPerSm = 4;  // the most CTAs per SM any instantiation keeps resident
// Fewest K+V bytes a wide CTA's split covers: with a one-tile floor, Qwen2.5-0.5B at B=1 (~300
// live, Hkv=2) ran 3 splits and a merge, 7.5 us a layer, a chain of ~8 dependent global round
// trips (length, q, K/V, partials, fence, counter, partials again, out); a lone split skips the
// last five (bench/NOTES.md, "kernel 2, wide CTAs").
constexpr int kWideMinSplitBytes = 128 * 1024;

constexpr int Pow2Ceil(int x) {
  int p = 1;
  while (p < x) p <<= 1;
  return p;
}

struct SplitPlan {
  int lo, n, chunk, active;
};

// Chunks are whole CTA tiles (cta_rows rows), at least min_chunk rows; the combine recomputes
// nothing else, so the splits and the last CTA always agree.
__device__ __forceinline__ SplitPlan PlanSplits(int L, int window, int num_splits, int cta_rows,
                                                int min_chunk) {
  SplitPlan s;
  s.lo = window > 0 ? max(0, L + 1 - window) : 0;
  s.n = L + 1 - s.lo;
  const int chunk = (s.n + num_splits - 1) / num_splits;
  s.chunk = max(min_chunk, (chunk + cta_rows - 1) / cta_rows * cta_rows);
  s.active = (s.n + s.chunk - 1) / s.chunk;
  return s;
}

// One CTA of the grid (splits, Hkv * head chunks, B): its coordinates, its query heads and the
// positions [c0, c1) it attends over.
struct DecodeCta {
  int split, hkv, b, qh0, ng, L, c0, c1, active;
  int64_t new_off;  // element offset of this (b, KV head)'s new K/V row in k_new / v_new
};

// Starts a CTA: status for its b (from exactly one CTA per b, so status needs no memset), NaN
// rows for a bad length and zero rows for an idle b (row_idle; either way cache and counters
// untouched), the split plan, and the fused
// append of the new K/V at slot L (split 0 of head chunk 0; no CTA of this launch reads slot L
// from the cache: the owner reads k/v instead). Returns false when the CTA has nothing to do.
template <typename T, int HEAD_DIM, int GROUP, int THREADS>
__device__ __forceinline__ bool BeginDecodeCta(const GqaParams<T>& p, int num_splits,
                                               int head_chunks, int cta_rows, int min_chunk,
                                               DecodeCta& c) {
  const int tid = threadIdx.x;
  c.split = blockIdx.x;
  c.hkv = blockIdx.y / head_chunks;
  const int head_chunk = blockIdx.y % head_chunks;
  c.b = blockIdx.z;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int g0 = head_chunk * GROUP;
  c.ng = min(GROUP, group - g0);
  c.qh0 = c.hkv * group + g0;
  c.L = p.lengths[c.b];
  const bool idle = row_idle(p, c.b);
  const bool bad = !idle && (c.L < 0 || c.L >= writable_capacity(p, c.b));
  if (c.split == 0 && blockIdx.y == 0 && tid == 0) {
    p.status[c.b] = bad ? JKV_STATUS_LENGTH_OUT_OF_RANGE : JKV_STATUS_OK;
  }
  if (bad || idle) {  // out rows NaN (refused) or zero (idle); the cache is not touched
    if (c.split == 0) {
      T* out_rows = p.out + (static_cast<int64_t>(c.b) * p.num_q_heads + c.qh0) * HEAD_DIM;
      const T fill = from_f32<T>(bad ? __int_as_float(0x7fc00000) : 0.0f);
      for (int i = tid; i < c.ng * HEAD_DIM; i += THREADS) out_rows[i] = fill;
    }
    return false;
  }
  const SplitPlan plan = PlanSplits(c.L, p.window, num_splits, cta_rows, min_chunk);
  c.active = plan.active;
  if (c.split >= plan.active) return false;
  c.c0 = plan.lo + c.split * plan.chunk;
  c.c1 = min(plan.lo + plan.n, c.c0 + plan.chunk);  // exclusive
  c.new_off = (static_cast<int64_t>(c.b) * p.num_kv_heads + c.hkv) * HEAD_DIM;
  constexpr int kUnits = HEAD_DIM / VecOf<T>::kElems;
  if (c.split == 0 && head_chunk == 0 && tid < kUnits) {
    const int64_t dst = kv_offset(p.cache, c.b, c.L, c.hkv) + tid * VecOf<T>::kElems;
    stg16(p.k_cache + dst, ldg16(p.k_new + c.new_off + tid * VecOf<T>::kElems));
    stg16(p.v_cache + dst, ldg16(p.v_new + c.new_off + tid * VecOf<T>::kElems));
  }
  return true;
}

// The warp tile that holds position L gets row L from k / v (k_new + DecodeCta::new_off; the
// cache slot is being written by this launch): one warp writes its K and V rows into the tile, in
// Shape's shared-memory addressing (Shape::Unit, K then V kTensorUnits apart), then synchronizes.
template <typename Shape, typename T>
__device__ __forceinline__ void PatchNewRow(const T* k_new, const T* v_new, uint4* tile, int row,
                                            int lane) {
  constexpr int V = VecOf<T>::kElems;
#pragma unroll
  for (int k = 0; k < (Shape::kUnits + 31) / 32; ++k) {
    const int u = lane + 32 * k;
    if (u < Shape::kUnits) {
      tile[Shape::Unit(row, u)] = ldg16(k_new + u * V);
      tile[Shape::kTensorUnits + Shape::Unit(row, u)] = ldg16(v_new + u * V);
    }
  }
  __syncwarp();
}

// The workspace's counter words, one per (b, KV head, head chunk), after the partials (acc, then
// (m, l), of every split): where the launcher zeroes them and the kernel counts when the pool
// does not serve.
template <typename T>
__host__ __device__ __forceinline__ unsigned* WorkspaceCounters(const GqaParams<T>& p,
                                                                int num_splits) {
  return reinterpret_cast<unsigned*>(p.workspace + static_cast<int64_t>(p.batch) * p.num_q_heads *
                                                       num_splits * (p.head_dim + 2));
}

// Split counters that outlive a launch: one pool per translation unit (each .cu that includes
// this header has its own: mma's, and simt's f32, bf16 and f16), zero when the module loads.
// Kernels name it directly, so the host never looks a device symbol up. TakeCounterRegion
// (cuda/gqa_decode.cuh) says how it stays zero.
static __device__ unsigned g_split_counters[kCounterPoolWords];  // 1 MiB per unit and device

// Ends a CTA once its warps have left (m, l) in sm_m / sm_l and acc in sm_acc
// ([WARPS][GROUP][HEAD_DIM] f32 at the start of dynamic shared memory, `smem`, which must hold
// GROUP * kMaxSplits floats too) and synchronized: the CTA's result goes to the output rows when
// it is the lone active split, else to the workspace, and the last split of its (b, KV head,
// head chunk) to arrive merges them all (threadFenceReduction's pattern: publish, fence, count;
// the last to count reads everything after a fence).
// `counter_region` is the offset of this launch's words in the pool, one per (b, KV head, head
// chunk), or -1: the workspace's words after the partials, zeroed by a kernel node before the
// launch. Either way they are zero at launch, and the last CTA leaves its word at zero again.
template <typename T, int HEAD_DIM, int GROUP, int WARPS>
__device__ __forceinline__ void EndDecodeCta(const GqaParams<T>& p, const DecodeCta& c,
                                             int num_splits, int counter_region,
                                             const float (&sm_m)[WARPS][GROUP],
                                             const float (&sm_l)[WARPS][GROUP],
                                             unsigned char* smem) {
  constexpr int kThreads = 32 * WARPS;
  __shared__ float inv_s[GROUP];
  __shared__ int s_last;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  T* out_rows = p.out + (static_cast<int64_t>(c.b) * p.num_q_heads + c.qh0) * HEAD_DIM;
  const int store_splits = c.active == 1 ? 1 : num_splits;
  StoreDecodeSplit<T, HEAD_DIM, GROUP, WARPS, kThreads>(
      p, sm_m, sm_l, reinterpret_cast<const float*>(smem), c.b, c.qh0, c.ng, c.split, store_splits,
      out_rows);
  if (store_splits == 1) return;
  const int64_t bh0 = static_cast<int64_t>(c.b) * p.num_q_heads + c.qh0;
  const int64_t ml_base = static_cast<int64_t>(p.batch) * p.num_q_heads * num_splits * HEAD_DIM;
  unsigned* counters =
      counter_region >= 0 ? g_split_counters + counter_region : WorkspaceCounters(p, num_splits);
  unsigned* counter = counters + (static_cast<int64_t>(c.b) * gridDim.y + blockIdx.y);
  __threadfence();
  __syncthreads();
  if (tid == 0) s_last = atomicAdd(counter, 1u) == static_cast<unsigned>(c.active - 1);
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  float* weight = reinterpret_cast<float*>(smem);  // [GROUP][kMaxSplits]; sm_acc is done
  for (int g = warp; g < c.ng; g += WARPS) {
    const float* ml = p.workspace + ml_base + (bh0 + g) * num_splits * 2;
    float mx = kMaxSentinel;
    for (int s = lane; s < c.active; s += 32) mx = fmaxf(mx, __ldcg(ml + 2 * s));
    mx = WarpReduce(mx, [](float a, float o) { return fmaxf(a, o); });
    float lsum = 0.0f;
    for (int s = lane; s < c.active; s += 32) {
      const float w = exp2f(__ldcg(ml + 2 * s) - mx);
      weight[g * kMaxSplits + s] = w;
      lsum += __ldcg(ml + 2 * s + 1) * w;
    }
    lsum = WarpReduce(lsum, [](float a, float o) { return a + o; });
    if (lane == 0) inv_s[g] = 1.0f / lsum;
  }
  __syncthreads();
  // 16-byte partial reads, 16 splits in flight per thread: the merge is a chain of dependent
  // L2 round trips otherwise (one per split per thread).
  constexpr int kD4 = HEAD_DIM / 4;
  for (int i = tid; i < c.ng * kD4; i += kThreads) {
    const int g = i / kD4, d4 = i % kD4;
    const float4* a =
        reinterpret_cast<const float4*>(p.workspace + (bh0 + g) * num_splits * HEAD_DIM) + d4;
    const float* wg = weight + g * kMaxSplits;
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 16
    for (int s = 0; s < c.active; ++s) {
      const float4 x = __ldcg(a + static_cast<int64_t>(s) * kD4);
      const float w = wg[s];
      sum.x = fmaf(x.x, w, sum.x);
      sum.y = fmaf(x.y, w, sum.y);
      sum.z = fmaf(x.z, w, sum.z);
      sum.w = fmaf(x.w, w, sum.w);
    }
    const float inv = inv_s[g];
    T* o = out_rows + g * HEAD_DIM + d4 * 4;
    o[0] = from_f32<T>(sum.x * inv);
    o[1] = from_f32<T>(sum.y * inv);
    o[2] = from_f32<T>(sum.z * inv);
    o[3] = from_f32<T>(sum.w * inv);
  }
  // Every other split of this (b, KV head, head chunk) has counted: the word is free again, and
  // a pool region stays all zeros between launches.
  if (tid == 0) *counter = 0u;
}

// ---- host side ----

inline int CtasPerSm(int smem_bytes, int max_by_registers) {
  return std::max(1, std::min(max_by_registers, CurrentDeviceCtasBySmem(smem_bytes)));
}

// The split count of a plan: the call's fixed `splits` (DecodeOptions), else enough splits for
// ctas_per_sm CTAs on every SM.
inline int SplitsForCtas(int64_t ctas, int ctas_per_sm, int fixed_splits) {
  if (fixed_splits > 0) return std::min(kMaxSplits, fixed_splits);
  const int64_t target = static_cast<int64_t>(ctas_per_sm) * CurrentDeviceSmCount();
  // floor, not ceil: a grid just over one wave would leave most SMs idle in its second wave.
  const int64_t s = target / std::max<int64_t>(1, ctas);
  return static_cast<int>(std::min<int64_t>(kMaxSplits, std::max<int64_t>(1, s)));
}

// Wide CTAs (one per SM) where the (b, KV head, head chunk) CTAs are fewer than the SMs, unless
// the call forced a shape.
inline bool UseWide(int64_t ctas, DecodeCtas shape) {
  if (shape == DecodeCtas::kAuto) return ctas < CurrentDeviceSmCount();
  return shape == DecodeCtas::kWide;
}

// Zeroes the split counters (a one-CTA kernel node; defined in cuda/gqa_decode_simt.cu).
void LaunchZeroCounters(unsigned* counters, int n, cudaStream_t stream);

// Launches a one-launch split-K decode kernel: `plan.num_splits` clamped to the workspace
// (partials, then one counter per (b, KV head, head chunk)); when it splits, the counters come
// from the pool (unless the call asked for the workspace's, or is too large for the pool) or,
// zeroed first, from the workspace.
// The kernel is a template argument so each one keeps its own shared-memory opt-in bit.
template <auto Kernel, typename T>
cudaError_t LaunchSplitDecode(const GqaParams<T>& p, int chunks, int threads, int smem,
                              const GqaDecodePlan& plan, SplitCounters counters,
                              cudaStream_t stream) {
  if (p.batch <= 0 || p.num_q_heads <= 0) return cudaSuccess;
  if (p.batch > 65535 || p.num_kv_heads * chunks > 65535) return cudaErrorInvalidConfiguration;
  static std::atomic<uint64_t> configured{0};
  const cudaError_t e = AllowDynamicSmem(reinterpret_cast<const void*>(Kernel), smem, configured);
  if (e != cudaSuccess) return e;
  const int64_t ctas = static_cast<int64_t>(p.batch) * p.num_kv_heads * chunks;
  int splits = plan.num_splits;
  const int64_t per_split = static_cast<int64_t>(p.batch) * p.num_q_heads * (p.head_dim + 2);
  const int64_t room = p.workspace == nullptr ? 0 : p.workspace_floats - ctas;  // counters
  splits = static_cast<int>(std::min<int64_t>(splits, std::max<int64_t>(0, room) / per_split));
  if (splits < 2) splits = 1;
  int counter_region = -1;
  if (splits > 1) {
    if (counters == SplitCounters::kPool) {
      counter_region = TakeCounterRegion(static_cast<int>(ctas));
    }
    if (counter_region < 0) {
      LaunchZeroCounters(WorkspaceCounters(p, splits), static_cast<int>(ctas), stream);
    }
  }
  const dim3 grid(splits, p.num_kv_heads * chunks, p.batch);
  Kernel<<<grid, threads, smem, stream>>>(p, splits, chunks, plan.min_chunk, counter_region);
  return cudaGetLastError();
}

}  // namespace split_decode
}  // namespace jax_kv
