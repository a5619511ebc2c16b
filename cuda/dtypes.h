// Element storage types shared by kernels and handlers, and their float conversions.
// Under nvcc (or with JKV_CUDA_TYPES) they are CUDA's own; the CPU build uses bit containers
// so it never needs the CUDA headers.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__) || defined(JKV_CUDA_TYPES)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
namespace jax_kv {
using bf16_t = __nv_bfloat16;
using f16_t = __half;
}  // namespace jax_kv
#else
namespace jax_kv {

struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(bf16_t x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_float(f16_t x) {
  const uint32_t sign = (x.bits & 0x8000u) << 16;
  uint32_t exp = (x.bits >> 10) & 0x1f, mant = x.bits & 0x3ffu, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);  // inf / nan
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    u = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      mant <<= 1;
      ++e;
    } while (!(mant & 0x400u));
    u = sign | ((112 - e) << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T>
T from_float(float f);
template <>
inline float from_float<float>(float f) {
  return f;
}
template <>
inline bf16_t from_float<bf16_t>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return bf16_t{static_cast<uint16_t>(u >> 16)};
}
template <>
inline f16_t from_float<f16_t>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return f16_t{static_cast<uint16_t>(sign | 0x7e00u)};
  if (abs >= 0x477ff000u) return f16_t{static_cast<uint16_t>(sign | 0x7c00u)};  // overflow
  if (abs < 0x38800000u) {  // subnormal or zero in f16: round 2^-24 units to nearest even
    float af;
    std::memcpy(&af, &abs, 4);
    float scaled = af * 16777216.0f;  // exact: af < 2^-14
    uint32_t m = static_cast<uint32_t>(scaled);
    float rem = scaled - static_cast<float>(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return f16_t{static_cast<uint16_t>(sign | m)};
  }
  uint32_t r = abs - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return f16_t{static_cast<uint16_t>(sign | (r >> 13))};
}

}  // namespace jax_kv
#endif
