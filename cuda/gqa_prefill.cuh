// GQA prefill (tiled flash attention over past + new tokens, append fused in): launcher.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/gqa_params.h"

namespace jax_kv {

// The prefill handler's `kernel` attribute (jax_kv.ops.gqa_prefill's `_kernel` hook). kAuto: the
// wgmma kernel (cuda/gqa_prefill_wgmma.cu) where WgmmaPrefillTakes the call on a
// compute-capability 9.0 device, the mma.sync kernel otherwise; kMma: always the mma.sync kernel
// (f32 takes its own path either way).
enum class PrefillKernel : int32_t { kAuto = 0, kMma = 1 };

// Whether the wgmma kernel is built for a call: 2-byte elements (bf16, f16) and a head dim of
// whole 64-element swizzle-atom columns it is instantiated for (64, 128).
constexpr bool WgmmaPrefillTakes(int head_dim, int itemsize) {
  return itemsize == 2 && (head_dim == 64 || head_dim == 128);
}

// Whether LaunchGqaPrefill runs the wgmma kernel for this choice, head dim and element size
// on the current device.
bool PrefillUsesWgmma(PrefillKernel kernel, int head_dim, int itemsize);

// Writes new_lengths[b] tokens' K/V at lengths[b]..., and out[b, t] = causal attention of
// query t over positions [max(0, P + 1 - window), P], P = lengths[b] + t; rows t >=
// new_lengths[b] are zero. status[b] is set for every b; a bad lengths[b] / new_lengths[b]
// latches its code, leaves b's cache untouched and makes out[b] NaN. The packed form
// (p.cu_seqlens set, q [N, Hq, D]) is the same with sequence b's tokens at rows
// cu_seqlens[b] ...: a refused b's token rows are NaN, the padding rows [cu_seqlens[B], N)
// zero, and a malformed cu_seqlens latches JKV_STATUS_BAD_CU_SEQLENS for every b (all of out
// NaN, no cache written). Instantiated for every supported head dim (cuda/head_dims.h) and
// dtype in cuda/gqa_prefill.cu.
template <typename T, int HEAD_DIM>
cudaError_t LaunchGqaPrefill(const GqaParams<T>& p, cudaStream_t stream,
                             PrefillKernel kernel = PrefillKernel::kAuto);

}  // namespace jax_kv
