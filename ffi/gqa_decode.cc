// CUDA handler of jax_kv_gqa_decode: checks buffers, fills params, launches the selected
// split-K kernel (1, 2 or 3, ffi/kernel_choice.h).
#include "cuda/gqa_decode.cuh"

#include <cuda_runtime.h>

#include <string>

#include "ffi/common.h"
#include "ffi/host_calls.h"
#include "ffi/kernel_choice.h"

namespace jax_kv {

template <typename T>
static ffi::Error GqaDecodeImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                ffi::AnyBuffer v, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                                ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> committed,
                                ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::Buffer<ffi::S32>> status,
                                ffi::Result<ffi::Buffer<ffi::F32>> workspace, int32_t layout,
                                float scale, float softcap, int32_t window) {
  GqaParams<T> p;
  ffi::Error err =
      FillGqaParams<T>(q, k, v, k_cache, v_cache, lengths, /*new_lengths=*/nullptr, committed, out,
                       status, workspace, layout, scale, softcap, window,
                       /*has_token_axis=*/false, &p);
  if (err.failure()) return err;
  // status is written by the kernel for every b (no memset node needed).
  cudaError_t e;
  switch (g_decode_kernel.load(std::memory_order_relaxed)) {
    case 1:
      e = LaunchGqaDecode<T>(p, stream);
      break;
    case 3:
      e = LaunchGqaDecodeMma<T>(p, stream);
      break;
    default:
      e = LaunchGqaDecodeV2<T>(p, stream);
  }
  if (e != cudaSuccess) {
    return ffi::Error::Internal(std::string("jax_kv_gqa_decode: ") + cudaGetErrorString(e));
  }
  return ffi::Error::Success();
}

static ffi::Error GqaDecodeDispatch(
    cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
    ffi::AnyBuffer /*k_cache*/, ffi::AnyBuffer /*v_cache*/, ffi::Buffer<ffi::S32> lengths,
    ffi::Buffer<ffi::S32> committed, ffi::Result<ffi::AnyBuffer> out,
    ffi::Result<ffi::AnyBuffer> k_cache, ffi::Result<ffi::AnyBuffer> v_cache,
    ffi::Result<ffi::Buffer<ffi::S32>> status, ffi::Result<ffi::Buffer<ffi::F32>> workspace,
    int32_t layout, float scale, float softcap, int32_t window) {
  CountHostCall(kHostCallDecode);
  JKV_DISPATCH_DTYPE(q.element_type(), GqaDecodeImpl, stream, q, k, v, *k_cache, *v_cache, lengths,
                     committed, out, status, workspace, layout, scale, softcap, window);
}

}  // namespace jax_kv

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxKvGqaDecodeCuda, jax_kv::GqaDecodeDispatch,
    JKV_GQA_DECODE_BINDING(.Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()),
    {::xla::ffi::Traits::kCmdBufferCompatible});
