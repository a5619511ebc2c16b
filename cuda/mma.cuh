// Tensor-core helpers (sm_80+) shared by the prefill and decode kernels: ldmatrix fragments
// from shared memory and the m16n8k16 bf16/f16 product with f32 accumulators.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/cp_async.cuh"

namespace jax_kv {

// Four 8x8 b16 matrices; lane l names row l % 8 of matrix l / 8. The memory clobber keeps the
// compiler from moving the read above the stores or cp.async waits that filled the tile.
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], uint32_t smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem)
               : "memory");
}
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* smem) {
  LdMatrixX4(r, SmemAddr(smem));
}
// The same, each matrix transposed (the B fragment of a row-major [k][n] tile).
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], uint32_t smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem)
               : "memory");
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], const void* smem) {
  LdMatrixX4Trans(r, SmemAddr(smem));
}

// c += a . b for one m16n8k16 tile: a = {a0a1, a2a3, a4a5, a6a7} (rows g, g + 8; columns 2t,
// 2t + 8), b = {b0b1, b2b3}, c = rows g, g + 8 x columns 2t, 2t + 1 (g = lane / 4, t = lane % 4).
template <typename T>
__device__ __forceinline__ void Mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats -> one register of T, lo in the low half (the smaller column of a fragment pair).
template <typename T>
__device__ __forceinline__ uint32_t Pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

}  // namespace jax_kv
