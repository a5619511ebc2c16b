// Which kernels the CUDA handlers launch, set from Python and read by a handler's host code each
// time it runs, i.e. when XLA records or runs without a command buffer: a replayed CUDA graph
// keeps the kernels it was recorded with.
#pragma once

#include <atomic>

namespace jax_kv {

// Decode: 1 (cuda/gqa_decode.cu), 2 (cuda/gqa_decode_v2.cu) or 3 (cuda/gqa_decode_mma.cu); set
// by set_decode_kernel / JAX_KV_DECODE_KERNEL. Defined in module_cuda.cc; 3 unless set.
extern std::atomic<int> g_decode_kernel;

// Prefill: a PrefillKernel (cuda/gqa_prefill.cuh), set by set_prefill_kernel; kAuto unless set.
extern std::atomic<int> g_prefill_kernel;

}  // namespace jax_kv
