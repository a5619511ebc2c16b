// GQA decode, simt: its f32 instantiations (cuda/gqa_decode_simt.cuh; bf16 and f16 are in
// gqa_decode_simt_{bf16,f16}.cu) and the host side both decode kernels share: the split-counter
// pool's allocator and the kernel that zeroes workspace counters.
#include <atomic>

#include "cuda/gqa_decode_simt.cuh"
#include "cuda/head_dims.h"

namespace jax_kv {

namespace {

using namespace split_decode;

// The split counters are zeroed by a kernel, not cudaMemsetAsync: in XLA's command buffer the
// memset node (0.86 us) was followed by ~4 us of idle device before the decode kernel started,
// against ~0.1 us between two kernel nodes (H200, Qwen2.5-0.5B, bench/NOTES.md).
constexpr int kZeroThreads = 256;
__global__ void __launch_bounds__(kZeroThreads) ZeroCounters(unsigned* counters, int n) {
  for (int i = threadIdx.x; i < n; i += kZeroThreads) counters[i] = 0;
}

}  // namespace

void split_decode::LaunchZeroCounters(unsigned* counters, int n, cudaStream_t stream) {
  ZeroCounters<<<1, kZeroThreads, 0, stream>>>(counters, n);
}

namespace {
std::atomic<uint64_t> g_pool_cursor{0};  // one cursor for every module and device: it only
                                         // has to hand out regions in turn
}  // namespace

int split_decode::TakeCounterRegion(int n) {
  if (n <= 0 || n > kCounterRegionMaxWords) return -1;
  const uint64_t words = (static_cast<uint64_t>(n) + 31) / 32 * 32;  // 128-byte regions
  constexpr uint64_t kPool = kCounterPoolWords;
  uint64_t cursor = g_pool_cursor.load(std::memory_order_relaxed);
  for (;;) {
    uint64_t start = cursor % kPool, next = cursor + words;
    if (start + words > kPool) {  // the pool's tail is too short: skip it, start over at 0
      next = cursor + (kPool - start) + words;
      start = 0;
    }
    if (g_pool_cursor.compare_exchange_weak(cursor, next, std::memory_order_relaxed)) {
      return static_cast<int>(start);
    }
  }
}

JKV_FOR_EACH_HEAD_DIM(JKV_DECODE_SIMT_INSTANTIATE, float)

}  // namespace jax_kv
