// Out-of-place cache growth: launcher.
#pragma once

#include <cuda_runtime.h>

#include "cuda/gqa_params.h"

namespace jax_kv {

// Copies the live prefix [0, lengths[b]) of every (b, h) stripe from src to dst (16-byte
// vectors where rows and pointers allow) and zero-fills the rest of dst. A lengths[b] outside
// [0, S_old] latches JKV_STATUS_LENGTH_OUT_OF_RANGE and leaves b's new stripe all zeros.
cudaError_t LaunchGrowCache(const GrowParams& p, cudaStream_t stream);

}  // namespace jax_kv
