// Per-target counters of CUDA handler host calls: the CUDA-graph replay signal.
// XLA runs a kCmdBufferCompatible handler's host code when it records a command buffer or runs
// without one, never when it replays a recorded graph; a step whose counter did not move was
// replayed.
#pragma once

#include <atomic>
#include <cstdint>

namespace jax_kv {

enum HostCallTarget : int {
  kHostCallDecode = 0,
  kHostCallPrefill = 1,
  kHostCallGrow = 2,
  kHostCallPrefillPacked = 3,
};
constexpr int kNumHostCallTargets = 4;

// Defined in module_cuda.cc.
extern std::atomic<int64_t> g_host_calls[kNumHostCallTargets];

inline void CountHostCall(HostCallTarget target) {
  g_host_calls[target].fetch_add(1, std::memory_order_relaxed);
}

}  // namespace jax_kv
