// Shared by the CPU and CUDA handlers: layout -> strides, buffer checks, params filling, the
// dtype dispatch (the head-dim one is cuda/head_dims.h), the FFI bindings. One place, so the two
// platforms cannot disagree on a contract.
#pragma once

#include <cstdint>
#include <string>

#include "cuda/dtypes.h"
#include "cuda/gqa_params.h"
#include "cuda/head_dims.h"
#include "xla/ffi/api/ffi.h"

namespace jax_kv {

namespace ffi = xla::ffi;

// Mirrors jax_kv.layout.Layout; the attribute the Python side passes.
enum class Layout : int32_t { kHeadMajor = 0, kSeqMajor = 1 };

// Geometry of one cache array, read off its dims through the layout's axis order.
struct CacheGeometry {
  int64_t batch, capacity, num_kv_heads, head_dim;
  KvStrides strides;
};

// Axis positions of (B, S, Hkv, D) per layout: adding a layout means adding a row here and
// in jax_kv/layout, nothing in the kernels.
struct AxisOrder {
  int b, s, h, d;
};

inline ffi::ErrorOr<AxisOrder> AxisOrderOf(int32_t layout) {
  switch (static_cast<Layout>(layout)) {
    case Layout::kHeadMajor:
      return AxisOrder{0, 2, 1, 3};
    case Layout::kSeqMajor:
      return AxisOrder{0, 1, 2, 3};
  }
  return ffi::Unexpected(ffi::Error::InvalidArgument(
      "layout: expected 0 (HEAD_MAJOR) or 1 (SEQ_MAJOR), got " + std::to_string(layout)));
}

inline ffi::ErrorOr<CacheGeometry> CacheGeometryOf(const char* name,
                                                   ffi::AnyBuffer::Dimensions dims,
                                                   int32_t layout) {
  auto order = AxisOrderOf(layout);
  if (order.has_error()) return ffi::Unexpected(order.error());
  if (dims.size() != 4) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        std::string(name) + ": expected rank 4, got rank " + std::to_string(dims.size())));
  }
  const AxisOrder& ax = *order;
  int64_t extent[4] = {dims[0], dims[1], dims[2], dims[3]};
  int64_t stride[4];
  stride[3] = 1;
  for (int i = 2; i >= 0; --i) stride[i] = stride[i + 1] * extent[i + 1];
  return CacheGeometry{extent[ax.b], extent[ax.s], extent[ax.h], extent[ax.d],
                       KvStrides{stride[ax.b], stride[ax.s], stride[ax.h]}};
}

inline ffi::Error InvalidArgument(const std::string& message) {
  return ffi::Error::InvalidArgument(message);
}

