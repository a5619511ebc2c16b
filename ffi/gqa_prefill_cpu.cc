// CPU handlers of jax_kv_gqa_prefill and jax_kv_gqa_prefill_packed: the reference semantics the
// CUDA handlers are checked against. One dispatch serves both forms (NewTokens::Form).
#include "ffi/common.h"
#include "ffi/gqa_reference_cpu.h"

namespace jax_kv {

// `new_tokens` is new_lengths [B] (padded form) or cu_seqlens [B + 1] (packed form).
template <NewTokens::Form kForm>
static ffi::Error GqaPrefillCpuDispatch(
    ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer /*k_cache*/,
    ffi::AnyBuffer /*v_cache*/, ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> new_tokens,
    ffi::Buffer<ffi::S32> committed, ffi::Result<ffi::AnyBuffer> out,
    ffi::Result<ffi::AnyBuffer> k_cache, ffi::Result<ffi::AnyBuffer> v_cache,
    ffi::Result<ffi::Buffer<ffi::S32>> status, ffi::Result<ffi::Buffer<ffi::F32>> workspace,
    int32_t layout, float scale, float softcap, int32_t window, int32_t /*kernel*/) {
  ffi::ErrorOr<NewTokens> tokens = PrefillTokensOf(kForm, new_tokens, lengths);
  if (tokens.has_error()) return tokens.error();
  JKV_DISPATCH_DTYPE(q.element_type(), GqaCpuImpl, q, k, v, *k_cache, *v_cache, lengths, *tokens,
                     committed, out, status, workspace, layout, scale, softcap, window);
}

}  // namespace jax_kv

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxKvGqaPrefillCpu,
                              jax_kv::GqaPrefillCpuDispatch<jax_kv::NewTokens::kPadded>,
                              JKV_GQA_PREFILL_BINDING());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxKvGqaPrefillPackedCpu,
                              jax_kv::GqaPrefillCpuDispatch<jax_kv::NewTokens::kPacked>,
                              JKV_GQA_PREFILL_BINDING());
