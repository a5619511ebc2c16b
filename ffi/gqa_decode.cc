// CUDA handler of jax_kv_gqa_decode: checks buffers and attributes, fills params, dispatches the
// dtype and the head dim, launches the kernel the call runs (cuda/gqa_decode.cuh).
#include "cuda/gqa_decode.cuh"

#include <cuda_runtime.h>

#include <string>

#include "cuda/head_dims.h"
#include "ffi/common.h"
#include "ffi/host_calls.h"

namespace jax_kv {

template <typename T>
static ffi::Error GqaDecodeImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                ffi::AnyBuffer v, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                                ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> committed,
                                ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::Buffer<ffi::S32>> status,
                                ffi::Result<ffi::Buffer<ffi::F32>> workspace, int32_t layout,
                                float scale, float softcap, int32_t window, int32_t kernel,
                                int32_t cta_shape, int32_t split_counters, int32_t splits) {
  GqaParams<T> p;
  ffi::Error err = FillGqaParams<T>(q, k, v, k_cache, v_cache, lengths, NewTokens{}, committed, out,
                                    status, workspace, layout, scale, softcap, window, &p);
  if (err.failure()) return err;
  constexpr int kItemsize = sizeof(T);
  const std::string bad =
      DecodeOptionsError(kernel, cta_shape, split_counters, splits, p.head_dim, kItemsize);
  if (!bad.empty()) return InvalidArgument(bad);
  const DecodeOptions options =
      MakeDecodeOptions(kernel, cta_shape, split_counters, splits, p.head_dim, kItemsize);
  // status is written by the kernel for every b (no memset node needed).
  cudaError_t e = cudaSuccess;
  JKV_DISPATCH_HEAD_DIM(p.head_dim, HEAD_DIM,
                        return InvalidArgument("q: " + HeadDimError(p.head_dim)),
                        e = LaunchGqaDecode<T, HEAD_DIM>(p, options, stream););
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
    int32_t layout, float scale, float softcap, int32_t window, int32_t kernel, int32_t cta_shape,
    int32_t split_counters, int32_t splits) {
  CountHostCall(kHostCallDecode);
  TraceOperands("decode", {{"q", q.untyped_data()},
                           {"k", k.untyped_data()},
                           {"v", v.untyped_data()},
                           {"k_cache", k_cache->untyped_data()},
                           {"v_cache", v_cache->untyped_data()},
                           {"lengths", lengths.typed_data()},
                           {"committed", committed.typed_data()},
                           {"out", out->untyped_data()},
                           {"status", status->typed_data()},
                           {"workspace", workspace->typed_data()}});
  JKV_DISPATCH_DTYPE(q.element_type(), GqaDecodeImpl, stream, q, k, v, *k_cache, *v_cache, lengths,
                     committed, out, status, workspace, layout, scale, softcap, window, kernel,
                     cta_shape, split_counters, splits);
}

}  // namespace jax_kv

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxKvGqaDecodeCuda, jax_kv::GqaDecodeDispatch,
    JKV_GQA_DECODE_BINDING(.Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()),
    {::xla::ffi::Traits::kCmdBufferCompatible});
