// Matrix-vector products for the decode step's projections at B * T <= 4 rows.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_kv {

// y [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]), f32 accumulation, y in T.
template <typename T>
struct MatvecParams {
  const T* x;
  const T* w;
  const T* bias;  // nullptr: none
  T* y;
  int m, n, k;
};

// Largest M the kernel takes; K must be a whole number of 16-byte vectors.
constexpr int kMatvecMaxRows = 4;

template <typename T>
cudaError_t LaunchMatvec(const MatvecParams<T>& p, cudaStream_t stream);

}  // namespace jax_kv
