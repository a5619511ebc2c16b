// GQA decode (one-launch split-K flash decoding with the append fused in): which of its two
// kernels a call runs, their launchers, split plan and workspace size. Plain C++ over
// cuda_runtime.h: the handlers (ffi/gqa_decode.cc, ffi/module_cuda.cc) include it.
//
// Two kernels share one grid, split plan, cp.async rings, fused append and last-CTA merge
// (cuda/gqa_decode_split.cuh) and differ in the tile math:
//   mma   tensor cores, mma.sync m16n8k16 with f32 accumulation (cuda/gqa_decode_mma.cu): bf16
//         and f16 at head dims that are whole 16-column k-steps and fit its registers (<= 128);
//   simt  CUDA cores, f32 FMAs (cuda/gqa_decode_simt.cuh): every dtype and head dim.
// A call runs mma where mma takes it, simt otherwise: a function of (dtype, head dim) alone.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/gqa_params.h"

namespace jax_kv {

// The decode handler's `kernel` attribute: kAuto in the library; kSimt and kMma force one (tests
// and benchmarks, through jax_kv.ops.gqa_decode's `_kernel` hook).
enum class DecodeKernel : int32_t { kAuto = 0, kSimt = 1, kMma = 2 };

// The `cta_shape` attribute. Narrow CTAs: 4 warps, several CTAs per SM, for grids with at least
// one (b, KV head, head chunk) per SM. Wide: one CTA per SM with more warps, for grids with
// fewer (bench/NOTES.md, "kernel 2, wide CTAs"). kAuto picks by that rule on the current device.
enum class DecodeCtas : int32_t { kAuto = 0, kNarrow = 1, kWide = 2 };

// The `split_counters` attribute: where a split call's per-(b, KV head, head chunk) counters
// live. kPool: device memory the kernels keep at zero, no zeroing node (the default);
// kWorkspace: the workspace's tail, zeroed by a one-CTA kernel node before each launch (the
// path a call too large for the pool takes anyway).
enum class SplitCounters : int32_t { kPool = 0, kWorkspace = 1 };

// The most splits of one row's positions (beyond it the partials' traffic outgrows the gain).
constexpr int kDecodeMaxSplits = 256;

// The choices one decode launch runs with, kernel resolved (kSimt or kMma). `splits`, the
// `splits` attribute: 0 plans the split count from the grid's CTA count (so from the batch);
// n > 0 plans n splits whatever the batch, with a CTA shape that does not follow the batch
// either: a row's chunks, and so its summation order, are then a function of its length alone
// (the batch-invariant mode, jax_kv.config's batch_invariant).
struct DecodeOptions {
  DecodeKernel kernel;
  DecodeCtas ctas;
  SplitCounters counters;
  int splits;
};

constexpr int kDecodeMaxGroup = 8;  // query heads per CTA; more take several head chunks

constexpr int DecodeHeadChunks(int group) {
  return (group + kDecodeMaxGroup - 1) / kDecodeMaxGroup;
}

// Whether the mma kernel takes a call: 2-byte elements (bf16, f16), a head dim of whole 16-column
// k-steps whose accumulators fit its registers (MmaShape's static_asserts): 64, 80, 96, 128.
constexpr bool MmaDecodeTakes(int head_dim, int itemsize) {
  return itemsize == 2 && head_dim % 16 == 0 && head_dim <= 128;
}

// What is wrong with a call's (kernel, cta_shape, split_counters, splits) attributes for this head
// dim and item size, or "" when nothing is: each in range, and a forced mma only where mma takes
// the call.
inline std::string DecodeOptionsError(int32_t kernel, int32_t cta_shape, int32_t split_counters,
                                      int32_t splits, int head_dim, int itemsize) {
  if (kernel < 0 || kernel > 2) {
    return "kernel: expected 0 (auto), 1 (simt) or 2 (mma), got " + std::to_string(kernel);
  }
  if (cta_shape < 0 || cta_shape > 2) {
    return "cta_shape: expected 0 (auto), 1 (narrow) or 2 (wide), got " + std::to_string(cta_shape);
  }
  if (split_counters < 0 || split_counters > 1) {
    return "split_counters: expected 0 (pool) or 1 (workspace), got " +
           std::to_string(split_counters);
  }
  if (splits < 0 || splits > kDecodeMaxSplits) {
    return "splits: expected 0 (planned from the batch) to " + std::to_string(kDecodeMaxSplits) +
           ", got " + std::to_string(splits);
  }
  if (static_cast<DecodeKernel>(kernel) == DecodeKernel::kMma &&
      !MmaDecodeTakes(head_dim, itemsize)) {
    return "kernel: mma takes bf16/f16 at head dims 64, 80, 96 and 128, got itemsize " +
           std::to_string(itemsize) + " and head_dim " + std::to_string(head_dim);
  }
  return "";
}

// The options of a call whose attributes DecodeOptionsError accepted: auto resolves to mma where
// mma takes the call, to simt elsewhere; the auto CTA shape to narrow where the splits are fixed
// (auto picks wide CTAs for small grids, a choice of the batch).
inline DecodeOptions MakeDecodeOptions(int32_t kernel, int32_t cta_shape, int32_t split_counters,
                                       int32_t splits, int head_dim, int itemsize) {
  DecodeKernel k = static_cast<DecodeKernel>(kernel);
  if (k == DecodeKernel::kAuto) {
    k = MmaDecodeTakes(head_dim, itemsize) ? DecodeKernel::kMma : DecodeKernel::kSimt;
  }
  DecodeCtas ctas = static_cast<DecodeCtas>(cta_shape);
  if (ctas == DecodeCtas::kAuto && splits > 0) ctas = DecodeCtas::kNarrow;
  return DecodeOptions{k, ctas, static_cast<SplitCounters>(split_counters), splits};
}

// How a kernel cuts the attended positions: num_splits splits (before the workspace clamp) of
// a chunk that is a multiple of chunk_multiple and at least min_chunk tokens. From the SM count
// of the current device and the number of (b, KV head, head chunk) CTAs (or the call's fixed
// `splits`), never from the capacity S: a max_len cache costs nothing.
struct GqaDecodePlan {
  int num_splits, chunk_multiple, min_chunk;
};

// float32 workspace a call with this plan needs: the split partials (acc [B, Hq, splits, D],
// then (m, l) [B, Hq, splits, 2]) and one counter word per (b, KV head, head chunk); none
// without splits.
inline int64_t GqaDecodeWorkspaceFloats(const GqaDecodePlan& plan, int batch, int num_q_heads,
                                        int num_kv_heads, int head_dim) {
  if (plan.num_splits <= 1 || num_kv_heads <= 0) return 0;
  const int64_t ctas =
      static_cast<int64_t>(batch) * num_kv_heads * DecodeHeadChunks(num_q_heads / num_kv_heads);
  return static_cast<int64_t>(batch) * num_q_heads * plan.num_splits * (head_dim + 2) + ctas;
}

// The kernels, per element type T and head dim (instantiated for every supported head dim in
// cuda/gqa_decode_simt{,_bf16,_f16}.cu and cuda/gqa_decode_mma.cu). Each appends the new token's
// K/V at lengths[b] and writes out = attention over [max(0, L + 1 - window), L]; status[b] is set
// for every b. An out-of-range lengths[b] latches JKV_STATUS_LENGTH_OUT_OF_RANGE, leaves b's cache
// untouched and makes out[b] NaN. The mma launcher returns cudaErrorInvalidValue where
// MmaDecodeTakes is false.
template <typename T, int HEAD_DIM>
cudaError_t LaunchGqaDecodeSimt(const GqaParams<T>& p, const DecodeOptions& o, cudaStream_t stream);
template <typename T, int HEAD_DIM>
cudaError_t LaunchGqaDecodeMma(const GqaParams<T>& p, const DecodeOptions& o, cudaStream_t stream);

// Their split plans on the current device (sizeof(T) is what matters: bf16 and f16 plan alike).
template <typename T, int HEAD_DIM>
GqaDecodePlan GqaDecodeSimtPlan(int batch, int num_q_heads, int num_kv_heads,
                                const DecodeOptions& o);
template <typename T, int HEAD_DIM>
GqaDecodePlan GqaDecodeMmaPlan(int batch, int num_q_heads, int num_kv_heads,
                               const DecodeOptions& o);

// The launch of a call with resolved options `o` (MakeDecodeOptions): the one place the kernel
// is picked.
template <typename T, int HEAD_DIM>
cudaError_t LaunchGqaDecode(const GqaParams<T>& p, const DecodeOptions& o, cudaStream_t stream) {
  if constexpr (MmaDecodeTakes(HEAD_DIM, sizeof(T))) {
    if (o.kernel == DecodeKernel::kMma) return LaunchGqaDecodeMma<T, HEAD_DIM>(p, o, stream);
  }
  return LaunchGqaDecodeSimt<T, HEAD_DIM>(p, o, stream);
}

// The split plan of the kernel LaunchGqaDecode runs for the same call.
template <typename T, int HEAD_DIM>
GqaDecodePlan PlanGqaDecode(int batch, int num_q_heads, int num_kv_heads, const DecodeOptions& o) {
  if constexpr (MmaDecodeTakes(HEAD_DIM, sizeof(T))) {
    if (o.kernel == DecodeKernel::kMma) {
      return GqaDecodeMmaPlan<T, HEAD_DIM>(batch, num_q_heads, num_kv_heads, o);
    }
  }
  return GqaDecodeSimtPlan<T, HEAD_DIM>(batch, num_q_heads, num_kv_heads, o);
}

namespace split_decode {
constexpr int kCounterPoolWords = 1 << 18;  // words of each unit's split-counter pool
constexpr int kCounterRegionMaxWords = kCounterPoolWords / 64;
// The offset of n zeroed words in the split-counter pool (g_split_counters) for the launch the
// caller is about to make, or -1 (n too large): then the workspace's words, zeroed by a kernel
// node, serve. Defined in cuda/gqa_decode_simt.cu. No launch has to zero a region: the last CTA
// of each (b, KV head, head chunk) resets its word. What that saves per decode launch is the
// zeroing node: 0.8 us of device time and one graph node (H200, bench/NOTES.md). Each host call
// takes the next region, so the nodes of one recorded CUDA graph never share words, and a region
// comes round again only after the whole pool has been handed out (kCounterPoolWords / 32 calls
// at the least; a region never wraps: a tail too short for it is skipped): launches on one stream
// run in order, and XLA runs a device's kernels on one compute stream. Exported to Python as
// _take_counter_region for the region test.
int TakeCounterRegion(int n);
}  // namespace split_decode

}  // namespace jax_kv
