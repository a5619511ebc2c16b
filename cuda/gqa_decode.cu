// Split-K flash decoding over a strided KV cache, with the new token's append fused in.
//
// Grid (splits, Hkv * head_chunks, B). The split count comes from the SM count (host side,
// cached), the chunk each split covers from lengths[b] (device side): the grid never depends
// on the capacity S, so a cache reserved at 131072 slots with 1024 live reads 1024 tokens.
// All query heads of one KV head (up to 8; larger groups take several head chunks) share a
// CTA, so each K/V row is read from HBM once per group. Scores and accumulators are f32.
#include <algorithm>

#include "cuda/device_info.h"
#include "cuda/gqa_decode.cuh"
#include "cuda/kernel_common.cuh"

namespace jax_kv {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxGroup = 8;     // query heads per CTA
constexpr int kMaxSplits = 256;  // cap on splits: beyond it partials traffic outgrows the gain
constexpr int kCtasPerSm = 4;    // resident 128-thread CTAs per SM the split count aims for
constexpr int kMinChunk = 32;    // tokens: below this a split's fixed cost (q load, partials) wins

constexpr int Pow2Ceil(int x) {
  int p = 1;
  while (p < x) p <<= 1;
  return p;
}

// How a warp covers a K/V row: kTpr lanes hold one row (kVpt 16-byte vectors each), kRows
// rows per warp, kUnroll rows per lane group in flight per iteration (K and V loads issued
// together: 8 x 16 B in flight per thread keeps ~32 KB in flight per SM).
template <typename T, int HEAD_DIM>
struct DecodeShape {
  static constexpr int kVec = VecOf<T>::kElems;
  static constexpr int kNumVec = HEAD_DIM / kVec;
  static constexpr int kTpr = kNumVec >= 32 ? 32 : Pow2Ceil(kNumVec);
  static constexpr int kVpt = (kNumVec + kTpr - 1) / kTpr;
  static constexpr int kRows = 32 / kTpr;
  static constexpr int kUnroll = kVpt == 1 ? 4 : 2;
  static constexpr int kWarpTile = kRows * kUnroll;
  static constexpr int kCtaTile = kWarpTile * kWarps;
  static constexpr int kElems = kVpt * kVec;
  static_assert(HEAD_DIM % kVec == 0, "a row must be whole 16-byte vectors");
};

// The positions [lo, lo + n) one sequence attends (the last one, L, is the new token) and
// how the splits cover them. Computed on the device from lengths[b]; the combine kernel
// recomputes it, so the two always agree.
struct SplitPlan {
  int lo, n, chunk, active;
};

__device__ __forceinline__ SplitPlan PlanSplits(int L, int window, int num_splits) {
  SplitPlan s;
  s.lo = window > 0 ? max(0, L + 1 - window) : 0;
  s.n = L + 1 - s.lo;
  const int chunk = (s.n + num_splits - 1) / num_splits;
  s.chunk = max(kMinChunk, (chunk + 15) & ~15);
  s.active = (s.n + s.chunk - 1) / s.chunk;
  return s;
}

__device__ __forceinline__ bool DecodeLengthBad(int L, int capacity) {
  return L < 0 || L >= capacity;
}

template <int GROUP, int ELEMS>
constexpr int DecodeMinBlocks() {
  return GROUP * ELEMS <= 32 && GROUP < 8 ? kCtasPerSm : 2;  // 8 heads need > 128 registers
}

template <typename T, int HEAD_DIM, int GROUP>
__global__ void __launch_bounds__(kThreads,
                                  DecodeMinBlocks<GROUP, DecodeShape<T, HEAD_DIM>::kElems>())
    GqaDecodeKernel(const GqaParams<T> p, int num_splits, int head_chunks) {
  using Sh = DecodeShape<T, HEAD_DIM>;
  constexpr int E = Sh::kElems;
  constexpr int V = Sh::kVec;
  const int split = blockIdx.x;
  const int hkv = blockIdx.y / head_chunks;
  const int head_chunk = blockIdx.y % head_chunks;
  const int b = blockIdx.z;
  const int tid = threadIdx.x;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int g0 = head_chunk * GROUP;
  const int ng = min(GROUP, group - g0);
  const int qh0 = hkv * group + g0;
  const int L = p.lengths[b];
  const bool bad = DecodeLengthBad(L, writable_capacity(p, b));
  if (split == 0 && blockIdx.y == 0 && tid == 0) {
    // Every b has exactly one such CTA, so status needs no memset.
    p.status[b] = bad ? JKV_STATUS_LENGTH_OUT_OF_RANGE : JKV_STATUS_OK;
  }
  T* out_rows = p.out + (static_cast<int64_t>(b) * p.num_q_heads + qh0) * HEAD_DIM;
  if (bad) {  // cache untouched; with splits the combine kernel writes the NaN rows
    if (num_splits == 1) {
      for (int i = tid; i < ng * HEAD_DIM; i += kThreads)
        out_rows[i] = from_f32<T>(__int_as_float(0x7fc00000));
    }
    return;
  }
  const SplitPlan plan = PlanSplits(L, p.window, num_splits);
  if (split >= plan.active) return;
  const int c0 = plan.lo + split * plan.chunk;
  const int c1 = min(plan.lo + plan.n, c0 + plan.chunk);  // exclusive

  const int64_t new_off = (static_cast<int64_t>(b) * p.num_kv_heads + hkv) * HEAD_DIM;
  const T* k_new = p.k_new + new_off;
  const T* v_new = p.v_new + new_off;
  // Fused append. The CTA owning position L reads the new K/V from k_new/v_new, never from
  // the cache, so no CTA of this launch reads cache slot L and this store races with nothing;
  // one launch instead of a copy kernel + attention kernel (~2 us per extra graph node).
  if (split == 0 && head_chunk == 0 && tid < Sh::kNumVec) {
    const int64_t dst = kv_offset(p.cache, b, L, hkv) + tid * V;
    stg16(p.k_cache + dst, ldg16(k_new + tid * V));
    stg16(p.v_cache + dst, ldg16(v_new + tid * V));
  }

  const int warp = tid / 32, lane = tid % 32;
  const int row = lane / Sh::kTpr, col = lane % Sh::kTpr;
  // Scores in log2 units: without softcap the scale (and log2 e) is folded into q; with it,
  // q carries scale / softcap and the score is softcap * log2(e) * tanh(q.k).
  const bool use_softcap = p.softcap > 0.0f;
  const float q_mul = use_softcap ? p.scale / p.softcap : p.scale * kLog2e;
  const float cap_log2 = p.softcap * kLog2e;

  float q[GROUP][E];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
#pragma unroll
    for (int v = 0; v < Sh::kVpt; ++v) {
      const int vi = v * Sh::kTpr + col;
      float f[V];
      uint4 raw = make_uint4(0, 0, 0, 0);
      if (g < ng && vi < Sh::kNumVec) {
        raw = ldg16(p.q + (static_cast<int64_t>(b) * p.num_q_heads + qh0 + g) * HEAD_DIM + vi * V);
      }
      unpack_vec<T>(raw, f);
#pragma unroll
      for (int i = 0; i < V; ++i) q[g][v * V + i] = f[i] * q_mul;
    }
  }

