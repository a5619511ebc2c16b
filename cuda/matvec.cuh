// Matrix-vector products for the decode step's projections at B * T <= 4 rows, with the
// elementwise work around them folded in: an RMSNorm of x before, a SwiGLU of gate/up output
// pairs and a residual add after.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_kv {

// y [M, N] = epilogue(prologue(x) [M, K] @ w^T (+ bias)), f32 accumulation, y in T.
//   prologue: x, or with norm, RMSNorm(x) * norm as transformers computes it in T: x / rms in
//             f32, rounded to T, times the weight, rounded to T (rms over each row's K).
//   w:        [N, K]; with swiglu [2N, K], N gate rows then N up rows (bias [2N]), and
//             y = silu(gate) * up, each step rounded to T as XLA would.
//   epilogue: with residual [M, N], y = residual + y (the sum rounded once more to T).
template <typename T>
struct MatvecParams {
  const T* x;
  const T* w;
  const T* bias;      // nullptr: none
  const T* norm;      // nullptr: no RMSNorm
  const T* residual;  // nullptr: none
  T* y;
  int m, n, k;
  float eps;
  bool swiglu;
};

// Largest M the kernel takes; K must be a whole number of 16-byte vectors.
constexpr int kMatvecMaxRows = 4;

// With norm, each CTA stages x [M, K] and norm [K] in shared memory: (M + 1) * K elements,
// at most kMatvecMaxStagedBytes: with the kernel's static shared memory (under 1 KB) it stays
// within the 48 KB a CTA gets without an opt-in.
constexpr int kMatvecMaxStagedBytes = 47 * 1024;
constexpr int64_t MatvecStagedBytes(int64_t m, int64_t k, int64_t itemsize) {
  return (m + 1) * k * itemsize;
}

template <typename T>
cudaError_t LaunchMatvec(const MatvecParams<T>& p, cudaStream_t stream);

}  // namespace jax_kv
