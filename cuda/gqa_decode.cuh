// GQA decode (split-K flash decoding with the append fused in): launcher and workspace size.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "cuda/gqa_params.h"

namespace jax_kv {

// Split count of the decode grid: from the SM count of the current device and the number of
// (b, kv head, head chunk) CTAs, never from the capacity S, so a max_len cache costs nothing.
int GqaDecodeNumSplits(int batch, int num_q_heads, int num_kv_heads);

// float32 workspace the decode op needs for split-K partials, for any Hkv dividing Hq (the
// Python side sizes it before it knows the handler's split choice; Hkv = 1 is the worst case).
int64_t GqaDecodeWorkspaceFloats(int batch, int num_q_heads, int head_dim);

// Appends the new token's K/V at lengths[b] and writes out = attention over
// [max(0, L + 1 - window), L]; status[b] is set for every b. Out-of-range lengths[b] latch
// JKV_STATUS_LENGTH_OUT_OF_RANGE, leave b's cache untouched and make out[b] NaN.
template <typename T>
cudaError_t LaunchGqaDecode(const GqaParams<T>& p, cudaStream_t stream);

// How a decode kernel cuts the attended positions: num_splits splits (before any workspace
// clamp) of a chunk that is a multiple of chunk_multiple and at least min_chunk tokens.
struct GqaDecodePlan {
  int num_splits, chunk_multiple, min_chunk;
};

// Kernel 2 (cuda/gqa_decode_v2.cuh): same contract as LaunchGqaDecode, one launch (cp.async
// pipelines, last-CTA split combine); its split counters come from a pool the kernel keeps at
// zero (or from the workspace, zeroed by a one-CTA kernel: g_split_counter_pool).
template <typename T>
cudaError_t LaunchGqaDecodeV2(const GqaParams<T>& p, cudaStream_t stream);

// Kernel 2's CTA shape (cuda/gqa_decode_v2.cuh): auto picks wide CTAs where the grid has fewer
// (b, KV head, head chunk) CTAs than the device has SMs, narrow ones otherwise; the other two
// force a shape (tests and benches). Read by the launcher and GqaDecodeV2Plan on each call.
enum DecodeV2Ctas : int { kDecodeV2Auto = 0, kDecodeV2Narrow = 1, kDecodeV2Wide = 2 };
extern std::atomic<int> g_decode_v2_ctas;

// Where kernels 2 and 3 keep their split counters: true (default), a device-memory pool the
// kernels keep at zero, no zeroing node; false, the workspace, zeroed by a kernel node before
// each launch (the path calls too large for the pool take). Read on each launch.
extern std::atomic<bool> g_split_counter_pool;

namespace split_decode {
constexpr int kCounterPoolWords = 1 << 18;  // words of each unit's split-counter pool
constexpr int kCounterRegionMaxWords = kCounterPoolWords / 64;
// The offset of n zeroed words in the split-counter pool (g_split_counters) for the launch the
// caller is about to make, or -1 (pool off, n too large): then the workspace's words, zeroed by
// a kernel node, serve. Defined in cuda/gqa_decode_v2.cu. No launch has to zero a region: the
// last CTA of each (b, KV head, head chunk) resets its word. What that saves per decode launch
// is the zeroing node: 0.8 us of device time and one graph node (H200, bench/NOTES.md). Each host
// call takes the next region, so the nodes of one recorded CUDA graph never share words, and a
// region comes round again only after the whole pool has been handed out (kCounterPoolWords / 32
// calls at the least; a region never wraps: a tail too short for it is skipped): launches on one
// stream run in order, and XLA runs a device's kernels on one compute stream. Exported to Python as
// _take_counter_region for the region test.
int TakeCounterRegion(int n);
}  // namespace split_decode

// Kernel 3 (cuda/gqa_decode_mma.cu): kernel 2's grid with the tile math on tensor cores, for bf16
// and f16 at head dims 64/80/96/128; other calls run kernel 2. Same workspace as kernel 2.
template <typename T>
cudaError_t LaunchGqaDecodeMma(const GqaParams<T>& p, cudaStream_t stream);

// Kernel 3's split plan (kernel 2's where kernel 3 hands the call to kernel 2).
GqaDecodePlan GqaDecodeMmaPlan(int batch, int num_q_heads, int num_kv_heads, int head_dim,
                               int itemsize);

// Kernel 2's workspace: kernel 1's partials plus B * Hq counter words (an upper bound).
int64_t GqaDecodeV2WorkspaceFloats(int batch, int num_q_heads, int head_dim);

// Kernel 2's split plan on the current device; itemsize 2 (bf16, f16) or 4 (f32).
GqaDecodePlan GqaDecodeV2Plan(int batch, int num_q_heads, int num_kv_heads, int head_dim,
                              int itemsize);

}  // namespace jax_kv