inline std::string DimsString(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// How a call's q, k, v and out carry the new tokens, and the per-sequence argument that says
// how many each sequence has.
struct NewTokens {
  enum Form {
    kDecode,  // q [B, Hq, D]: one token per sequence
    kPadded,  // q [B, T, Hq, D]: new_lengths[b] (or T) tokens of sequence b at rows b * T ...
    kPacked,  // q [N, Hq, D]: sequence b's tokens at rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1
  } form = kDecode;
  const int32_t* new_lengths = nullptr;  // kPadded: [B], or nullptr (= T)
  const int32_t* cu_seqlens = nullptr;   // kPacked: [B + 1]
};

// The prefill handlers' per-sequence argument (the one after lengths), read for their form:
// new_lengths int32 [B] (padded) or cu_seqlens int32 [B + 1] (packed). Its values are checked
// on the device (status), never read here: the CUDA handlers do no host reads.
inline ffi::ErrorOr<NewTokens> PrefillTokensOf(NewTokens::Form form, ffi::Buffer<ffi::S32> arg,
                                               ffi::Buffer<ffi::S32> lengths) {
  const size_t B = lengths.element_count();
  NewTokens tokens;
  tokens.form = form;
  if (form == NewTokens::kPacked) {
    if (arg.element_count() != B + 1) {
      return ffi::Unexpected(
          ffi::Error::InvalidArgument("cu_seqlens: expected int32 [B + 1=" + std::to_string(B + 1) +
                                      "], one more than lengths"));
    }
    tokens.cu_seqlens = arg.typed_data();
  } else {
    if (arg.element_count() != B) {
      return ffi::Unexpected(
          ffi::Error::InvalidArgument("new_lengths: expected int32 [B], the shape of lengths"));
    }
    tokens.new_lengths = arg.typed_data();
  }
  return tokens;
}

// Checks every buffer of a gqa_decode / gqa_prefill / gqa_prefill_packed call against the
// contract and fills the params. `tokens` says how q carries the new tokens (decode
// [B, Hq, D], padded [B, T, Hq, D], packed [N, Hq, D] with B from lengths). Data pointers are
// typed by the caller's dispatch.
template <typename Elem>
ffi::Error FillGqaParams(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                         ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                         ffi::Buffer<ffi::S32> lengths, NewTokens tokens,
                         ffi::Buffer<ffi::S32> committed, ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::Buffer<ffi::S32>> status,
                         ffi::Result<ffi::Buffer<ffi::F32>> workspace, int32_t layout, float scale,
                         float softcap, int32_t window, GqaParams<Elem>* p) {
  auto geo = CacheGeometryOf("k_cache", k_cache.dimensions(), layout);
  if (geo.has_error()) return geo.error();
  const bool packed = tokens.form == NewTokens::kPacked;
  const bool has_token_axis = tokens.form == NewTokens::kPadded;
  // By NewTokens::Form: decode, padded, packed.
  static constexpr const char* kQShape[] = {"[B, Hq, D]", "[B, T, Hq, D]", "[N, Hq, D]"};
  static constexpr const char* kKvShape[] = {"[B, Hkv, D]", "[B, T, Hkv, D]", "[N, Hkv, D]"};
  const int qrank = has_token_axis ? 4 : 3;
  if (q.dimensions().size() != static_cast<size_t>(qrank)) {
    return InvalidArgument("q: expected rank " + std::to_string(qrank) + " " +
                           kQShape[tokens.form] + ", got " + DimsString(q.dimensions()));
  }
  auto qd = q.dimensions();
  // Packed: q's leading axis is the N token rows; B is the batch of lengths and the cache.
  const int64_t B = packed ? static_cast<int64_t>(lengths.element_count()) : qd[0];
  const int64_t num_tokens = has_token_axis ? qd[1] : (packed ? qd[0] : 1);
  const int64_t Hq = qd[qrank - 2], D = qd[qrank - 1];
  const CacheGeometry& g = *geo;
  if (k_cache.dimensions().size() != v_cache.dimensions().size() ||
      k_cache.element_count() != v_cache.element_count()) {
    return InvalidArgument("v_cache: expected the shape of k_cache " +
                           DimsString(k_cache.dimensions()) + ", got " +
                           DimsString(v_cache.dimensions()));
  }
  for (size_t i = 0; i < 4; ++i) {
    if (k_cache.dimensions()[i] != v_cache.dimensions()[i]) {
      return InvalidArgument("v_cache: expected the shape of k_cache " +
                             DimsString(k_cache.dimensions()) + ", got " +
                             DimsString(v_cache.dimensions()));
    }
  }
  if (g.batch != B || g.head_dim != D) {
    return InvalidArgument("k_cache: expected batch " + std::to_string(B) + " and head_dim " +
                           std::to_string(D) + (packed ? " (from lengths and q)" : " (from q)") +
                           ", got " + DimsString(k_cache.dimensions()));
  }
  if (packed && B < 1) {
    return InvalidArgument("k_cache: expected B >= 1 sequences (the last owns the padding rows)");
  }
  const int64_t Hkv = g.num_kv_heads;
  if (Hkv <= 0 || Hq % Hkv != 0) {
    return InvalidArgument("q: expected a multiple of Hkv=" + std::to_string(Hkv) +
                           " query heads, got Hq=" + std::to_string(Hq));
  }
  if (!SupportedHeadDim(D)) return InvalidArgument("q: " + HeadDimError(D));
  for (auto [name, buf] : {std::pair{"k", &k}, std::pair{"v", &v}}) {
    auto d = buf->dimensions();
    const int64_t lead = packed ? num_tokens : B;  // k, v [B, ...] or [N, Hkv, D]
    bool ok = d.size() == static_cast<size_t>(qrank) && d[0] == lead && d[qrank - 2] == Hkv &&
              d[qrank - 1] == D && (!has_token_axis || d[1] == num_tokens);
    if (!ok) {
      return InvalidArgument(std::string(name) + ": expected " + kKvShape[tokens.form] +
                             " matching q and the cache, got " + DimsString(d));
    }
  }
  for (auto [name, dt] : {std::pair{"k", k.element_type()}, std::pair{"v", v.element_type()},
                          std::pair{"k_cache", k_cache.element_type()},
                          std::pair{"v_cache", v_cache.element_type()}}) {
    if (dt != q.element_type()) {
      return InvalidArgument(std::string(name) + ": expected the dtype of q");
    }
  }
  if (lengths.element_count() != static_cast<size_t>(B)) {
    return InvalidArgument("lengths: expected int32 [B=" + std::to_string(B) + "]");
  }
  if (committed.element_count() != static_cast<size_t>(B)) {
    return InvalidArgument("committed: expected int32 [B=" + std::to_string(B) + "]");
  }
  if (window < 0) return InvalidArgument("window: expected > 0 (or 0 for none)");
  if (!(softcap >= 0.0f)) return InvalidArgument("softcap: expected > 0 (or 0 for none)");
  if (g.capacity > INT32_MAX || num_tokens > INT32_MAX) {
    return InvalidArgument("k_cache: capacity must fit int32");
  }
  *p = GqaParams<Elem>{};
  p->q = reinterpret_cast<const Elem*>(q.untyped_data());
  p->k_new = reinterpret_cast<const Elem*>(k.untyped_data());
  p->v_new = reinterpret_cast<const Elem*>(v.untyped_data());
  p->k_cache = reinterpret_cast<Elem*>(k_cache.untyped_data());
  p->v_cache = reinterpret_cast<Elem*>(v_cache.untyped_data());
  p->out = reinterpret_cast<Elem*>(out->untyped_data());
  p->lengths = lengths.typed_data();
  p->new_lengths = tokens.new_lengths;
  p->cu_seqlens = tokens.cu_seqlens;
  p->committed = committed.typed_data();
  p->status = status->typed_data();
  p->workspace = workspace->element_count() ? workspace->typed_data() : nullptr;
  p->workspace_floats = static_cast<int64_t>(workspace->element_count());
  p->cache = g.strides;
  p->batch = static_cast<int32_t>(B);
  p->num_tokens = static_cast<int32_t>(num_tokens);
  p->num_q_heads = static_cast<int32_t>(Hq);
  p->num_kv_heads = static_cast<int32_t>(Hkv);
  p->head_dim = static_cast<int32_t>(D);
  p->capacity = static_cast<int32_t>(g.capacity);
  p->scale = scale;
  p->softcap = softcap;
  p->window = window;
  return ffi::Error::Success();
}

// Checks a grow_cache call (same layout, same B/Hkv/D/dtype, S_new >= S_old) and fills params.
inline ffi::Error FillGrowParams(ffi::AnyBuffer cache, ffi::Buffer<ffi::S32> lengths,
                                 ffi::AnyBuffer new_cache,
                                 ffi::Result<ffi::Buffer<ffi::S32>> status, int32_t layout,
                                 GrowParams* p) {
  auto src = CacheGeometryOf("cache", cache.dimensions(), layout);
  if (src.has_error()) return src.error();
  auto dst = CacheGeometryOf("new_cache", new_cache.dimensions(), layout);
  if (dst.has_error()) return dst.error();
  if (src->batch != dst->batch || src->num_kv_heads != dst->num_kv_heads ||
      src->head_dim != dst->head_dim || dst->capacity < src->capacity ||
      cache.element_type() != new_cache.element_type()) {
    return InvalidArgument(
        "new_capacity: expected a cache of the same B, Hkv, D, dtype and "
        "capacity >= " +
        std::to_string(src->capacity) + ", got " + DimsString(new_cache.dimensions()));
  }
  if (lengths.element_count() != static_cast<size_t>(src->batch)) {
    return InvalidArgument("lengths: expected int32 [B=" + std::to_string(src->batch) + "]");
  }
  *p = GrowParams{};
  p->src = static_cast<const uint8_t*>(cache.untyped_data());
  p->dst = static_cast<uint8_t*>(new_cache.untyped_data());
  p->lengths = lengths.typed_data();
  p->status = status->typed_data();
  p->src_strides = src->strides;
  p->dst_strides = dst->strides;
  p->batch = static_cast<int32_t>(src->batch);
  p->num_kv_heads = static_cast<int32_t>(src->num_kv_heads);
  p->head_dim = static_cast<int32_t>(src->head_dim);
  p->src_capacity = static_cast<int32_t>(src->capacity);
  p->dst_capacity = static_cast<int32_t>(dst->capacity);
  p->elem_bytes = static_cast<int32_t>(ffi::ByteWidth(cache.element_type()));
  return ffi::Error::Success();
}

}  // namespace jax_kv

