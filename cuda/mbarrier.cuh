// Shared-memory mbarriers and named barriers (sm_90): what lets two warpgroups of one CTA run
// out of step. An mbarrier counts arrivals per phase; a waiter names the phase by its parity, so
// a barrier may never run two phases ahead of its slowest waiter.
#pragma once

#include <cstdint>

namespace jax_kv {

// Sets the barrier at `bar` (8 bytes of shared memory, 8-byte aligned) to expect `count`
// arrivals per phase. One thread initializes; a CTA barrier must follow before any arrival.
__device__ __forceinline__ void MbarInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void MbarInitFence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival of this thread, released (its earlier shared-memory accesses happen before it).
__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// One arrival of this thread once all its earlier cp.async copies have landed. noinc: the
// arrival is one of the `count` the barrier was initialized with.
__device__ __forceinline__ void CpAsyncArrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Spins until the phase of parity `parity` has completed (acquire: what the arrivals released
// is visible after it).
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// Named CTA barrier `id` (1..15; 0 is __syncthreads) over `threads` threads: Sync waits for
// them all, Arrive counts this thread without waiting.
__device__ __forceinline__ void NamedBarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void NamedBarrierArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace jax_kv
