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
// The grid is sized to the machine, not to N: each warp walks rows and keeps its next row's
// loads in flight while it finishes the current one. The first version gave each CTA 8 rows
// and one round trip, and at Qwen2.5-0.5B's shapes ran gate/up at 1.8 TB/s (1.15 waves of
// CTAs, each a chain of x, norm, w and residual round trips) and q/k/v and o with fewer CTAs
// than SMs (bench/NOTES.md, "matvec, grid sized to the machine").
#include <algorithm>
#include <atomic>

#include "cuda/device_info.h"
#include "cuda/kernel_common.cuh"
#include "cuda/matvec.cuh"

namespace jax_kv {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;

// 16-byte loads of w in flight per lane: 8 of one row, or 4 of each of the two SwiGLU rows.
// 4 KB per warp, 32 warps per SM at 4 CTAs: ~128 KB in flight per SM, past the ~40 KB that
// Little's law asks for at 4.8 TB/s. Yet Nsight Compute measured this shape at 36% of DRAM
// bandwidth on Qwen2.5-0.5B's gate/up (64 registers, 50% occupancy) where XLA's dot, 28
// registers at full occupancy, reached 54% (bench/NOTES.md): bytes requested up front are
// not the same as bytes kept in flight.
template <bool SWIGLU>
__host__ __device__ constexpr int LoadsPerRow() {
  return SWIGLU ? 4 : 8;
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

// y rows for a grid sized to the machine (SMs x resident CTAs): each CTA walks row groups
// blockIdx.x, + gridDim.x, ...; a group is kWarps / WARPS_PER_ROW rows, WARPS_PER_ROW warps
// splitting each row's K. A warp always has its next (row, round) of w loads in flight while
// it reduces and stores the current row, and every operand the epilogue needs (bias,
// residual) is loaded with the row's first round, so a row costs one global round trip
// after the prologue. R w rows per output: 1, or 2 (gate, up) under SwiGLU.
template <typename T, int M, int WARPS_PER_ROW, bool SWIGLU>
__global__ void __launch_bounds__(kThreads, M == 1 ? 4 : 3) MatvecKernel(const MatvecParams<T> p) {
  constexpr int V = VecOf<T>::kElems;
  constexpr int R = SWIGLU ? 2 : 1;
  constexpr int kLoads = LoadsPerRow<SWIGLU>();
  constexpr int kRowsPerCta = kWarps / WARPS_PER_ROW;
  constexpr int kStride = 32 * WARPS_PER_ROW;   // vectors between a lane's loads
  constexpr int kRoundVecs = kLoads * kStride;  // vectors of a row per round
  extern __shared__ uint4 x_s[];                // staged x [M][K / V] (+ norm), with norm
  __shared__ float partial[2][kWarps][R][M];    // WARPS_PER_ROW > 1: alternate per group
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row_in_cta = warp / WARPS_PER_ROW, part = warp % WARPS_PER_ROW;
  const int kv = p.k / V;  // 16-byte vectors per row
  const int rounds = (kv + kRoundVecs - 1) / kRoundVecs;
  const int groups = (p.n + kRowsPerCta - 1) / kRowsPerCta;
  const int lane_vec = part * 32 + lane;
  const bool staged = p.norm != nullptr;
  const uint4* x = reinterpret_cast<const uint4*>(p.x);

  // The load pipeline: the (group, round) whose w vectors are in wv, and the epilogue
  // operands of the row whose first round was issued last.
  uint4 wv[R][kLoads];
  float next_bias[R] = {}, next_res[M] = {};
  auto issue = [&](int group, int round) {
    const int n = group * kRowsPerCta + row_in_cta;
    const bool live = group < groups && n < p.n;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint4* w =
          reinterpret_cast<const uint4*>(p.w + (static_cast<int64_t>(r) * p.n + n) * p.k);
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int i = round * kRoundVecs + u * kStride + lane_vec;
        wv[r][u] = live && i < kv ? __ldcs(w + i) : make_uint4(0, 0, 0, 0);  // evict first
      }
    }
    if (round == 0 && live && part == 0 && lane == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r) next_bias[r] = p.bias ? to_f32(p.bias[r * p.n + n]) : 0.0f;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        next_res[m] = p.residual ? to_f32(p.residual[static_cast<int64_t>(m) * p.n + n]) : 0.0f;
      }
    }
  };
  issue(blockIdx.x, 0);
  if (staged) StageNormalizedX<T, M>(p, kv, x_s);  // while the first w loads are in flight

  int parity = 0;
  for (int group = blockIdx.x; group < groups; group += gridDim.x, parity ^= 1) {
    const int n = group * kRowsPerCta + row_in_cta;
    const bool live = n < p.n;
    float acc[R][M];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;
    }
    float bias[R], res[M];
    for (int round = 0; round < rounds; ++round) {
      if (live) {
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const int i = round * kRoundVecs + u * kStride + lane_vec;
          if (i < kv) {
#pragma unroll
            for (int m = 0; m < M; ++m) {
              float xf[V];
              unpack_vec<T>(staged ? x_s[m * kv + i] : __ldg(x + m * kv + i), xf);
#pragma unroll
              for (int r = 0; r < R; ++r) {
                float wf[V];
                unpack_vec<T>(wv[r][u], wf);
#pragma unroll
                for (int e = 0; e < V; ++e) acc[r][m] = fmaf(wf[e], xf[e], acc[r][m]);
              }
            }
          }
        }
      }
      if (round + 1 == rounds) {
#pragma unroll
        for (int r = 0; r < R; ++r) bias[r] = next_bias[r];
#pragma unroll
        for (int m = 0; m < M; ++m) res[m] = next_res[m];
      }
      // The next (row, round) goes out before this row's reduction and store.
      if (round + 1 < rounds) {
        issue(group, round + 1);
      } else {
        issue(group + gridDim.x, 0);
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        acc[r][m] = WarpReduce(acc[r][m], [](float a, float b) { return a + b; });
      }
    }
    if constexpr (WARPS_PER_ROW > 1) {
      // Group by group the CTA alternates two partial buffers: the barrier of group g + 1
      // orders its writes after every read of group g - 1's.
      if (lane == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
          for (int m = 0; m < M; ++m) partial[parity][warp][r][m] = acc[r][m];
        }
      }
      __syncthreads();
      if (part == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
          for (int m = 0; m < M; ++m) {
#pragma unroll
            for (int j = 1; j < WARPS_PER_ROW; ++j) acc[r][m] += partial[parity][warp + j][r][m];
          }
        }
      }
    }
    if (lane != 0 || part != 0 || !live) continue;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float y = RoundTo<T>(acc[0][m] + bias[0]);
      if constexpr (SWIGLU) {
        // jax.nn.silu(gate) * up in T: sigmoid, its product with gate, the product with up.
        const float up = RoundTo<T>(acc[1][m] + bias[1]);
        const float sig = RoundTo<T>(1.0f / (1.0f + __expf(-y)));
        y = RoundTo<T>(RoundTo<T>(y * sig) * up);
      }
      if (p.residual != nullptr) y = res[m] + y;
      p.y[static_cast<int64_t>(m) * p.n + n] = from_f32<T>(y);
    }
  }
}