  float m[GROUP], l[GROUP], acc[GROUP][E];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    m[g] = kMaxSentinel;
    l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[g][e] = 0.0f;
  }

  // The softcap choice is made once, outside the loop: the loop is compiled twice.
  auto attend = [&](auto softcap_tag) {
    constexpr bool SOFTCAP = decltype(softcap_tag)::value;
    for (int base = c0 + warp * Sh::kWarpTile; base < c1; base += Sh::kCtaTile) {
      uint4 kr[Sh::kUnroll][Sh::kVpt], vr[Sh::kUnroll][Sh::kVpt];
      bool valid[Sh::kUnroll];
#pragma unroll
      for (int u = 0; u < Sh::kUnroll; ++u) {
        const int tok = base + u * Sh::kRows + row;
        valid[u] = tok < c1;
        const int64_t off = kv_offset(p.cache, b, tok, hkv);
        const T* kp = tok == L ? k_new : p.k_cache + off;
        const T* vp = tok == L ? v_new : p.v_cache + off;
#pragma unroll
        for (int v = 0; v < Sh::kVpt; ++v) {
          const int vi = v * Sh::kTpr + col;
          const bool ld = valid[u] && vi < Sh::kNumVec;
          kr[u][v] = ld ? ldg16(kp + vi * V) : make_uint4(0, 0, 0, 0);
          vr[u][v] = ld ? ldg16(vp + vi * V) : make_uint4(0, 0, 0, 0);
        }
      }
      float s[Sh::kUnroll][GROUP];
#pragma unroll
      for (int u = 0; u < Sh::kUnroll; ++u) {
        float kf[E];
#pragma unroll
        for (int v = 0; v < Sh::kVpt; ++v) {
          float f[V];
          unpack_vec<T>(kr[u][v], f);
#pragma unroll
          for (int i = 0; i < V; ++i) kf[v * V + i] = f[i];
        }
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
          float dot = 0.0f;
#pragma unroll
          for (int e = 0; e < E; ++e) dot = fmaf(q[g][e], kf[e], dot);
#pragma unroll
          for (int off = Sh::kTpr / 2; off >= 1; off >>= 1) {
            dot += __shfl_xor_sync(0xffffffffu, dot, off);
          }
          if constexpr (SOFTCAP) dot = cap_log2 * TanhBranchless(dot);
          s[u][g] = valid[u] ? dot : -INFINITY;
        }
      }
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        float mx = m[g];
#pragma unroll
        for (int u = 0; u < Sh::kUnroll; ++u) mx = fmaxf(mx, s[u][g]);
        const float corr = exp2f(m[g] - mx);
        m[g] = mx;
        l[g] *= corr;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] *= corr;
