// Cached per-device properties the launchers size their grids from (no XLA headers here).
#pragma once

#include <cuda_runtime.h>

namespace jax_kv {

// Multiprocessor count of the current device, read once per device: cudaDeviceGetAttribute
// costs ~1 us, and the handlers run on every (non-graph) step.
int CurrentDeviceSmCount();

// Opt-in limit of dynamic shared memory per block on the current device.
int CurrentDeviceMaxSmemOptin();

// Shared memory per multiprocessor on the current device (all resident CTAs together).
int CurrentDeviceSmemPerSm();

// CTAs of smem_bytes dynamic shared memory that fit one multiprocessor of the current device,
// counting the runtime's 1 KB reservation per CTA (at least 1).
int CurrentDeviceCtasBySmem(int smem_bytes);

}  // namespace jax_kv
