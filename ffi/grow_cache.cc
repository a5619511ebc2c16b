// CUDA handler of jax_kv_grow_cache: out-of-place growth copying only the live prefix.
#include "cuda/grow_cache.cuh"

#include <cuda_runtime.h>

#include <string>

#include "ffi/common.h"
#include "ffi/host_calls.h"

namespace jax_kv {

static ffi::Error GrowCacheDispatch(cudaStream_t stream, ffi::AnyBuffer cache,
                                    ffi::Buffer<ffi::S32> lengths,
                                    ffi::Result<ffi::AnyBuffer> new_cache,
                                    ffi::Result<ffi::Buffer<ffi::S32>> status, int32_t layout) {
  CountHostCall(kHostCallGrow);
  GrowParams p;
  ffi::Error err = FillGrowParams(cache, lengths, *new_cache, status, layout, &p);
  if (err.failure()) return err;
  const cudaError_t e = LaunchGrowCache(p, stream);
  if (e != cudaSuccess) {
    return ffi::Error::Internal(std::string("jax_kv_grow_cache: ") + cudaGetErrorString(e));
  }
  return ffi::Error::Success();
}

}  // namespace jax_kv

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxKvGrowCacheCuda, jax_kv::GrowCacheDispatch,
                              JKV_GROW_BINDING(.Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()),
                              {::xla::ffi::Traits::kCmdBufferCompatible});
