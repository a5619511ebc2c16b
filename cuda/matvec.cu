// y = x @ w^T for a handful of rows x (the decode step at B=1: M = 1), streaming w once, with
// the RMSNorm before and the SwiGLU or residual add after done in the same kernel.
//
// Why not XLA's: it strength-reduces a dot with a vector operand to multiply + reduce
// fusions, which ran Qwen2.5-0.5B's four projections at 2.0 TB/s on the H200 (14.8 us a layer
// for 29.8 MB; bench/NOTES.md). Here each warp owns output rows and streams them in 16-byte
// loads, 8 in flight per lane; x (at most 4 x K) is read through L1, or, under the norm,
// from shared memory, normalized once per CTA.
// Why the prologue and epilogues: at Qwen2.5-0.5B a layer ran ~12 graph nodes, most under a
// microsecond of work with about as long again between them; the norm, the SwiGLU and the
// residual adds are five of them, and each is a few FLOPs per element of data this kernel
// already holds.
// How w streams: each warp owns rows (row r, r + 4 x CTAs, ...) and copies them into its own
// shared-memory ring with cp.async, a chunk of 2 KB per w row per stage, several stages in
// flight, computing on the oldest while the others land; registers hold no loads, so the
// kernel runs at low register counts and many warps per SM. The versions before kept the
// bytes in flight in registers (8 16-byte loads a lane, 64 registers, 50% occupancy) and
// Nsight Compute measured Qwen2.5-0.5B's gate/up at 36% of DRAM bandwidth where XLA's dot
// reached 54% (bench/NOTES.md, "matvec, grid sized to the machine").
#include <algorithm>
#include <atomic>

#include "cuda/cp_async.cuh"
#include "cuda/device_info.h"
#include "cuda/kernel_common.cuh"
#include "cuda/matvec.cuh"

namespace jax_kv {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kChunkLoads = 4;                // 16-byte copies per lane per w row per stage
constexpr int kChunkVecs = 32 * kChunkLoads;  // vectors (2 KB) of a w row per stage

// Ring depth per warp: 4 stages of one w row (3 of them in flight, 6 KB), or 3 stages of the
// gate and up rows (2 in flight, 8 KB). Per CTA 32 or 48 KB, so 6 or 4 CTAs of 4 warps share
// an SM's 228 KB with room for the staged x.
template <bool SWIGLU>
__host__ __device__ constexpr int Stages() {
  return SWIGLU ? 3 : 4;
}
template <bool SWIGLU>
__host__ __device__ constexpr int RingBytes() {
  return kWarps * Stages<SWIGLU>() * (SWIGLU ? 2 : 1) * kChunkVecs * 16;
}

// v rounded to T and back: the prologue and epilogues round where the unfused XLA ops would.
template <typename T>
__device__ __forceinline__ float RoundTo(float v) {
  return to_f32(from_f32<T>(v));
}

// The RMSNorm prologue, once per CTA: x [M, K] and norm [K] copied into shared memory (one
// global round trip, issued while the first w loads are in flight), then x replaced by
// round(norm * round(x / rms)) in T, the exact values the unfused ops would hand the dot.
// Every thread takes part: it synchronizes the CTA.
template <typename T, int M>
__device__ void StageNormalizedX(const MatvecParams<T>& p, int kv, uint4* x_s) {
  constexpr int V = VecOf<T>::kElems;
  const uint4* x = reinterpret_cast<const uint4*>(p.x);
  const uint4* norm = reinterpret_cast<const uint4*>(p.norm);
  uint4* norm_s = x_s + M * kv;
  __shared__ float partial[kWarps][M];
  __shared__ float inv_rms[M];
  for (int i = threadIdx.x; i < kv; i += kThreads) norm_s[i] = __ldg(norm + i);
  float sq[M];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    sq[m] = 0.0f;
    for (int i = threadIdx.x; i < kv; i += kThreads) {
      const uint4 v = __ldg(x + m * kv + i);
      x_s[m * kv + i] = v;
      float xf[V];
      unpack_vec<T>(v, xf);
#pragma unroll
      for (int e = 0; e < V; ++e) sq[m] = fmaf(xf[e], xf[e], sq[m]);
    }
    sq[m] = WarpReduce(sq[m], [](float a, float b) { return a + b; });
  }
  if (threadIdx.x % 32 == 0) {
#pragma unroll
    for (int m = 0; m < M; ++m) partial[threadIdx.x / 32][m] = sq[m];
  }
  __syncthreads();
  if (threadIdx.x < M) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += partial[w][threadIdx.x];
    inv_rms[threadIdx.x] = rsqrtf(s / static_cast<float>(p.k) + p.eps);
  }
  __syncthreads();
  for (int j = threadIdx.x; j < M * kv; j += kThreads) {
    const int i = j % kv;
    const float inv = inv_rms[j / kv];
    float xf[V], gf[V];
    unpack_vec<T>(x_s[j], xf);
    unpack_vec<T>(norm_s[i], gf);
#pragma unroll
    for (int e = 0; e < V; ++e) xf[e] = RoundTo<T>(gf[e] * RoundTo<T>(xf[e] * inv));
    x_s[j] = pack_vec<T>(xf);
  }
  __syncthreads();
}

