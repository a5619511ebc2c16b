// CPU handler of jax_kv_gqa_decode: the reference semantics the CUDA handler is checked against.
#include "ffi/common.h"
#include "ffi/gqa_reference_cpu.h"

namespace jax_kv {

static ffi::Error GqaDecodeCpuDispatch(
    ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer /*k_cache*/,
    ffi::AnyBuffer /*v_cache*/, ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> committed,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> k_cache,
    ffi::Result<ffi::AnyBuffer> v_cache, ffi::Result<ffi::Buffer<ffi::S32>> status,
    ffi::Result<ffi::Buffer<ffi::F32>> workspace, int32_t layout, float scale, float softcap,
    int32_t window, int32_t /*kernel*/, int32_t /*cta_shape*/, int32_t /*split_counters*/,
    int32_t /*splits*/) {
  JKV_DISPATCH_DTYPE(q.element_type(), GqaCpuImpl, q, k, v, *k_cache, *v_cache, lengths,
                     NewTokens{}, committed, out, status, workspace, layout, scale, softcap,
                     window);
}

}  // namespace jax_kv

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxKvGqaDecodeCpu, jax_kv::GqaDecodeCpuDispatch,
                              JKV_GQA_DECODE_BINDING());