#pragma unroll
        for (int u = 0; u < Sh::kUnroll; ++u) {
          s[u][g] = exp2f(s[u][g] - mx);  // -inf (invalid row) -> 0
          l[g] += s[u][g];
        }
      }
#pragma unroll
      for (int u = 0; u < Sh::kUnroll; ++u) {
        float vf[E];
#pragma unroll
        for (int v = 0; v < Sh::kVpt; ++v) {
          float f[V];
          unpack_vec<T>(vr[u][v], f);
#pragma unroll
          for (int i = 0; i < V; ++i) vf[v * V + i] = f[i];
        }
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
#pragma unroll
          for (int e = 0; e < E; ++e) acc[g][e] = fmaf(s[u][g], vf[e], acc[g][e]);
        }
      }
    }
  };
  if (use_softcap) {
    attend(std::true_type{});
  } else {
    attend(std::false_type{});
  }

  // Merge the warp's row groups (lanes that hold the same columns).
#pragma unroll
  for (int off = Sh::kTpr; off < 32; off <<= 1) {
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[g], off);
      const float lo = __shfl_xor_sync(0xffffffffu, l[g], off);
      const float mn = fmaxf(m[g], mo);
      const float ca = exp2f(m[g] - mn), cb = exp2f(mo - mn);
      l[g] = l[g] * ca + lo * cb;
      m[g] = mn;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float ao = __shfl_xor_sync(0xffffffffu, acc[g][e], off);
        acc[g][e] = acc[g][e] * ca + ao * cb;
      }
    }
  }

  // Merge the warps through shared memory.
  __shared__ float sm_m[kWarps][GROUP], sm_l[kWarps][GROUP];
  __shared__ float sm_acc[kWarps][GROUP][HEAD_DIM];
  if (row == 0) {
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
#pragma unroll
      for (int v = 0; v < Sh::kVpt; ++v) {
        const int vi = v * Sh::kTpr + col;
        if (vi < Sh::kNumVec) {
#pragma unroll
          for (int i = 0; i < V; ++i) sm_acc[warp][g][vi * V + i] = acc[g][v * V + i];
        }
      }
      if (col == 0) {
        sm_m[warp][g] = m[g];
        sm_l[warp][g] = l[g];
      }
    }
  }
  __syncthreads();
  StoreDecodeSplit<T, HEAD_DIM, GROUP, kWarps, kThreads>(p, sm_m, sm_l, &sm_acc[0][0][0], b, qh0,
                                                         ng, split, num_splits, out_rows);
}

// Merges the splits' partials of one (b, query head): out = sum_s acc_s 2^(m_s - M) /
// sum_s l_s 2^(m_s - M). The per-split weights are computed once, in parallel, into shared
// memory; a loop of dependent L2 round trips per split would cost ~0.2 us each at B=1.
constexpr int kCombineThreads = 128;

template <typename Op>
__device__ __forceinline__ float BlockReduce(float v, float* scratch, Op op) {
  v = WarpReduce(v, op);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = scratch[0];
#pragma unroll
  for (int w = 1; w < kCombineThreads / 32; ++w) v = op(v, scratch[w]);
  return v;
}

template <typename T>
__global__ void __launch_bounds__(kCombineThreads)
    GqaDecodeCombineKernel(const GqaParams<T> p, int num_splits) {
  __shared__ float weight[kMaxSplits];
  __shared__ float scratch[kCombineThreads / 32];
  const int qh = blockIdx.x, b = blockIdx.y, D = p.head_dim, tid = threadIdx.x;
  const int64_t bh = static_cast<int64_t>(b) * p.num_q_heads + qh;
  T* out = p.out + bh * D;
  const int L = p.lengths[b];
  if (DecodeLengthBad(L, writable_capacity(p, b))) {
    for (int d = tid; d < D; d += kCombineThreads) out[d] = from_f32<T>(__int_as_float(0x7fc00000));
    return;
  }
  const int active = PlanSplits(L, p.window, num_splits).active;
  const float* acc = p.workspace + bh * num_splits * D;
  const float* ml = p.workspace + static_cast<int64_t>(p.batch) * p.num_q_heads * num_splits * D +
                    bh * num_splits * 2;
  float mx = kMaxSentinel;
  for (int s = tid; s < active; s += kCombineThreads) mx = fmaxf(mx, ml[2 * s]);
  mx = BlockReduce(mx, scratch, [](float a, float c) { return fmaxf(a, c); });
  float lsum = 0.0f;
  for (int s = tid; s < active; s += kCombineThreads) {
    const float w = exp2f(ml[2 * s] - mx);
    weight[s] = w;
    lsum += ml[2 * s + 1] * w;
  }
  lsum = BlockReduce(lsum, scratch, [](float a, float c) { return a + c; });  // syncs weight[]
  const float inv = 1.0f / lsum;
  for (int d = tid; d < D; d += kCombineThreads) {
    float a = 0.0f;
#pragma unroll 8
    for (int s = 0; s < active; ++s) a = fmaf(acc[static_cast<int64_t>(s) * D + d], weight[s], a);
    out[d] = from_f32<T>(a * inv);
  }
}

