// Device helpers shared by the jax_kv kernels: 16-byte vectors <-> float, head-dim dispatch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/dtypes.h"
#include "cuda/gqa_params.h"

namespace jax_kv {

// Turns the runtime head_dim into `constexpr int HEAD_DIM` for the body (FlashInfer's
// DISPATCH_HEAD_DIM); anything else is cudaErrorInvalidValue (the handler checked it first).
#define JKV_DISPATCH_HEAD_DIM(head_dim, HEAD_DIM, ...)                            \
  switch (head_dim) {                                                             \
    case 64: {                                                                    \
      constexpr int HEAD_DIM = 64;                                                \
      __VA_ARGS__                                                                 \
    } break;                                                                      \
    case 80: {                                                                    \
      constexpr int HEAD_DIM = 80;                                                \
      __VA_ARGS__                                                                 \
    } break;                                                                      \
    case 96: {                                                                    \
      constexpr int HEAD_DIM = 96;                                                \
      __VA_ARGS__                                                                 \
    } break;                                                                      \
    case 128: {                                                                   \
      constexpr int HEAD_DIM = 128;                                               \
      __VA_ARGS__                                                                 \
    } break;                                                                      \
    case 256: {                                                                   \
      constexpr int HEAD_DIM = 256;                                               \
      __VA_ARGS__                                                                 \
    } break;                                                                      \
    default:                                                                      \
      return cudaErrorInvalidValue; /* head_dim must be 64, 80, 96, 128 or 256 */ \
  }

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

// 16 bytes -> floats.
__device__ __forceinline__ void unpack(const uint4& r, float (&f)[4]) {
  f[0] = __uint_as_float(r.x);
  f[1] = __uint_as_float(r.y);
  f[2] = __uint_as_float(r.z);
  f[3] = __uint_as_float(r.w);
}
template <typename T>
__device__ __forceinline__ void unpack(const uint4& r, float (&f)[8]) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      // bf16 -> f32 is a shift: the low half moves up 16 bits, the high half is masked.
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else {
      const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
}
template <typename T, int N>
__device__ __forceinline__ void unpack_vec(const uint4& r, float (&f)[N]) {
  if constexpr (N == 4) {
    unpack(r, f);
  } else {
    unpack<T>(r, f);
  }
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

__device__ __forceinline__ uint4 ldg16(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}
__device__ __forceinline__ void stg16(void* p, const uint4& v) { *reinterpret_cast<uint4*>(p) = v; }

}  // namespace jax_kv
