// Which decode kernel the CUDA handler launches: 1 (cuda/gqa_decode.cu), 2
// (cuda/gqa_decode_v2.cu) or 3 (cuda/gqa_decode_mma.cu). Set from Python (set_decode_kernel,
// JAX_KV_DECODE_KERNEL); read by the handler's host code each time it runs, i.e. when XLA records
// or runs without a command buffer: a replayed CUDA graph keeps the kernel it was recorded with.
#pragma once

#include <atomic>

namespace jax_kv {

// Defined in module_cuda.cc; 3 unless set.
extern std::atomic<int> g_decode_kernel;

}  // namespace jax_kv