// Resident CTAs per SM of Kernel at smem bytes of dynamic shared memory; the register-bound
// part is asked of the runtime once per kernel (the handler runs on every non-graph step).
// Keyed by the kernel itself: every instantiation shares one function type.
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

template <typename T, int M, int WARPS_PER_ROW, bool SWIGLU>
cudaError_t LaunchShape(const MatvecParams<T>& p, cudaStream_t stream) {
  constexpr auto kernel = MatvecKernel<T, M, WARPS_PER_ROW, SWIGLU>;
  const int smem = p.norm != nullptr ? MatvecStagedBytes(p.m, p.k, sizeof(T)) : 0;
  constexpr int kRowsPerCta = kWarps / WARPS_PER_ROW;
  const int64_t groups = (p.n + kRowsPerCta - 1) / kRowsPerCta;
  const int64_t slots = static_cast<int64_t>(CurrentDeviceSmCount()) * ResidentCtas<kernel>(smem);
  kernel<<<static_cast<int>(std::min(groups, slots)), kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

// Warps per row: enough that one round of loads covers a row (a row then costs one round
// trip), then more while the grid would leave SMs without a CTA and every lane still gets a
// vector; at most the CTA's 8 warps.
template <bool SWIGLU>
int WarpsPerRow(int n, int kv) {
  constexpr int kLoads = LoadsPerRow<SWIGLU>();
  int wpr = 1;
  while (wpr < kWarps && kv > kLoads * 32 * wpr) wpr *= 2;
  const int64_t sms = CurrentDeviceSmCount();
  while (wpr < kWarps && (static_cast<int64_t>(n) * wpr + kWarps - 1) / kWarps < sms &&
         kv >= 32 * 2 * wpr) {
    wpr *= 2;
  }
  return wpr;
}

template <typename T, int M, bool SWIGLU>
cudaError_t LaunchRows(const MatvecParams<T>& p, cudaStream_t stream) {
  switch (WarpsPerRow<SWIGLU>(p.n, p.k / VecOf<T>::kElems)) {
    case 1:
      return LaunchShape<T, M, 1, SWIGLU>(p, stream);
    case 2:
      return LaunchShape<T, M, 2, SWIGLU>(p, stream);
    case 4:
      return LaunchShape<T, M, 4, SWIGLU>(p, stream);
    default:
      return LaunchShape<T, M, 8, SWIGLU>(p, stream);
  }
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
