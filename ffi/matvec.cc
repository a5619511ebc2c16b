// CUDA handler of jax_kv_matvec: y [M, N] = x [M, K] @ w^T for M <= 4, with the optional
// RMSNorm prologue, SwiGLU and residual epilogues of cuda/matvec.cuh.
#include "cuda/matvec.cuh"

#include <cuda_runtime.h>

#include <string>

#include "ffi/common.h"
#include "ffi/host_calls.h"

namespace jax_kv {

// An optional operand is an empty buffer when absent.
template <typename T>
static const T* Optional(const ffi::AnyBuffer& b) {
  return b.element_count() != 0 ? static_cast<const T*>(b.untyped_data()) : nullptr;
}

template <typename T>
static ffi::Error MatvecImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                             ffi::AnyBuffer bias, ffi::AnyBuffer norm, ffi::AnyBuffer residual,
                             ffi::Result<ffi::AnyBuffer> y, float eps, bool swiglu) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) {
    return InvalidArgument("x, w: expected rank 2 ([M, K], [N, K]), got " + DimsString(xd) +
                           " and " + DimsString(wd));
  }
  const int64_t M = xd[0], K = xd[1], W = wd[0];
  if (wd[1] != K || (swiglu && W % 2 != 0)) {
    return InvalidArgument(std::string("w: expected [") + (swiglu ? "2N" : "N") +
                           ", K] with K=" + std::to_string(K) + " (from x), got " + DimsString(wd));
  }
  const int64_t N = swiglu ? W / 2 : W;
  if (M > kMatvecMaxRows || K % (16 / static_cast<int64_t>(sizeof(T))) != 0 ||
      W > (int64_t{1} << 31) - 1) {
    return InvalidArgument("x: expected at most " + std::to_string(kMatvecMaxRows) +
                           " rows and K a multiple of " + std::to_string(16 / sizeof(T)) +
                           ", got " + DimsString(xd));
  }
  for (const ffi::AnyBuffer* b : {&w, &bias, &norm, &residual}) {
    if (b->element_count() != 0 && b->element_type() != x.element_type()) {
      return InvalidArgument("w, bias, norm, residual: expected the dtype of x");
    }
  }
  if (norm.element_count() != 0 && MatvecStagedBytes(M, K, sizeof(T)) > kMatvecMaxStagedBytes) {
    return InvalidArgument(
        "norm: expected (M + 1) * K * itemsize <= " + std::to_string(kMatvecMaxStagedBytes) +
        " bytes (x and norm are staged in shared memory), got x " + DimsString(xd));
  }
  if (y->element_type() != x.element_type()) {
    return InvalidArgument("y: expected the dtype of x");
  }
  // Optional operands: empty, or exactly this many elements.
  const struct {
    const char* name;
    const ffi::AnyBuffer& buffer;
    int64_t count;
  } optional[] = {{"bias", bias, W}, {"norm", norm, K}, {"residual", residual, M * N}};
  for (const auto& o : optional) {
    const auto n = static_cast<int64_t>(o.buffer.element_count());
    if (n != 0 && n != o.count) {
      return InvalidArgument(std::string(o.name) + ": expected " + std::to_string(o.count) +
                             " elements or none, got " + DimsString(o.buffer.dimensions()));
    }
  }
  if (static_cast<int64_t>(y->element_count()) != M * N) {
    return InvalidArgument("y: expected [M, N] = [" + std::to_string(M) + ", " + std::to_string(N) +
                           "], got " + DimsString(y->dimensions()));
  }
  MatvecParams<T> p{static_cast<const T*>(x.untyped_data()),
                    static_cast<const T*>(w.untyped_data()),
                    Optional<T>(bias),
                    Optional<T>(norm),
                    Optional<T>(residual),
                    static_cast<T*>(y->untyped_data()),
                    static_cast<int>(M),
                    static_cast<int>(N),
                    static_cast<int>(K),
                    eps,
                    swiglu};
  const cudaError_t e = LaunchMatvec<T>(p, stream);
  if (e != cudaSuccess) {
    return ffi::Error::Internal(std::string("jax_kv_matvec: ") + cudaGetErrorString(e));
  }
  return ffi::Error::Success();
}

static ffi::Error MatvecDispatch(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                 ffi::AnyBuffer bias, ffi::AnyBuffer norm, ffi::AnyBuffer residual,
                                 ffi::Result<ffi::AnyBuffer> y, float eps, bool swiglu) {
  CountHostCall(kHostCallMatvec);
  JKV_DISPATCH_DTYPE(x.element_type(), MatvecImpl, stream, x, w, bias, norm, residual, y, eps,
                     swiglu);
}

}  // namespace jax_kv

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxKvMatvecCuda, jax_kv::MatvecDispatch,
                              ::xla::ffi::Ffi::Bind()
                                  .Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<::xla::ffi::AnyBuffer>()  // x [M, K]
                                  .Arg<::xla::ffi::AnyBuffer>()  // w [N, K] or [2N, K]
                                  .Arg<::xla::ffi::AnyBuffer>()  // bias [N] / [2N] or [0]
                                  .Arg<::xla::ffi::AnyBuffer>()  // norm [K] or [0]
                                  .Arg<::xla::ffi::AnyBuffer>()  // residual [M, N] or [0]
                                  .Ret<::xla::ffi::AnyBuffer>()  // y [M, N]
                                  .Attr<float>("eps")
                                  .Attr<bool>("swiglu"),
                              {::xla::ffi::Traits::kCmdBufferCompatible});
