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

// Decode is prefill with T = 1: q [B, Hq, D] is read as [B, 1, Hq, D].
template <typename T>
struct GqaParams {
  const T* q;                  // [B, T, Hq, D]
  const T* k_new;              // [B, T, Hkv, D], rotated keys of the new tokens
  const T* v_new;              // [B, T, Hkv, D]
  T* k_cache;                  // [B, Hkv, S, D] or [B, S, Hkv, D]: use `cache` strides
  T* v_cache;                  // same geometry as k_cache
  T* out;                      // [B, T, Hq, D]; rows t >= new_lengths[b] are zero
  const int32_t* lengths;      // [B], tokens cached before this call
  const int32_t* new_lengths;  // [B] tokens of this call to write, or nullptr (= T)
  const int32_t* committed;    // [B] positions backed by committed memory, or nullptr (= S)
  int32_t* status;             // [B], 0 = ok, else a JKV_STATUS_* code
  float* workspace;            // split-K partials; may be nullptr when unused
  int64_t workspace_floats;    // size of workspace
  KvStrides cache;             // strides of k_cache and v_cache (elements)
  int32_t batch;               // B
  int32_t num_tokens;          // T (1 for decode)
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

// Status codes a kernel latches into `status[b]` instead of touching memory past S.
enum : int32_t {
  JKV_STATUS_OK = 0,
  JKV_STATUS_LENGTH_OUT_OF_RANGE = 1,      // lengths[b] < 0 or lengths[b] + new tokens >
                                           // min(S, committed[b])
  JKV_STATUS_NEW_LENGTH_OUT_OF_RANGE = 2,  // new_lengths[b] < 0 or > T
};

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