// y rows for a grid sized to the machine (SMs x resident CTAs): warp g of G walks rows g,
// g + G, ...; each row is `chunks` items of kChunkVecs vectors per w row, streamed through the
// warp's ring. A lane computes on exactly the vectors it copied, so a stage needs no barrier,
// only the lane's own cp.async.wait_group. Bias and residual of the next row are loaded when
// the current row finishes, a row ahead of their use. R w rows per output: 1, or 2 (gate, up)
// under SwiGLU.
template <typename T, int M, bool SWIGLU>
__global__ void __launch_bounds__(kThreads) MatvecKernel(const MatvecParams<T> p) {
  constexpr int V = VecOf<T>::kElems;
  constexpr int R = SWIGLU ? 2 : 1;
  constexpr int S = Stages<SWIGLU>();
  constexpr int kStageVecs = R * kChunkVecs;
  // [kWarps][S][R][kChunkVecs] rings, then (under the norm) staged x [M][K / V] and norm [K / V]
  extern __shared__ uint4 smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kv = p.k / V;                                         // 16-byte vectors per row
  const int chunks = max(1, (kv + kChunkVecs - 1) / kChunkVecs);  // K = 0: y = bias (+ residual)
  const int row_step = gridDim.x * kWarps;
  const int first_row = blockIdx.x * kWarps + warp;
  const int rows = first_row < p.n ? (p.n - first_row + row_step - 1) / row_step : 0;
  const int items = rows * chunks;
  uint4* ring = smem + warp * S * kStageVecs;
  uint4* x_s = smem + kWarps * S * kStageVecs;
  const bool staged = p.norm != nullptr;
  const uint4* x = reinterpret_cast<const uint4*>(p.x);

  // Copies the next item into its ring slot; always commits a group (possibly empty) so the
  // wait counts stay aligned with items. Vectors past K are not copied: the loop below reads
  // only i < kv, so nothing outside w is named and stale slot contents are never used.
  const uint32_t ring_lane = SmemAddr(ring + lane);
  int issued = 0, issue_row = first_row, issue_chunk = 0, issue_slot = 0;
  auto issue = [&]() {
    if (issued < items) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint4* w =
            reinterpret_cast<const uint4*>(p.w + (static_cast<int64_t>(r) * p.n + issue_row) * p.k);
#pragma unroll
        for (int u = 0; u < kChunkLoads; ++u) {
          const int i = issue_chunk * kChunkVecs + u * 32 + lane;
          if (i < kv) {
            CpAsync16(ring_lane + ((issue_slot * R + r) * kChunkVecs + u * 32) * 16, w + i, true);
          }
        }
      }
      ++issued;
      if (++issue_chunk == chunks) {
        issue_chunk = 0;
        issue_row += row_step;
      }
      issue_slot = issue_slot + 1 == S ? 0 : issue_slot + 1;
    }
    CpAsyncCommit();
  };
  float next_bias[R] = {}, next_res[M] = {};
  auto load_epilogue = [&](int n) {  // lane 0's operands of row n, if it is one of this warp's
    if (lane == 0 && n < p.n) {
#pragma unroll
      for (int r = 0; r < R; ++r) next_bias[r] = p.bias ? to_f32(p.bias[r * p.n + n]) : 0.0f;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        next_res[m] = p.residual ? to_f32(p.residual[static_cast<int64_t>(m) * p.n + n]) : 0.0f;
      }
    }
  };

#pragma unroll
  for (int t = 0; t < S - 1; ++t) issue();
  load_epilogue(first_row);
  if (staged) StageNormalizedX<T, M>(p, kv, x_s);  // every thread: it synchronizes the CTA

  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;
  }
  int row = first_row, chunk = 0, slot = 0;
  for (int t = 0; t < items; ++t) {
    issue();
    CpAsyncWait<S - 1>();
    const uint4* stage = ring + slot * kStageVecs;
    slot = slot + 1 == S ? 0 : slot + 1;
#pragma unroll
    for (int u = 0; u < kChunkLoads; ++u) {
      const int i = chunk * kChunkVecs + u * 32 + lane;
      if (i < kv) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
          float xf[V];
          unpack_vec<T>(staged ? x_s[m * kv + i] : __ldg(x + m * kv + i), xf);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            float wf[V];
            unpack_vec<T>(stage[r * kChunkVecs + u * 32 + lane], wf);
#pragma unroll
            for (int e = 0; e < V; ++e) acc[r][m] = fmaf(wf[e], xf[e], acc[r][m]);
          }
        }
      }
    }
    if (++chunk < chunks) continue;
    chunk = 0;
    float bias[R], res[M];
