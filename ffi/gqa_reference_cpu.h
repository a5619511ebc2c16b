// The CPU reference semantics of gqa_decode / gqa_prefill (DESIGN.md, Ops): append the new
// K/V at lengths[b], then causal (optionally windowed, soft-capped) GQA attention in f32.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/dtypes.h"
#include "cuda/gqa_params.h"
#include "ffi/common.h"
#include "ffi/cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace jax_kv {

// The CPU handlers latch a bad sequence like the CUDA kernels do (its rows NaN, its cache
// untouched, the call succeeds) rather than failing the call: a failed call under jit with
// donation would delete the caller's cache, valid rows included. Rows and status come from
// prefill_rows (cuda/gqa_params.h), the same function the kernels call.
template <typename T>
void RunGqaReferenceCpu(const GqaParams<T>& p) {
  const int64_t D = p.head_dim, Hq = p.num_q_heads, Hkv = p.num_kv_heads;
  const int64_t group = Hq / Hkv;
  bool cu_ok = true;
  for (int64_t i = 0; p.cu_seqlens && i <= p.batch; ++i) cu_ok &= !cu_seqlens_entry_bad(p, i);
  std::vector<PrefillRows> rows(p.batch);
  for (int64_t b = 0; b < p.batch; ++b) {
    rows[b] = prefill_rows(p, b, cu_ok);
    p.status[b] = rows[b].status;
  }
  // 1. Append: the new tokens' K/V go to positions lengths[b] + t, t < n_new.
  for (int64_t b = 0; b < p.batch; ++b) {
    if (rows[b].status != JKV_STATUS_OK) continue;
    for (int64_t t = 0; t < rows[b].n_new; ++t) {
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t src = ((rows[b].row0 + t) * Hkv + h) * D;
        const int64_t dst = kv_offset(p.cache, b, p.lengths[b] + t, h);
        std::memcpy(p.k_cache + dst, p.k_new + src, D * sizeof(T));
        std::memcpy(p.v_cache + dst, p.v_new + src, D * sizeof(T));
      }
    }
  }
  // 2. Attend: one work item per (b, kv head); its `group` query heads read the stripe.
  int64_t work = 0;  // multiply-adds: 2 per (query row, position, dim)
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t n = rows[b].n_new;
    if (rows[b].status == JKV_STATUS_OK) work += 2 * n * (p.lengths[b] + n) * Hq * D;
  }
  ParallelFor(p.batch * Hkv, work, [&](int64_t item) {
    const int64_t b = item / Hkv, h = item % Hkv;
    const PrefillRows& r = rows[b];
    const bool ok = r.status == JKV_STATUS_OK;
    const int64_t L = p.lengths[b], n = ok ? r.n_new : 0;
    std::vector<float> qf(D), acc(D), scores(static_cast<size_t>(n > 0 ? L + n : 0));
    for (int64_t t = 0; t < r.out_rows; ++t) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t qh = h * group + g;
        T* out = p.out + ((r.row0 + t) * Hq + qh) * D;
        if (t >= n) {  // a refused sequence's rows are NaN; rows past its new tokens zeros
          const float fill = !ok && t < r.nan_rows ? NAN : 0.0f;
          for (int64_t d = 0; d < D; ++d) out[d] = from_float<T>(fill);
          continue;
        }
        const T* q = p.q + ((r.row0 + t) * Hq + qh) * D;
        for (int64_t d = 0; d < D; ++d) qf[d] = to_float(q[d]);
        const int64_t hi = L + t;
        const int64_t lo = p.window > 0 ? std::max<int64_t>(0, hi + 1 - p.window) : 0;
        float m = -INFINITY;
        for (int64_t s = lo; s <= hi; ++s) {
          const T* k = p.k_cache + kv_offset(p.cache, b, s, h);
          float dot = 0.0f;
          for (int64_t d = 0; d < D; ++d) dot += qf[d] * to_float(k[d]);
          float score = dot * p.scale;
          if (p.softcap > 0.0f) score = p.softcap * std::tanh(score / p.softcap);
          scores[s - lo] = score;
          m = std::max(m, score);
        }
        float denom = 0.0f;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t s = lo; s <= hi; ++s) {
          const float w = std::exp(scores[s - lo] - m);
          denom += w;
          const T* v = p.v_cache + kv_offset(p.cache, b, s, h);
          for (int64_t d = 0; d < D; ++d) acc[d] += w * to_float(v[d]);
        }
        for (int64_t d = 0; d < D; ++d) out[d] = from_float<T>(acc[d] / denom);
      }
    }
  });
}

}  // namespace jax_kv

namespace jax_kv {

// Shared by the decode and prefill CPU handlers: check, fill params, check lengths, run.
template <typename T>
xla::ffi::Error GqaCpuImpl(xla::ffi::AnyBuffer q, xla::ffi::AnyBuffer k, xla::ffi::AnyBuffer v,
                           xla::ffi::AnyBuffer k_cache, xla::ffi::AnyBuffer v_cache,
                           xla::ffi::Buffer<xla::ffi::S32> lengths, NewTokens tokens,
                           xla::ffi::Buffer<xla::ffi::S32> committed,
                           xla::ffi::Result<xla::ffi::AnyBuffer> out,
                           xla::ffi::Result<xla::ffi::Buffer<xla::ffi::S32>> status,
                           xla::ffi::Result<xla::ffi::Buffer<xla::ffi::F32>> workspace,
                           int32_t layout, float scale, float softcap, int32_t window) {
  GqaParams<T> p;
  xla::ffi::Error err = FillGqaParams<T>(q, k, v, k_cache, v_cache, lengths, tokens, committed, out,
                                         status, workspace, layout, scale, softcap, window, &p);
  if (err.failure()) return err;
  RunGqaReferenceCpu(p);
  return xla::ffi::Error::Success();
}

}  // namespace jax_kv
