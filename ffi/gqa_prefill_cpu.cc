// CPU handler of jax_kv_gqa_prefill: the reference semantics the CUDA handler is checked against.
#include "ffi/common.h"
#include "ffi/gqa_reference_cpu.h"

namespace jax_kv {

static ffi::Error GqaPrefillCpuDispatch(
    ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer /*k_cache*/,
    ffi::AnyBuffer /*v_cache*/, ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> new_lengths,
    ffi::Buffer<ffi::S32> committed, ffi::Result<ffi::AnyBuffer> out,
    ffi::Result<ffi::AnyBuffer> k_cache, ffi::Result<ffi::AnyBuffer> v_cache,
    ffi::Result<ffi::Buffer<ffi::S32>> status, ffi::Result<ffi::Buffer<ffi::F32>> workspace,
    int32_t layout, float scale, float softcap, int32_t window, int32_t /*kernel*/) {
  if (new_lengths.element_count() != lengths.element_count()) {
    return InvalidArgument("new_lengths: expected int32 [B], the shape of lengths");
  }
  JKV_DISPATCH_DTYPE(q.element_type(), GqaCpuImpl, q, k, v, *k_cache, *v_cache, lengths,
                     new_lengths.typed_data(), committed, out, status, workspace, layout, scale,
                     softcap, window, /*has_token_axis=*/true);
}

}  // namespace jax_kv

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxKvGqaPrefillCpu, jax_kv::GqaPrefillCpuDispatch,
                              JKV_GQA_PREFILL_BINDING());
