// y = x @ w^T for a handful of rows x (the decode step at B=1: M = 1), streaming w once.
//
// Why not XLA's: it strength-reduces a dot with a vector operand to multiply + reduce
// fusions, which ran Qwen2.5-0.5B's four projections at 2.0 TB/s on the H200 (14.8 us a layer
// for 29.8 MB; bench/NOTES.md). Here each warp owns output rows and streams them in 16-byte
// loads, several in flight per lane; x (at most 4 x K) is read through L1.
// Two shapes: K up to kSplitK elements, one row per warp (8 rows a CTA); longer K, four warps
// share a row (2 rows a CTA) so a 896-row, 4864-wide matrix still gives 448 CTAs rather than
// 112 long serial ones.
#include "cuda/kernel_common.cuh"
#include "cuda/matvec.cuh"

namespace jax_kv {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kSplitK = 2048;
constexpr int kLoads = 4;  // 16-byte loads of w in flight per lane

template <typename T, int M, int WARPS_PER_ROW>
__global__ void __launch_bounds__(kThreads) MatvecKernel(const MatvecParams<T> p) {
  constexpr int V = VecOf<T>::kElems;
  constexpr int kRowsPerCta = kWarps / WARPS_PER_ROW;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row_in_cta = warp / WARPS_PER_ROW, part = warp % WARPS_PER_ROW;
  const int n = blockIdx.x * kRowsPerCta + row_in_cta;
  const int kv = p.k / V;  // 16-byte vectors per row
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.0f;
  if (n < p.n) {
    const uint4* w = reinterpret_cast<const uint4*>(p.w + static_cast<int64_t>(n) * p.k);
    const uint4* x = reinterpret_cast<const uint4*>(p.x);
    constexpr int kStride = 32 * WARPS_PER_ROW;
    // kLoads predicated loads issued before any is used, whatever K is: with a plain
    // `#pragma unroll 4` over a runtime trip count, the lanes left with a remainder (K = 896:
    // 3.5 vectors a lane) ran it one dependent load at a time, and the warp waited on each
    // (Qwen2.5-0.5B's projections at 1.4 TB/s; bench/NOTES.md).
    for (int i0 = part * 32 + lane; i0 < kv; i0 += kLoads * kStride) {
      uint4 wv[kLoads];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int i = i0 + u * kStride;
        wv[u] = i < kv ? __ldcs(w + i) : make_uint4(0, 0, 0, 0);  // read once: evict first
      }
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int i = i0 + u * kStride;
        if (i < kv) {
          float wf[V];
          unpack_vec<T>(wv[u], wf);
#pragma unroll
          for (int m = 0; m < M; ++m) {
            float xf[V];
            unpack_vec<T>(__ldg(x + static_cast<int64_t>(m) * kv + i), xf);
#pragma unroll
            for (int e = 0; e < V; ++e) acc[m] = fmaf(wf[e], xf[e], acc[m]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = WarpReduce(acc[m], [](float a, float b) { return a + b; });
  if constexpr (WARPS_PER_ROW > 1) {
    __shared__ float partial[kWarps][M];
    if (lane == 0) {
#pragma unroll
      for (int m = 0; m < M; ++m) partial[warp][m] = acc[m];
    }
    __syncthreads();
    if (part != 0) return;
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
      for (int j = 1; j < WARPS_PER_ROW; ++j) acc[m] += partial[warp + j][m];
    }
  }
  if (lane == 0 && n < p.n) {
    const float b = p.bias != nullptr ? to_f32(p.bias[n]) : 0.0f;
#pragma unroll
    for (int m = 0; m < M; ++m) p.y[static_cast<int64_t>(m) * p.n + n] = from_f32<T>(acc[m] + b);
  }
}

template <typename T, int M>
cudaError_t LaunchRows(const MatvecParams<T>& p, cudaStream_t stream) {
  if (p.k > kSplitK) {
    constexpr int kRows = kWarps / 4;
    MatvecKernel<T, M, 4><<<(p.n + kRows - 1) / kRows, kThreads, 0, stream>>>(p);
  } else {
    MatvecKernel<T, M, 1><<<(p.n + kWarps - 1) / kWarps, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace

template <typename T>
cudaError_t LaunchMatvec(const MatvecParams<T>& p, cudaStream_t stream) {
  if (p.m <= 0 || p.n <= 0) return cudaSuccess;
  switch (p.m) {
    case 1:
      return LaunchRows<T, 1>(p, stream);
    case 2:
      return LaunchRows<T, 2>(p, stream);
    case 3:
      return LaunchRows<T, 3>(p, stream);
    case 4:
      return LaunchRows<T, 4>(p, stream);
    default:
      return cudaErrorInvalidValue;  // the handler checks m <= kMatvecMaxRows first
  }
}

template cudaError_t LaunchMatvec<float>(const MatvecParams<float>&, cudaStream_t);
template cudaError_t LaunchMatvec<bf16_t>(const MatvecParams<bf16_t>&, cudaStream_t);
template cudaError_t LaunchMatvec<f16_t>(const MatvecParams<f16_t>&, cudaStream_t);

}  // namespace jax_kv