#pragma unroll
    for (int r = 0; r < R; ++r) bias[r] = next_bias[r];
#pragma unroll
    for (int m = 0; m < M; ++m) res[m] = next_res[m];
    load_epilogue(row + row_step);
    float sum[R][M];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        sum[r][m] = WarpReduce(acc[r][m], [](float a, float b) { return a + b; });
        acc[r][m] = 0.0f;
      }
    }
    if (lane == 0) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float y = RoundTo<T>(sum[0][m] + bias[0]);
        if constexpr (SWIGLU) {
          // jax.nn.silu(gate) * up in T: sigmoid, its product with gate, the product with up.
          const float up = RoundTo<T>(sum[1][m] + bias[1]);
          const float sig = RoundTo<T>(1.0f / (1.0f + __expf(-y)));
          y = RoundTo<T>(RoundTo<T>(y * sig) * up);
        }
        if (p.residual != nullptr) y = res[m] + y;
        p.y[static_cast<int64_t>(m) * p.n + row] = from_f32<T>(y);
      }
    }
    row += row_step;
  }
  CpAsyncWait<0>();  // no copy outstanding when the warp exits
}

// Resident CTAs per SM of Kernel at smem bytes of dynamic shared memory; the register-bound
// part is asked of the runtime once per kernel (the handler runs on every non-graph step).
template <auto Kernel>
int ResidentCtas(int smem) {
  static std::atomic<int> by_registers{0};
  int r = by_registers.load(std::memory_order_relaxed);
  if (r <= 0) {
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&r, Kernel, kThreads, 0) != cudaSuccess ||
        r <= 0) {
      cudaGetLastError();
      r = 1;
    }
    by_registers.store(r, std::memory_order_relaxed);
  }
  return std::max(1, std::min(r, CurrentDeviceCtasBySmem(smem)));
}

template <typename T, int M, bool SWIGLU>
cudaError_t LaunchRows(const MatvecParams<T>& p, cudaStream_t stream) {
  constexpr auto kernel = MatvecKernel<T, M, SWIGLU>;
  static std::atomic<uint64_t> configured{0};
  const cudaError_t allowed =
      AllowDynamicSmem(reinterpret_cast<const void*>(kernel),
                       RingBytes<SWIGLU>() + kMatvecMaxStagedBytes, configured);
  if (allowed != cudaSuccess) return allowed;
  const int smem =
      RingBytes<SWIGLU>() +
      (p.norm != nullptr ? static_cast<int>(MatvecStagedBytes(p.m, p.k, sizeof(T))) : 0);
  const int64_t ctas = (p.n + kWarps - 1) / kWarps;
  const int64_t slots = static_cast<int64_t>(CurrentDeviceSmCount()) * ResidentCtas<kernel>(smem);
  kernel<<<static_cast<int>(std::min(ctas, slots)), kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, bool SWIGLU>
cudaError_t LaunchForRowCount(const MatvecParams<T>& p, cudaStream_t stream) {
  switch (p.m) {
    case 1:
      return LaunchRows<T, 1, SWIGLU>(p, stream);
    case 2:
      return LaunchRows<T, 2, SWIGLU>(p, stream);
    case 3:
      return LaunchRows<T, 3, SWIGLU>(p, stream);
    case 4:
      return LaunchRows<T, 4, SWIGLU>(p, stream);
    default:
      return cudaErrorInvalidValue;  // the handler checks m <= kMatvecMaxRows first
  }
}

}  // namespace

template <typename T>
cudaError_t LaunchMatvec(const MatvecParams<T>& p, cudaStream_t stream) {
  if (p.m <= 0 || p.n <= 0) return cudaSuccess;
  return p.swiglu ? LaunchForRowCount<T, true>(p, stream) : LaunchForRowCount<T, false>(p, stream);
}

template cudaError_t LaunchMatvec<float>(const MatvecParams<float>&, cudaStream_t);
template cudaError_t LaunchMatvec<bf16_t>(const MatvecParams<bf16_t>&, cudaStream_t);
template cudaError_t LaunchMatvec<f16_t>(const MatvecParams<f16_t>&, cudaStream_t);

}  // namespace jax_kv
