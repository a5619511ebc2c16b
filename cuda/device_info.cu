// Cached per-device properties: SM count and the shared-memory opt-in limit.
#include <algorithm>
#include <atomic>

#include "cuda/device_info.h"

namespace jax_kv {

namespace {

constexpr int kMaxDevices = 64;

// 0 = not read yet; races only ever store the same value.
int CachedAttribute(std::atomic<int> (&cache)[kMaxDevices], cudaDeviceAttr attr, int fallback) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) {
    cudaGetLastError();
    dev = 0;
  }
  int v = cache[dev].load(std::memory_order_relaxed);
  if (v > 0) return v;
  if (cudaDeviceGetAttribute(&v, attr, dev) != cudaSuccess || v <= 0) {
    cudaGetLastError();
    return fallback;
  }
  cache[dev].store(v, std::memory_order_relaxed);
  return v;
}

std::atomic<int> g_sm_count[kMaxDevices];
std::atomic<int> g_smem_optin[kMaxDevices];
std::atomic<int> g_smem_per_sm[kMaxDevices];

}  // namespace

int CurrentDeviceSmCount() {
  return CachedAttribute(g_sm_count, cudaDevAttrMultiProcessorCount, 132);
}

int CurrentDeviceMaxSmemOptin() {
  return CachedAttribute(g_smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 48 * 1024);
}

int CurrentDeviceSmemPerSm() {
  return CachedAttribute(g_smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 228 * 1024);
}

int CurrentDeviceCtasBySmem(int smem_bytes) {
  constexpr int kSmemPerCtaReserved = 1024;
  return std::max(1, CurrentDeviceSmemPerSm() / (smem_bytes + kSmemPerCtaReserved));
}

}  // namespace jax_kv
