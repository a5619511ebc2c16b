// y = x @ w^T for a handful of rows x (the decode step at B=1: M = 1), streaming w once, with
// the RMSNorm before and the SwiGLU or residual add after done in the same kernel.
//
// Why not XLA's: it strength-reduces a dot with a vector operand to multiply + reduce
// fusions, which ran Qwen2.5-0.5B's four projections at 2.0 TB/s on the H200 (14.8 us a layer
// for 29.8 MB; bench/NOTES.md). Here each warp owns output rows and streams them in 16-byte
// loads, kLoads in flight per lane; x (at most 4 x K) is read through L1.
// Why the prologue and epilogues: at Qwen2.5-0.5B a layer ran ~12 graph nodes, most under a
// microsecond of work with about as long again between them; the norm, the SwiGLU and the
// residual adds are five of them, and each is a few FLOPs per element of data this kernel
// already holds.
// Two shapes: K up to kSplitK elements, one output per warp (8 a CTA); longer K, four warps
// share an output (2 a CTA) so a 896-row, 4864-wide matrix still gives 448 CTAs rather than
// 112 long serial ones.
#include "cuda/kernel_common.cuh"
#include "cuda/matvec.cuh"

namespace jax_kv {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kSplitK = 2048;
constexpr int kLoads = 4;  // 16-byte loads of each w row in flight per lane

// v rounded to T and back: the prologue and epilogues round where the unfused XLA ops would.
template <typename T>
__device__ __forceinline__ float RoundTo(float v) {
  return to_f32(from_f32<T>(v));
}

// 1 / rms of each of the M rows of x [M, K] (K = kv vectors), for every thread of the CTA.
template <typename T, int M>
__device__ void RowInvRms(const uint4* x, int kv, int k, float eps, float (&inv)[M]) {
  constexpr int V = VecOf<T>::kElems;
  __shared__ float partial[kWarps][M];
  float sq[M];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    sq[m] = 0.0f;
    for (int i = threadIdx.x; i < kv; i += kThreads) {
      float xf[V];
      unpack_vec<T>(__ldg(x + static_cast<int64_t>(m) * kv + i), xf);
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
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += partial[w][m];
    inv[m] = rsqrtf(s / static_cast<float>(k) + eps);
  }
}

// R w rows per output: 1, or 2 (gate, up) under SwiGLU.
template <typename T, int M, int WARPS_PER_ROW, bool SWIGLU>
__global__ void __launch_bounds__(kThreads) MatvecKernel(const MatvecParams<T> p) {
  constexpr int V = VecOf<T>::kElems;
  constexpr int R = SWIGLU ? 2 : 1;
  constexpr int kRowsPerCta = kWarps / WARPS_PER_ROW;
  constexpr int kStride = 32 * WARPS_PER_ROW;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row_in_cta = warp / WARPS_PER_ROW, part = warp % WARPS_PER_ROW;
  const int n = blockIdx.x * kRowsPerCta + row_in_cta;
  const int kv = p.k / V;  // 16-byte vectors per row
  const uint4* x = reinterpret_cast<const uint4*>(p.x);
  const uint4* norm = reinterpret_cast<const uint4*>(p.norm);
  const bool live = n < p.n;
  const uint4* w[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    w[r] = reinterpret_cast<const uint4*>(p.w + (static_cast<int64_t>(r) * p.n + n) * p.k);
  }

  // kLoads predicated loads per w row issued before any is used, whatever K is: with a plain
  // `#pragma unroll 4` over a runtime trip count, the lanes left with a remainder (K = 896:
  // 3.5 vectors a lane) ran it one dependent load at a time (1.4 TB/s; bench/NOTES.md).
  uint4 wv[R][kLoads];
  auto load_round = [&](int i0) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int i = i0 + u * kStride;
        wv[r][u] = live && i < kv ? __ldcs(w[r] + i) : make_uint4(0, 0, 0, 0);  // evict first
      }
    }
  };
  int i0 = part * 32 + lane;
  load_round(i0);  // in flight while the norm's reduction runs

  float inv_rms[M];
  if (p.norm != nullptr) {
    RowInvRms<T, M>(x, kv, p.k, p.eps, inv_rms);  // every thread: it synchronizes the CTA
  }

  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;
  }
  for (; live && i0 < kv; i0 += kLoads * kStride) {
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int i = i0 + u * kStride;
      if (i < kv) {
        float gf[V];
        if (p.norm != nullptr) unpack_vec<T>(__ldg(norm + i), gf);
#pragma unroll
        for (int m = 0; m < M; ++m) {
          float xf[V];
          unpack_vec<T>(__ldg(x + static_cast<int64_t>(m) * kv + i), xf);
          if (p.norm != nullptr) {
#pragma unroll
            for (int e = 0; e < V; ++e) xf[e] = RoundTo<T>(gf[e] * RoundTo<T>(xf[e] * inv_rms[m]));
          }
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
    if (i0 + kLoads * kStride < kv) load_round(i0 + kLoads * kStride);
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      acc[r][m] = WarpReduce(acc[r][m], [](float a, float b) { return a + b; });
    }
  }
  if constexpr (WARPS_PER_ROW > 1) {
    __shared__ float partial[kWarps][R][M];
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int m = 0; m < M; ++m) partial[warp][r][m] = acc[r][m];
      }
    }
    __syncthreads();
    if (part != 0) return;
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int j = 1; j < WARPS_PER_ROW; ++j) acc[r][m] += partial[warp + j][r][m];
      }
    }
  }
  if (lane != 0 || !live) return;
  float b[R];
#pragma unroll
  for (int r = 0; r < R; ++r) b[r] = p.bias != nullptr ? to_f32(p.bias[r * p.n + n]) : 0.0f;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float y = RoundTo<T>(acc[0][m] + b[0]);
    if constexpr (SWIGLU) {
      // jax.nn.silu(gate) * up in T: sigmoid, its product with gate, the product with up.
      const float up = RoundTo<T>(acc[1][m] + b[1]);
      const float sig = RoundTo<T>(1.0f / (1.0f + __expf(-y)));
      y = RoundTo<T>(RoundTo<T>(y * sig) * up);
    }
    const int64_t at = static_cast<int64_t>(m) * p.n + n;
    if (p.residual != nullptr) y = to_f32(p.residual[at]) + y;
    p.y[at] = from_f32<T>(y);
  }
}

template <typename T, int M, bool SWIGLU>
cudaError_t LaunchRows(const MatvecParams<T>& p, cudaStream_t stream) {
  if (p.k > kSplitK) {
    constexpr int kRows = kWarps / 4;
    MatvecKernel<T, M, 4, SWIGLU><<<(p.n + kRows - 1) / kRows, kThreads, 0, stream>>>(p);
  } else {
    MatvecKernel<T, M, 1, SWIGLU><<<(p.n + kWarps - 1) / kWarps, kThreads, 0, stream>>>(p);
  }
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