// Turns an FFI dtype into the kernel's element type. `Type` names are the storage types the
// kernels see; the CPU reference converts them to float, the CUDA side maps them to
// __nv_bfloat16 / __half.
// The FFI signature both platforms register, so a call lowers the same way on CPU and CUDA.
// Caches come in as args 3, 4 and go out aliased as results 1, 2; the handler writes through
// the results. `ctx` is the platform's context (the CUDA stream, or nothing on CPU).
#define JKV_GQA_ARGS(ctx)                                           \
  ::xla::ffi::Ffi::Bind()                                           \
      ctx.Arg<::xla::ffi::AnyBuffer>()                /* q */       \
          .Arg<::xla::ffi::AnyBuffer>()               /* k */       \
          .Arg<::xla::ffi::AnyBuffer>()               /* v */       \
          .Arg<::xla::ffi::AnyBuffer>()               /* k_cache */ \
          .Arg<::xla::ffi::AnyBuffer>()               /* v_cache */ \
          .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>() /* lengths [B] */
#define JKV_GQA_RETS_ATTRS                                                \
  .Ret<::xla::ffi::AnyBuffer>()                   /* out */               \
      .Ret<::xla::ffi::AnyBuffer>()               /* k_cache (aliased) */ \
      .Ret<::xla::ffi::AnyBuffer>()               /* v_cache (aliased) */ \
      .Ret<::xla::ffi::Buffer<::xla::ffi::S32>>() /* status [B] */        \
      .Ret<::xla::ffi::Buffer<::xla::ffi::F32>>() /* workspace */         \
      .Attr<int32_t>("layout")                                            \
      .Attr<float>("scale")                                               \
      .Attr<float>("softcap")                                             \
      .Attr<int32_t>("window")
