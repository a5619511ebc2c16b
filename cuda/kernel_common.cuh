// Device helpers shared by the jax_kv kernels: 16-byte vectors <-> float, reductions, the
// decode split store.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/dtypes.h"
#include "cuda/gqa_params.h"

namespace jax_kv {

constexpr float kLog2e = 1.4426950408889634f;
// A finite "minus infinity" for running maxima: exp2(sentinel - sentinel) = 1, not NaN, so
// a row that has seen no key yet needs no special case.
constexpr float kMaxSentinel = -1e30f;

// tanh without tanhf's divergent slow paths (they put branches and BRA.DIV around every
// shuffle of the decode loop): 1 - 2 / (e^{2|x|} + 1) with MUFU.EX2 and an approximate
// reciprocal. Its absolute error (~1e-7) is what softmax sees: softcap * tanh is a logit.
__device__ __forceinline__ float TanhBranchless(float x) {
  const float e = exp2f(2.0f * kLog2e * fabsf(x));
  return copysignf(1.0f - __fdividef(2.0f, e + 1.0f), x);
}

// 2^x on the MUFU alone (exp2f adds a range fix-up for results below 2^-126, which softmax
// weights can flush to zero).
__device__ __forceinline__ float Exp2Fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <typename T>
struct VecOf {
  static constexpr int kElems = 16 / sizeof(T);  // elements per 16-byte vector
};

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float x) {
  return __float2half_rn(x);
}

// W 32-bit words of T -> floats (W for f32, 2W for bf16/f16). bf16 -> f32 is a shift: the low
// half moves up 16 bits, the high half is masked.
template <typename T, int W>
__device__ __forceinline__ void unpack_words(const uint32_t (&w)[W], float* f) {
#pragma unroll
  for (int i = 0; i < W; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      f[i] = __uint_as_float(w[i]);
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else {
      const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
}

// 16 bytes -> floats.
template <typename T, int N>
__device__ __forceinline__ void unpack_vec(const uint4& r, float (&f)[N]) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
  unpack_words<T>(w, f);
}

template <typename Op>
__device__ __forceinline__ float WarpReduce(float v, Op op) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// floats -> 16 bytes of T.
template <typename T, int N>
__device__ __forceinline__ uint4 pack_vec(const float (&f)[N]) {
  uint4 r;
  if constexpr (N == 4) {
    r = make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                   __float_as_uint(f[3]));
  } else {
    T t[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) t[i] = from_f32<T>(f[i]);
    r = *reinterpret_cast<const uint4*>(t);
  }
  return r;
}

// Decode, end of a split: merges the WARPS per-warp partials of the CTA's query heads g < ng
// (m and l in log2 units, acc unnormalised, acc laid out [WARPS][GROUP][HEAD_DIM] in shared
// memory) and writes the result: the output rows when there is one split, else this split's
// partial in the workspace, acc [B, Hq, splits, D] followed by (m, l) [B, Hq, splits, 2].
template <typename T, int HEAD_DIM, int GROUP, int WARPS, int THREADS>
__device__ __forceinline__ void StoreDecodeSplit(const GqaParams<T>& p,
                                                 const float (&sm_m)[WARPS][GROUP],
                                                 const float (&sm_l)[WARPS][GROUP],
                                                 const float* sm_acc, int b, int qh0, int ng,
                                                 int split, int num_splits, T* out_rows) {
  const int64_t bh0 = static_cast<int64_t>(b) * p.num_q_heads + qh0;
  const int64_t ml_base = static_cast<int64_t>(p.batch) * p.num_q_heads * num_splits * HEAD_DIM;
  for (int i = threadIdx.x; i < ng * HEAD_DIM; i += THREADS) {
    const int g = i / HEAD_DIM, d = i % HEAD_DIM;
    float mx = sm_m[0][g];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) mx = fmaxf(mx, sm_m[w][g]);
    float lsum = 0.0f, a = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float c = exp2f(sm_m[w][g] - mx);
      lsum += sm_l[w][g] * c;
      a += sm_acc[(w * GROUP + g) * HEAD_DIM + d] * c;
    }
    if (num_splits == 1) {
      out_rows[i] = from_f32<T>(a / lsum);
    } else {
      const int64_t part = (bh0 + g) * num_splits + split;
      p.workspace[part * HEAD_DIM + d] = a;
      if (d == 0) {
        p.workspace[ml_base + part * 2] = mx;
        p.workspace[ml_base + part * 2 + 1] = lsum;
      }
    }
  }
}

__device__ __forceinline__ uint4 ldg16(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}
__device__ __forceinline__ void stg16(void* p, const uint4& v) { *reinterpret_cast<uint4*>(p) = v; }

}  // namespace jax_kv