int HeadChunks(int group) { return (group + kMaxGroup - 1) / kMaxGroup; }

int SplitsForCtas(int64_t ctas) {
  const int64_t target = static_cast<int64_t>(kCtasPerSm) * CurrentDeviceSmCount();
  // floor, not ceil: a grid just over one wave would leave most SMs idle in its second wave.
  const int64_t s = target / std::max<int64_t>(1, ctas);
  return static_cast<int>(std::min<int64_t>(kMaxSplits, std::max<int64_t>(1, s)));
}

template <typename T, int HEAD_DIM>
cudaError_t LaunchForHeadDim(const GqaParams<T>& p, int splits, cudaStream_t stream) {
  const int group = p.num_q_heads / p.num_kv_heads;
  const int chunks = HeadChunks(group);
  const dim3 grid(splits, p.num_kv_heads * chunks, p.batch);
  const int bucket = group > kMaxGroup ? kMaxGroup : Pow2Ceil(group);
  switch (bucket) {
    case 1:
      GqaDecodeKernel<T, HEAD_DIM, 1><<<grid, kThreads, 0, stream>>>(p, splits, chunks);
      break;
    case 2:
      GqaDecodeKernel<T, HEAD_DIM, 2><<<grid, kThreads, 0, stream>>>(p, splits, chunks);
      break;
    case 4:
      GqaDecodeKernel<T, HEAD_DIM, 4><<<grid, kThreads, 0, stream>>>(p, splits, chunks);
      break;
    default:
      GqaDecodeKernel<T, HEAD_DIM, 8><<<grid, kThreads, 0, stream>>>(p, splits, chunks);
      break;
  }
  if (splits > 1) {
    GqaDecodeCombineKernel<T>
        <<<dim3(p.num_q_heads, p.batch), kCombineThreads, 0, stream>>>(p, splits);
  }
  return cudaGetLastError();
}

}  // namespace

int GqaDecodeNumSplits(int batch, int num_q_heads, int num_kv_heads) {
  const int group = num_q_heads / std::max(1, num_kv_heads);
  return SplitsForCtas(static_cast<int64_t>(batch) * num_kv_heads * HeadChunks(group));
}

int64_t GqaDecodeWorkspaceFloats(int batch, int num_q_heads, int head_dim) {
  // Hkv = 1 gives the fewest CTAs, hence the most splits, of any Hkv dividing Hq.
  const int splits = SplitsForCtas(static_cast<int64_t>(batch) * HeadChunks(num_q_heads));
  if (splits <= 1) return 0;
  return static_cast<int64_t>(batch) * num_q_heads * splits * (head_dim + 2);
}

template <typename T>
cudaError_t LaunchGqaDecode(const GqaParams<T>& p, cudaStream_t stream) {
  if (p.batch <= 0 || p.num_q_heads <= 0) return cudaSuccess;
  if (p.batch > 65535 || p.num_kv_heads * HeadChunks(p.num_q_heads / p.num_kv_heads) > 65535) {
    return cudaErrorInvalidConfiguration;
  }
  int splits = GqaDecodeNumSplits(p.batch, p.num_q_heads, p.num_kv_heads);
  const int64_t per_split = static_cast<int64_t>(p.batch) * p.num_q_heads * (p.head_dim + 2);
  splits = static_cast<int>(std::min<int64_t>(splits, p.workspace_floats / per_split));
  if (splits < 2 || p.workspace == nullptr) splits = 1;
  JKV_DISPATCH_HEAD_DIM(p.head_dim, HEAD_DIM,
                        return LaunchForHeadDim<T, HEAD_DIM>(p, splits, stream););
  return cudaSuccess;
}

template cudaError_t LaunchGqaDecode<float>(const GqaParams<float>&, cudaStream_t);
template cudaError_t LaunchGqaDecode<bf16_t>(const GqaParams<bf16_t>&, cudaStream_t);
template cudaError_t LaunchGqaDecode<f16_t>(const GqaParams<f16_t>&, cudaStream_t);

}  // namespace jax_kv
