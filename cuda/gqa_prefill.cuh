// GQA prefill (tiled flash attention over past + new tokens, append fused in): launcher.
#pragma once

#include <cuda_runtime.h>

#include "cuda/gqa_params.h"

namespace jax_kv {

// Writes new_lengths[b] tokens' K/V at lengths[b]..., and out[b, t] = causal attention of
// query t over positions [max(0, P + 1 - window), P], P = lengths[b] + t; rows t >=
// new_lengths[b] are zero. status[b] is set for every b; a bad lengths[b] / new_lengths[b]
// latches its code, leaves b's cache untouched and makes out[b] NaN.
// kAuto: the wgmma kernel (cuda/gqa_prefill_wgmma.cu) for bf16/f16 at head dims 64 and 128 on a
// compute-capability 9.0 device, the mma.sync kernel otherwise; kMma: always the mma.sync
// kernel (f32 takes its own path either way).
enum class PrefillKernel { kAuto = 0, kMma = 1 };

// Whether LaunchGqaPrefill runs the wgmma kernel for this choice, head dim and element size
// on the current device.
bool PrefillUsesWgmma(PrefillKernel kernel, int head_dim, int itemsize);

template <typename T>
cudaError_t LaunchGqaPrefill(const GqaParams<T>& p, cudaStream_t stream,
                             PrefillKernel kernel = PrefillKernel::kAuto);

}  // namespace jax_kv