#define JKV_GQA_COMMITTED_ARG .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>() /* committed [B] */
// Kernel choices for tests and benchmarks (jax_kv/ops: the `_kernel`, `_cta_shape` and
// `_split_counters` hooks): attributes, so each choice is part of the compiled call. The CPU
// handlers bind and ignore them: a call lowers the same way on both platforms.
#define JKV_GQA_DECODE_BINDING(ctx)                                         \
  JKV_GQA_ARGS(ctx)                                                         \
  JKV_GQA_COMMITTED_ARG JKV_GQA_RETS_ATTRS                                  \
      .Attr<int32_t>("kernel")         /* DecodeKernel: auto, simt, mma */  \
      .Attr<int32_t>("cta_shape")      /* DecodeCtas: auto, narrow, wide */ \
      .Attr<int32_t>("split_counters") /* SplitCounters: pool, workspace */ \
      .Attr<int32_t>("splits")         /* 0: from the batch; n: n splits */
// Both prefill forms bind this: new_tokens, the argument after lengths, is new_lengths [B]
// (gqa_prefill) or cu_seqlens [B + 1] (gqa_prefill_packed); out is [B, T, Hq, D] or
// [N, Hq, D].
#define JKV_GQA_PREFILL_BINDING(ctx)                                                     \
  JKV_GQA_ARGS(ctx)                                                                      \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>() /* new_tokens */ JKV_GQA_COMMITTED_ARG \
          JKV_GQA_RETS_ATTRS.Attr<int32_t>("kernel") /* PrefillKernel: auto, mma */
#define JKV_GROW_BINDING(ctx)                                         \
  ::xla::ffi::Ffi::Bind()                                             \
      ctx.Arg<::xla::ffi::AnyBuffer>()                /* cache */     \
          .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>() /* lengths */   \
          .Ret<::xla::ffi::AnyBuffer>()               /* new cache */ \
          .Ret<::xla::ffi::Buffer<::xla::ffi::S32>>() /* status */    \
          .Attr<int32_t>("layout")

#define JKV_DISPATCH_DTYPE(dtype, fn, ...)                                            \
  switch (dtype) {                                                                    \
    case ::xla::ffi::BF16:                                                            \
      return fn<::jax_kv::bf16_t>(__VA_ARGS__);                                       \
    case ::xla::ffi::F16:                                                             \
      return fn<::jax_kv::f16_t>(__VA_ARGS__);                                        \
    case ::xla::ffi::F32:                                                             \
      return fn<float>(__VA_ARGS__);                                                  \
    default:                                                                          \
      return ::xla::ffi::Error::InvalidArgument("q: dtype must be bf16, f16 or f32"); \
  }
