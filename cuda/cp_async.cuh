// cp.async (sm_80+) helpers shared by the kernels that stream global memory through shared
// memory rings: 16-byte copies that bypass L1, committed in groups and waited on by count.
#pragma once

#include <cstdint>

namespace jax_kv {

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy (shared address as a 32-bit window offset); pred false
// zero-fills the 16 bytes and reads nothing.
__device__ __forceinline__ void CpAsync16(uint32_t smem, const void* gmem, bool pred) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem),
               "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool pred) {
  CpAsync16(SmemAddr(smem), gmem, pred);
}

__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most N committed groups of this thread are pending. The memory clobber keeps
// the compiler from moving shared-memory reads of the landed data above the wait.
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace jax_kv
