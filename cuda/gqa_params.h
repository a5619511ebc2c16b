// Parameters of the GQA attention and cache-growth kernels: raw pointers plus element strides.
// Plain C++ (no XLA, no CUDA headers) so the CPU reference and the CUDA kernels share it.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JKV_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JKV_HOST_DEVICE inline
#endif

namespace jax_kv {

// Element strides of one cache array; the head_dim stride is always 1.
// HEAD_MAJOR [B, Hkv, S, D]: b = Hkv*S*D, h = S*D, s = D.
// SEQ_MAJOR  [B, S, Hkv, D]: b = S*Hkv*D, s = Hkv*D, h = D.
struct KvStrides {
  int64_t b, s, h;
};

// The one addressing helper: kernels never branch on the layout, they read these strides.
JKV_HOST_DEVICE int64_t kv_offset(const KvStrides& st, int64_t b, int64_t pos, int64_t h) {
  return b * st.b + pos * st.s + h * st.h;
}

// Decode is prefill with T = 1: q [B, Hq, D] is read as [B, 1, Hq, D]. The packed prefill form
// (cu_seqlens set) holds the new tokens of all B sequences on one axis of N rows: q [N, Hq, D],
// sequence b's at rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1. Kernels address the token rows
// of q, k_new, v_new and out through row_token_start / row_new_tokens / row_out_rows, never
// through b * T, so one kernel serves both forms.
template <typename T>
struct GqaParams {
  const T* q;                  // [B, T, Hq, D], or [N, Hq, D] packed
  const T* k_new;              // [B, T, Hkv, D] (or [N, Hkv, D]), rotated keys of the new tokens
  const T* v_new;              // [B, T, Hkv, D] (or [N, Hkv, D])
  T* k_cache;                  // [B, Hkv, S, D] or [B, S, Hkv, D]: use `cache` strides
  T* v_cache;                  // same geometry as k_cache
  T* out;                      // like q; rows past a sequence's new tokens are zero
  const int32_t* lengths;      // [B], tokens cached before this call
  const int32_t* new_lengths;  // [B] tokens of this call to write, or nullptr (= T); padded form
  const int32_t* cu_seqlens;   // [B + 1] packed row offsets, or nullptr (the padded form)
  const int32_t* committed;    // [B] positions backed by committed memory, or nullptr (= S)
  int32_t* status;             // [B], 0 = ok, else a JKV_STATUS_* code
  float* workspace;            // split-K partials; may be nullptr when unused
  int64_t workspace_floats;    // size of workspace
  KvStrides cache;             // strides of k_cache and v_cache (elements)
  int32_t batch;               // B
  int32_t num_tokens;          // T (1 for decode), or N packed
  int32_t num_q_heads;         // Hq
  int32_t num_kv_heads;        // Hkv, Hq % Hkv == 0
  int32_t head_dim;            // D
  int32_t capacity;            // S
  float scale;                 // applied to q.k before softcap
  float softcap;               // 0 = off, else scores become softcap * tanh(s / softcap)
  int32_t window;              // 0 = off, else attend to the last `window` positions
};

// The positions of sequence b a kernel may write: the array's S, or less where the cache's
// memory is committed only up to committed[b] (a VMM view reserved at max_len whose tail is a
// read-only zero granule: a write there is an illegal address, so it must never happen).
template <typename T>
JKV_HOST_DEVICE int32_t writable_capacity(const GqaParams<T>& p, int64_t b) {
  if (p.committed == nullptr) return p.capacity;
  const int32_t c = p.committed[b];
  return c < p.capacity ? c : p.capacity;
}

// Whether sequence b is idle in this call: committed[b] == 0 (no memory behind its row: an
// engine's free slot). An idle row is not read or written and costs no attention work, whatever
// new tokens or lengths the call gives it; its output rows are zeros and its status is OK. So a
// step compiled for every slot of a cache serves any set of live requests, with no NaN in the
// free rows. (A row with memory committed and too little of it still latches status 1.)
template <typename T>
JKV_HOST_DEVICE bool row_idle(const GqaParams<T>& p, int64_t b) {
  return p.committed != nullptr && p.committed[b] == 0;
}

// Status codes a kernel latches into `status[b]` instead of touching memory past S.
enum : int32_t {
  JKV_STATUS_OK = 0,
  JKV_STATUS_LENGTH_OUT_OF_RANGE = 1,      // lengths[b] < 0 or lengths[b] + new tokens >
                                           // min(S, committed[b])
  JKV_STATUS_NEW_LENGTH_OUT_OF_RANGE = 2,  // new_lengths[b] < 0 or > T
  JKV_STATUS_BAD_CU_SEQLENS = 3,           // packed: cu_seqlens[0] != 0, decreasing, or
                                           // cu_seqlens[B] > N (latched for every b)
};

// The packed row (of q, k_new, v_new and out) of sequence b's first new token.
template <typename T>
JKV_HOST_DEVICE int64_t row_token_start(const GqaParams<T>& p, int64_t b) {
  return p.cu_seqlens ? p.cu_seqlens[b] : b * p.num_tokens;
}

// The new tokens sequence b brings to this call.
template <typename T>
JKV_HOST_DEVICE int32_t row_new_tokens(const GqaParams<T>& p, int64_t b) {
  if (p.cu_seqlens) return p.cu_seqlens[b + 1] - p.cu_seqlens[b];
  return p.new_lengths ? p.new_lengths[b] : p.num_tokens;
}

// The rows of out sequence b owns from row_token_start on: its T rows in the padded form; in
// the packed form its tokens, and for the last sequence also the padding rows up to N, so
// that every row of out has exactly one owner that writes it.
template <typename T>
JKV_HOST_DEVICE int32_t row_out_rows(const GqaParams<T>& p, int64_t b) {
  if (p.cu_seqlens == nullptr) return p.num_tokens;
  const int32_t end = b == p.batch - 1 ? p.num_tokens : p.cu_seqlens[b + 1];
  return end - p.cu_seqlens[b];
}

// Whether entry i of a packed call's cu_seqlens breaks its contract (cu_seqlens[0] == 0,
// non-decreasing, cu_seqlens[B] <= N). A call is well formed when no entry does: then every
// sequence's rows lie in [0, N) and no two overlap.
template <typename T>
JKV_HOST_DEVICE bool cu_seqlens_entry_bad(const GqaParams<T>& p, int64_t i) {
  const int32_t c = p.cu_seqlens[i];
  if (i == 0) return c != 0;
  return c < p.cu_seqlens[i - 1] || (i == p.batch && c > p.num_tokens);
}

// What a prefill (or decode) call does with sequence b's rows of out (rows row0 ...): with
// status OK it computes rows [0, n_new) and appends their K/V; otherwise it writes NaN to rows
// [0, nan_rows) and touches nothing of b's cache; it writes zeros to the rest of [0, out_rows).
struct PrefillRows {
  int64_t row0;
  int32_t n_new, out_rows, nan_rows, status;
};

// `cu_ok`: no entry of cu_seqlens is bad (always true in the padded form). A malformed
// cu_seqlens gives no sequence a row range: every b latches JKV_STATUS_BAD_CU_SEQLENS and the
// last one owns all N rows, made NaN.
template <typename T>
JKV_HOST_DEVICE PrefillRows prefill_rows(const GqaParams<T>& p, int64_t b, bool cu_ok) {
  if (!cu_ok) {
    const int32_t all = b == p.batch - 1 ? p.num_tokens : 0;
    return PrefillRows{0, 0, all, all, JKV_STATUS_BAD_CU_SEQLENS};
  }
  PrefillRows r;
  r.row0 = row_token_start(p, b);
  r.n_new = row_new_tokens(p, b);
  r.out_rows = row_out_rows(p, b);
  // A refused sequence's padding rows stay zero in the packed form (other sequences' rows
  // follow them); in the padded form all T rows are NaN, as before the packed form existed.
  r.nan_rows = p.cu_seqlens ? r.n_new : r.out_rows;
  if (row_idle(p, b)) {
    r.n_new = 0;
    r.status = JKV_STATUS_OK;
    return r;
  }
  const int64_t L = p.lengths[b];
  if (r.n_new < 0 || r.n_new > p.num_tokens) {
    r.status = JKV_STATUS_NEW_LENGTH_OUT_OF_RANGE;
  } else if (L < 0 || L + r.n_new > writable_capacity(p, b)) {
    r.status = JKV_STATUS_LENGTH_OUT_OF_RANGE;
  } else {
    r.status = JKV_STATUS_OK;
  }
  return r;
}

// Out-of-place growth: copy the live prefix of every (b, h) stripe into a larger cache.
// Type-agnostic: the copy moves bytes, so one kernel serves every dtype.
struct GrowParams {
  const uint8_t* src;      // [B, Hkv, S_old, D] or [B, S_old, Hkv, D]
  uint8_t* dst;            // same layout with S_new >= S_old; past the live prefix: zeros
  const int32_t* lengths;  // [B], live tokens per sequence
  int32_t* status;         // [B]
  KvStrides src_strides;   // elements
  KvStrides dst_strides;   // elements
  int32_t batch, num_kv_heads, head_dim;
  int32_t src_capacity, dst_capacity;
  int32_t elem_bytes;
};

}  // namespace jax_kv
