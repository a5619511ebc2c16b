// GQA decode, kernel 2: its host state (the CTA-shape setting, the split-counter pool's
// allocator), the plan and workspace queries, and the f32 instantiation. The kernel is in
// cuda/gqa_decode_v2.cuh; bf16 and f16 are instantiated in gqa_decode_v2_{bf16,f16}.cu.
#include <atomic>

#include "cuda/gqa_decode_v2.cuh"

namespace jax_kv {

std::atomic<int> g_decode_v2_ctas{kDecodeV2Auto};
std::atomic<bool> g_split_counter_pool{true};

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
  if (!g_split_counter_pool.load(std::memory_order_relaxed) || n <= 0 ||
      n > kCounterRegionMaxWords) {
    return -1;
  }
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

GqaDecodePlan GqaDecodeV2Plan(int batch, int num_q_heads, int num_kv_heads, int head_dim,
                              int itemsize) {
  return itemsize == 4 ? PlanForType<float>(batch, num_q_heads, num_kv_heads, head_dim)
                       : PlanForType<bf16_t>(batch, num_q_heads, num_kv_heads, head_dim);
}

int64_t GqaDecodeV2WorkspaceFloats(int batch, int num_q_heads, int head_dim) {
  // Hkv = 1 and 4 CTAs per SM give the most splits of any Hkv and instantiation.
  const int64_t ctas = static_cast<int64_t>(batch) * HeadChunks(num_q_heads);
  const int splits = SplitsForCtas(ctas, kMaxCtasPerSm);
  if (splits <= 1) return 0;
  // Partials as kernel 1, then one counter per (b, KV head, head chunk) <= B * Hq.
  return static_cast<int64_t>(batch) * num_q_heads * splits * (head_dim + 2) +
         static_cast<int64_t>(batch) * num_q_heads;
}

template cudaError_t LaunchGqaDecodeV2<float>(const GqaParams<float>&, cudaStream_t);

}  // namespace jax_kv
