// NB_MODULE(_ffi_cpu): hands the CPU handlers to Python as capsules for jax.ffi registration,
// and the supported head dims (cuda/head_dims.h) for the test that Python's list agrees.
#include <nanobind/nanobind.h>

#include "cuda/head_dims.h"
#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxKvGqaDecodeCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxKvGqaPrefillCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxKvGqaPrefillPackedCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxKvGrowCacheCpu);

namespace nb = nanobind;

void RegisterDlpack(nb::module_& m);  // ffi/dlpack_export.cc

template <typename Fn>
static nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

NB_MODULE(_ffi_cpu, m) {
  m.doc() = "jax_kv CPU reference handlers (XLA FFI)";
  m.def("registrations", []() {
    nb::dict d;
    d["jax_kv_gqa_decode"] = Capsule(JaxKvGqaDecodeCpu);
    d["jax_kv_gqa_prefill"] = Capsule(JaxKvGqaPrefillCpu);
    d["jax_kv_gqa_prefill_packed"] = Capsule(JaxKvGqaPrefillPackedCpu);
    d["jax_kv_grow_cache"] = Capsule(JaxKvGrowCacheCpu);
    return d;
  });
  m.def(
      "supported_head_dims",
      []() {
        nb::list dims;
        for (int d : jax_kv::kSupportedHeadDims) dims.append(d);
        return dims;
      },
      "The head dims the handlers and kernels are built for (cuda/head_dims.h), increasing.");
  RegisterDlpack(m);
}
