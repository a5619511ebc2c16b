// CUDA handler of jax_kv_matvec: y [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]) for M <= 4.
#include "cuda/matvec.cuh"

#include <cuda_runtime.h>

#include <string>

#include "ffi/common.h"
#include "ffi/host_calls.h"

namespace jax_kv {

template <typename T>
static ffi::Error MatvecImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                             ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) {
    return InvalidArgument("x, w: expected rank 2 ([M, K], [N, K]), got " + DimsString(xd) +
                           " and " + DimsString(wd));
  }
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  if (wd[1] != K) {
    return InvalidArgument("w: expected [N, K] with K=" + std::to_string(K) + " (from x), got " +
                           DimsString(wd));
  }
  if (M > kMatvecMaxRows || K % (16 / static_cast<int64_t>(sizeof(T))) != 0 ||
      N > (int64_t{1} << 31) - 1) {
    return InvalidArgument("x: expected at most " + std::to_string(kMatvecMaxRows) +
                           " rows and K a multiple of " + std::to_string(16 / sizeof(T)) +
                           ", got " + DimsString(xd));
  }
  const int64_t bias_count = static_cast<int64_t>(bias.element_count());
  if (w.element_type() != x.element_type() || y->element_type() != x.element_type() ||
      (bias_count != 0 && bias.element_type() != x.element_type())) {
    return InvalidArgument("w, bias, y: expected the dtype of x");
  }
  if (bias_count != 0 && bias_count != N) {
    return InvalidArgument("bias: expected " + std::to_string(N) + " elements or none, got " +
                           DimsString(bias.dimensions()));
  }
  if (static_cast<int64_t>(y->element_count()) != M * N) {
    return InvalidArgument("y: expected [M, N] = [" + std::to_string(M) + ", " + std::to_string(N) +
                           "], got " + DimsString(y->dimensions()));
  }
  MatvecParams<T> p{static_cast<const T*>(x.untyped_data()),
                    static_cast<const T*>(w.untyped_data()),
                    bias_count != 0 ? static_cast<const T*>(bias.untyped_data()) : nullptr,
                    static_cast<T*>(y->untyped_data()),
                    static_cast<int>(M),
                    static_cast<int>(N),
                    static_cast<int>(K)};
  const cudaError_t e = LaunchMatvec<T>(p, stream);
  if (e != cudaSuccess) {
    return ffi::Error::Internal(std::string("jax_kv_matvec: ") + cudaGetErrorString(e));
  }
  return ffi::Error::Success();
}

static ffi::Error MatvecDispatch(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                 ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y) {
  CountHostCall(kHostCallMatvec);
  JKV_DISPATCH_DTYPE(x.element_type(), MatvecImpl, stream, x, w, bias, y);
}

}  // namespace jax_kv

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxKvMatvecCuda, jax_kv::MatvecDispatch,
                              ::xla::ffi::Ffi::Bind()
                                  .Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<::xla::ffi::AnyBuffer>()   // x [M, K]
                                  .Arg<::xla::ffi::AnyBuffer>()   // w [N, K]
                                  .Arg<::xla::ffi::AnyBuffer>()   // bias [N] or [0]
                                  .Ret<::xla::ffi::AnyBuffer>(),  // y [M, N]
                              {::xla::ffi::Traits::kCmdBufferCompatible});
