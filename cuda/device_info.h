// Cached per-device properties the launchers size their grids from (no XLA headers here).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace jax_kv {

// Multiprocessor count of the current device, read once per device: cudaDeviceGetAttribute
// costs ~1 us, and the handlers run on every (non-graph) step.
int CurrentDeviceSmCount();

// Compute capability of the current device as 10 * major + minor (90 for the H100/H200): the
// sm_90a kernels (wgmma) run on 90 only.
int CurrentDeviceComputeCapability();

// Opt-in limit of dynamic shared memory per block on the current device.
int CurrentDeviceMaxSmemOptin();

// Shared memory per multiprocessor on the current device (all resident CTAs together).
int CurrentDeviceSmemPerSm();

// CTAs of smem_bytes dynamic shared memory that fit one multiprocessor of the current device,
// counting the runtime's 1 KB reservation per CTA (at least 1).
int CurrentDeviceCtasBySmem(int smem_bytes);

// Lets `kernel` launch with up to `bytes` of dynamic shared memory on the current device. The
// opt-in past 48 KB is a per-function, per-device attribute (host-side, allowed while XLA
// records a command buffer); `configured` holds one bit per device already raised, so the
// runtime is called once per device and kernel. It is raised for any `bytes`: the kernel's
// static shared memory counts toward the 48 KB default too (decode kernel 3 at D=64 takes
// exactly 48 KB of ring plus 384 B of static, and its launch failed without the opt-in).
cudaError_t AllowDynamicSmem(const void* kernel, int bytes, std::atomic<uint64_t>& configured);

}  // namespace jax_kv
