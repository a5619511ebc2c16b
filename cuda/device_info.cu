// Cached per-device properties: SM count, compute capability, shared-memory limits.
#include <algorithm>
#include <atomic>

#include "cuda/device_info.h"

namespace jax_kv {

namespace {

constexpr int kMaxDevices = 64;

int CurrentDeviceIndex() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) {
    cudaGetLastError();
    dev = 0;
  }
  return dev;
}

// 0 = not read yet; races only ever store the same value.
int CachedAttribute(std::atomic<int> (&cache)[kMaxDevices], cudaDeviceAttr attr, int fallback) {
  const int dev = CurrentDeviceIndex();
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
std::atomic<int> g_compute_capability[kMaxDevices];

}  // namespace

int CurrentDeviceSmCount() {
  return CachedAttribute(g_sm_count, cudaDevAttrMultiProcessorCount, 132);
}

int CurrentDeviceComputeCapability() {
  const int dev = CurrentDeviceIndex();
  int v = g_compute_capability[dev].load(std::memory_order_relaxed);
  if (v > 0) return v;
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  v = 10 * major + minor;
  g_compute_capability[dev].store(v, std::memory_order_relaxed);
  return v;
}

int CurrentDeviceMaxSmemOptin() {
  return CachedAttribute(g_smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 48 * 1024);
}

cudaError_t AllowDynamicSmem(const void* kernel, int bytes, std::atomic<uint64_t>& configured) {
  if (bytes <= 0) return cudaSuccess;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return cudaGetLastError();
  const uint64_t bit = uint64_t{1} << (dev & 63);
  if (configured.load(std::memory_order_relaxed) & bit) return cudaSuccess;
  const cudaError_t e =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess) configured.fetch_or(bit, std::memory_order_relaxed);
  return e;
}

int CurrentDeviceSmemPerSm() {
  return CachedAttribute(g_smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 228 * 1024);
}

int CurrentDeviceCtasBySmem(int smem_bytes) {
  constexpr int kSmemPerCtaReserved = 1024;
  return std::max(1, CurrentDeviceSmemPerSm() / (smem_bytes + kSmemPerCtaReserved));
}

}  // namespace jax_kv
