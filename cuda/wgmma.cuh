// Hopper warpgroup MMA (wgmma.mma_async; sm_90a only): the shared-memory matrix descriptor of
// the 128-byte swizzle mode, the fences, and the m64nNk16 bf16/f16 products with f32
// accumulators that the prefill kernel issues. wgmma names every accumulator register, so the
// asm operand lists are spelled out below.
//
// Everything here exists only when compiling sm_90a SASS (JKV_HAS_WGMMA). The compute_90 PTX
// the build also embeds (for GPUs newer than Hopper) compiles the wgmma kernels to a trap, and
// the launchers choose them only on a compute-capability 9.0 device.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JKV_HAS_WGMMA 1
#else
#define JKV_HAS_WGMMA 0
#endif

#if JKV_HAS_WGMMA

namespace jax_kv {

// A tile of 1024-byte atoms, 8 rows of 128 bytes each, whose 16-byte chunks are XOR-swizzled by
// row % 8 (the 128-byte swizzle; atoms 1024-byte aligned, so the base offset field is 0).
// lbo: bytes between 64-element column blocks of an MN-major operand (K-major ignores it);
// sbo: bytes between groups of 8 rows.
__device__ __forceinline__ uint64_t SmemDescSw128(uint32_t smem_addr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t{1} << 62) | (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32) |
         (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         static_cast<uint64_t>((smem_addr >> 4) & 0x3FFF);
}

// Orders this thread's register writes (accumulators, A fragments) before the next wgmma.
__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most N committed wgmma groups of this warpgroup are pending.
template <int N>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// The accumulators of an in-flight wgmma may be read only after its wait: this empty asm ties
// each register to the point where it is called, so the compiler cannot hoist a read above it.
template <int N>
__device__ __forceinline__ void WgmmaFenceOperands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Makes this thread's generic-proxy shared-memory writes (st.shared, cp.async) visible to the
// async proxy that wgmma reads shared memory through; a barrier must follow.
__device__ __forceinline__ void FenceProxyAsyncShared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// clang-format off
#define JKV_WGMMA_D32 \
  "{" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
  "}"
#define JKV_WGMMA_ACC32(d) \
      "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define JKV_WGMMA_D64 \
  "{" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
  "}"
#define JKV_WGMMA_ACC64(d) \
      "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
      "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
      "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
      "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
// clang-format on

// d = (accumulate ? d : 0) + A . B for one m64nNk16 step: A [64 x 16] and B [N x 16] both
// K-major in shared memory.
#define JKV_WGMMA_SS(N, TY, DREGS, ACC, IA, IB, IS)                                            \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IS                                        \
               ", 0;\n"                                                                        \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " DREGS ", %" #IA \
               ", %" #IB ", p, 1, 1, 0, 0;\n}\n"                                               \
               : ACC(d)                                                                        \
               : "l"(a_desc), "l"(b_desc), "r"(accumulate))
// d += A . B: A [64 x 16] in registers (the m16n8k16 A fragment of each warp's 16 rows), B
// [16 x N] N-major in shared memory (the transposed-B mode).
#define JKV_WGMMA_RS(N, TY, DREGS, ACC, IA, IB, IC, ID, IE, IS)                                 \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IS                                         \
               ", 0;\n"                                                                         \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " DREGS ", {%" #IA \
               ", %" #IB ", %" #IC ", %" #ID "}, %" #IE ", p, 1, 1, 1;\n}\n"                    \
               : ACC(d)                                                                         \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate))

template <typename T, int N>
__device__ __forceinline__ void WgmmaSS(float (&d)[N / 2], uint64_t a_desc, uint64_t b_desc,
                                        int accumulate) {
  static_assert(N == 64 || N == 128, "wgmma N: 64 or 128");
  if constexpr (N == 64 && std::is_same_v<T, __nv_bfloat16>) {
    JKV_WGMMA_SS(64, "bf16", JKV_WGMMA_D32, JKV_WGMMA_ACC32, 32, 33, 34);
  } else if constexpr (N == 64) {
    JKV_WGMMA_SS(64, "f16", JKV_WGMMA_D32, JKV_WGMMA_ACC32, 32, 33, 34);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    JKV_WGMMA_SS(128, "bf16", JKV_WGMMA_D64, JKV_WGMMA_ACC64, 64, 65, 66);
  } else {
    JKV_WGMMA_SS(128, "f16", JKV_WGMMA_D64, JKV_WGMMA_ACC64, 64, 65, 66);
  }
}

template <typename T, int N>
__device__ __forceinline__ void WgmmaRS(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b_desc,
                                        int accumulate) {
  static_assert(N == 64 || N == 128, "wgmma N: 64 or 128");
  if constexpr (N == 64 && std::is_same_v<T, __nv_bfloat16>) {
    JKV_WGMMA_RS(64, "bf16", JKV_WGMMA_D32, JKV_WGMMA_ACC32, 32, 33, 34, 35, 36, 37);
  } else if constexpr (N == 64) {
    JKV_WGMMA_RS(64, "f16", JKV_WGMMA_D32, JKV_WGMMA_ACC32, 32, 33, 34, 35, 36, 37);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    JKV_WGMMA_RS(128, "bf16", JKV_WGMMA_D64, JKV_WGMMA_ACC64, 64, 65, 66, 67, 68, 69);
  } else {
    JKV_WGMMA_RS(128, "f16", JKV_WGMMA_D64, JKV_WGMMA_ACC64, 64, 65, 66, 67, 68, 69);
  }
}

#undef JKV_WGMMA_SS
#undef JKV_WGMMA_RS

}  // namespace jax_kv

#endif  // JKV_HAS_WGMMA
