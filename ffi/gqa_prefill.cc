// CUDA handler of jax_kv_gqa_prefill: checks buffers and attributes, fills params, dispatches the
// dtype and the head dim, launches flash attention.
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
                                 ffi::Buffer<ffi::S32> lengths, const int32_t* new_lengths,
                                 ffi::Buffer<ffi::S32> committed, ffi::Result<ffi::AnyBuffer> out,
                                 ffi::Result<ffi::Buffer<ffi::S32>> status,
                                 ffi::Result<ffi::Buffer<ffi::F32>> workspace, int32_t layout,
                                 float scale, float softcap, int32_t window, PrefillKernel kernel) {
  GqaParams<T> p;
  ffi::Error err = FillGqaParams<T>(q, k, v, k_cache, v_cache, lengths, new_lengths, committed, out,
                                    status, workspace, layout, scale, softcap, window,
                                    /*has_token_axis=*/true, &p);
  if (err.failure()) return err;
  cudaError_t e = cudaSuccess;
  JKV_DISPATCH_HEAD_DIM(p.head_dim, HEAD_DIM,
                        return InvalidArgument("q: " + HeadDimError(p.head_dim)),
                        e = LaunchGqaPrefill<T, HEAD_DIM>(p, stream, kernel););
  if (e != cudaSuccess) {
    return ffi::Error::Internal(std::string("jax_kv_gqa_prefill: ") + cudaGetErrorString(e));
  }
  return ffi::Error::Success();
}

static ffi::Error GqaPrefillDispatch(
    cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
    ffi::AnyBuffer /*k_cache*/, ffi::AnyBuffer /*v_cache*/, ffi::Buffer<ffi::S32> lengths,
    ffi::Buffer<ffi::S32> new_lengths, ffi::Buffer<ffi::S32> committed,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> k_cache,
    ffi::Result<ffi::AnyBuffer> v_cache, ffi::Result<ffi::Buffer<ffi::S32>> status,
    ffi::Result<ffi::Buffer<ffi::F32>> workspace, int32_t layout, float scale, float softcap,
    int32_t window, int32_t kernel) {
  CountHostCall(kHostCallPrefill);
  if (new_lengths.element_count() != lengths.element_count()) {
    return InvalidArgument("new_lengths: expected int32 [B], the shape of lengths");
  }
  if (kernel != static_cast<int32_t>(PrefillKernel::kAuto) &&
      kernel != static_cast<int32_t>(PrefillKernel::kMma)) {
    return InvalidArgument("kernel: expected 0 (auto) or 1 (mma), got " + std::to_string(kernel));
  }
  JKV_DISPATCH_DTYPE(q.element_type(), GqaPrefillImpl, stream, q, k, v, *k_cache, *v_cache, lengths,
                     new_lengths.typed_data(), committed, out, status, workspace, layout, scale,
                     softcap, window, static_cast<PrefillKernel>(kernel));
}

}  // namespace jax_kv

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxKvGqaPrefillCuda, jax_kv::GqaPrefillDispatch,
    JKV_GQA_PREFILL_BINDING(.Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()),
    {::xla::ffi::Traits::kCmdBufferCompatible});
