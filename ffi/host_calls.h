// Per-target counters of CUDA handler host calls: the CUDA-graph replay signal.
// XLA runs a kCmdBufferCompatible handler's host code when it records a command buffer or runs
// without one, never when it replays a recorded graph; a step whose counter did not move was
// replayed.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <utility>

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

// With JAX_KV_TRACE_OPERANDS set, a handler's host call prints its operands' device addresses on
// one stderr line: XLA records a command buffer again when an address its commands use moves,
// so two host calls' lines name the buffer that moved. Read once; unset, one branch per call.
inline void TraceOperands(const char* target,
                          std::initializer_list<std::pair<const char*, const void*>> operands) {
  static const bool on = std::getenv("JAX_KV_TRACE_OPERANDS") != nullptr;
  if (!on) return;
  std::fprintf(stderr, "jax_kv operands %s:", target);
  for (const auto& [name, address] : operands) std::fprintf(stderr, " %s=%p", name, address);
  std::fprintf(stderr, "\n");
}

}  // namespace jax_kv
