// CUDA handlers of jax_kv_gqa_prefill and jax_kv_gqa_prefill_packed: check buffers and
// attributes, fill params, dispatch the dtype and the head dim, launch flash attention. One
// dispatch serves both forms (NewTokens::Form); the kernels read the form off the params.
#include "cuda/gqa_prefill.cuh"

#include <cuda_runtime.h>

#include <string>

#include "cuda/head_dims.h"
#include "ffi/common.h"
#include "ffi/host_calls.h"

namespace jax_kv {

template <typename T>
static ffi::Error GqaPrefillImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                 ffi::AnyBuffer v, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                                 ffi::Buffer<ffi::S32> lengths, NewTokens tokens,
                                 ffi::Buffer<ffi::S32> committed, ffi::Result<ffi::AnyBuffer> out,
                                 ffi::Result<ffi::Buffer<ffi::S32>> status,
                                 ffi::Result<ffi::Buffer<ffi::F32>> workspace, int32_t layout,
                                 float scale, float softcap, int32_t window, PrefillKernel kernel,
                                 const char* target) {
  GqaParams<T> p;
  ffi::Error err = FillGqaParams<T>(q, k, v, k_cache, v_cache, lengths, tokens, committed, out,
                                    status, workspace, layout, scale, softcap, window, &p);
  if (err.failure()) return err;
  cudaError_t e = cudaSuccess;
  JKV_DISPATCH_HEAD_DIM(p.head_dim, HEAD_DIM,
                        return InvalidArgument("q: " + HeadDimError(p.head_dim)),
                        e = LaunchGqaPrefill<T, HEAD_DIM>(p, stream, kernel););
  if (e != cudaSuccess) {
    return ffi::Error::Internal(std::string(target) + ": " + cudaGetErrorString(e));
  }
  return ffi::Error::Success();
}

// `new_tokens` is new_lengths [B] (padded form) or cu_seqlens [B + 1] (packed form).
template <NewTokens::Form kForm>
static ffi::Error GqaPrefillDispatch(
    cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
    ffi::AnyBuffer /*k_cache*/, ffi::AnyBuffer /*v_cache*/, ffi::Buffer<ffi::S32> lengths,
    ffi::Buffer<ffi::S32> new_tokens, ffi::Buffer<ffi::S32> committed,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> k_cache,
    ffi::Result<ffi::AnyBuffer> v_cache, ffi::Result<ffi::Buffer<ffi::S32>> status,
    ffi::Result<ffi::Buffer<ffi::F32>> workspace, int32_t layout, float scale, float softcap,
    int32_t window, int32_t kernel) {
  constexpr bool kPacked = kForm == NewTokens::kPacked;
  CountHostCall(kPacked ? kHostCallPrefillPacked : kHostCallPrefill);
  const char* target = kPacked ? "jax_kv_gqa_prefill_packed" : "jax_kv_gqa_prefill";
  ffi::ErrorOr<NewTokens> tokens = PrefillTokensOf(kForm, new_tokens, lengths);
  if (tokens.has_error()) return tokens.error();
  if (kernel != static_cast<int32_t>(PrefillKernel::kAuto) &&
      kernel != static_cast<int32_t>(PrefillKernel::kMma)) {
    return InvalidArgument("kernel: expected 0 (auto) or 1 (mma), got " + std::to_string(kernel));
  }
  JKV_DISPATCH_DTYPE(q.element_type(), GqaPrefillImpl, stream, q, k, v, *k_cache, *v_cache, lengths,
                     *tokens, committed, out, status, workspace, layout, scale, softcap, window,
                     static_cast<PrefillKernel>(kernel), target);
}

}  // namespace jax_kv

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxKvGqaPrefillCuda, jax_kv::GqaPrefillDispatch<jax_kv::NewTokens::kPadded>,
    JKV_GQA_PREFILL_BINDING(.Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()),
    {::xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxKvGqaPrefillPackedCuda, jax_kv::GqaPrefillDispatch<jax_kv::NewTokens::kPacked>,
    JKV_GQA_PREFILL_BINDING(.Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()),
    {::xla::ffi::Traits::kCmdBufferCompatible});
