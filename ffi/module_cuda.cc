// NB_MODULE(_ffi_cuda): the CUDA handlers as capsules, the decode plan (and workspace size) of
// a call, and the per-target host-call counters (the CUDA-graph replay signal). Which kernel a
// call runs is a function of the call (cuda/gqa_decode.cuh, cuda/gqa_prefill.cuh): there is no
// process-wide kernel setting.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include "cuda/dtypes.h"
#include "cuda/gqa_decode.cuh"
#include "cuda/gqa_prefill.cuh"
#include "cuda/head_dims.h"
#include "ffi/host_calls.h"
#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxKvGqaDecodeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxKvGqaPrefillCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxKvGqaPrefillPackedCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxKvGrowCacheCuda);

namespace jax_kv {
std::atomic<int64_t> g_host_calls[kNumHostCallTargets];
}  // namespace jax_kv

namespace nb = nanobind;

template <typename Fn>
static nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

static const char* const kTargetNames[jax_kv::kNumHostCallTargets] = {
    "jax_kv_gqa_decode", "jax_kv_gqa_prefill", "jax_kv_grow_cache", "jax_kv_gqa_prefill_packed"};

// The plan of the decode kernel a call of this shape runs with these attribute values (the
// handler's own choice), or std::invalid_argument naming what the handler would refuse.
static std::pair<jax_kv::DecodeOptions, jax_kv::GqaDecodePlan> DecodePlanOf(
    int batch, int num_q_heads, int num_kv_heads, int head_dim, int itemsize, int kernel,
    int cta_shape, int splits) {
  if (batch <= 0 || num_q_heads <= 0 || num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0 ||
      (itemsize != 2 && itemsize != 4)) {
    throw std::invalid_argument(
        "decode plan: expected positive B, Hq, Hkv with Hq % Hkv == 0 and itemsize 2 or 4");
  }
  const int32_t counters = static_cast<int32_t>(jax_kv::SplitCounters::kPool);  // plan-neutral
  const std::string bad =
      jax_kv::DecodeOptionsError(kernel, cta_shape, counters, splits, head_dim, itemsize);
  if (!bad.empty()) throw std::invalid_argument(bad);
  const jax_kv::DecodeOptions o =
      jax_kv::MakeDecodeOptions(kernel, cta_shape, counters, splits, head_dim, itemsize);
  // bf16 and f16 plan alike (only the element size matters).
  JKV_DISPATCH_HEAD_DIM(
      head_dim, HEAD_DIM, throw std::invalid_argument(jax_kv::HeadDimError(head_dim)),
      return {o, itemsize == 4
                     ? jax_kv::PlanGqaDecode<float, HEAD_DIM>(batch, num_q_heads, num_kv_heads, o)
                     : jax_kv::PlanGqaDecode<jax_kv::bf16_t, HEAD_DIM>(batch, num_q_heads,
                                                                       num_kv_heads, o)};);
}

NB_MODULE(_ffi_cuda, m) {
  m.doc() = "jax_kv CUDA handlers (XLA FFI, command-buffer compatible)";
  m.def("registrations", []() {
    nb::dict d;
    d["jax_kv_gqa_decode"] = Capsule(JaxKvGqaDecodeCuda);
    d["jax_kv_gqa_prefill"] = Capsule(JaxKvGqaPrefillCuda);
    d["jax_kv_gqa_prefill_packed"] = Capsule(JaxKvGqaPrefillPackedCuda);
    d["jax_kv_grow_cache"] = Capsule(JaxKvGrowCacheCuda);
    return d;
  });
  m.def(
      "decode_plan",
      [](int batch, int num_q_heads, int num_kv_heads, int head_dim, int itemsize, int kernel,
         int cta_shape, int splits) {
        const auto [o, plan] = DecodePlanOf(batch, num_q_heads, num_kv_heads, head_dim, itemsize,
                                            kernel, cta_shape, splits);
        nb::dict d;
        d["kernel"] = o.kernel == jax_kv::DecodeKernel::kMma ? "mma" : "simt";
        d["num_splits"] = plan.num_splits;
        d["chunk_multiple"] = plan.chunk_multiple;
        d["min_chunk"] = plan.min_chunk;
        d["workspace_floats"] =
            jax_kv::GqaDecodeWorkspaceFloats(plan, batch, num_q_heads, num_kv_heads, head_dim);
        return d;
      },
      nb::arg("batch"), nb::arg("num_q_heads"), nb::arg("num_kv_heads"), nb::arg("head_dim"),
      nb::arg("itemsize"), nb::arg("kernel"), nb::arg("cta_shape"), nb::arg("splits") = 0,
      "A decode call's plan on the current device, for the `kernel`, `cta_shape` and `splits` "
      "attribute values (0 = auto): the kernel it runs ('mma' or 'simt'); num_splits splits, "
      "each a multiple of chunk_multiple tokens and at least min_chunk (with splits > 0 none of "
      "the three follows the batch); and workspace_floats, the float32 workspace that plan needs "
      "(partials and counters, 0 without splits; never a function of the capacity S). "
      "ValueError where the handler would refuse the call.");
  m.def(
      "prefill_uses_wgmma",
      [](int head_dim, int itemsize, int kernel) {
        if (kernel != 0 && kernel != 1) {
          throw std::invalid_argument("kernel: expected 0 (auto) or 1 (mma), got " +
                                      std::to_string(kernel));
        }
        return jax_kv::PrefillUsesWgmma(static_cast<jax_kv::PrefillKernel>(kernel), head_dim,
                                        itemsize);
      },
      nb::arg("head_dim"), nb::arg("itemsize"), nb::arg("kernel"),
      "Whether the prefill handler launches the wgmma kernel for this head dim, item size and "
      "`kernel` attribute value (0 = auto, 1 = mma) on the current device.");
  m.def(
      "host_calls",
      []() {
        nb::dict d;
        for (int i = 0; i < jax_kv::kNumHostCallTargets; ++i) {
          d[kTargetNames[i]] = jax_kv::g_host_calls[i].load(std::memory_order_relaxed);
        }
        return d;
      },
      "Host-code runs of each CUDA handler since import or the last reset_host_calls().");
  m.def(
      "reset_host_calls",
      []() {
        for (auto& c : jax_kv::g_host_calls) c.store(0, std::memory_order_relaxed);
      },
      "Zeroes the host-call counters.");
  m.def(
      "_take_counter_region", [](int n) { return jax_kv::split_decode::TakeCounterRegion(n); },
      nb::arg("n"),
      "Tests only: takes the pool region a decode launch needing n counters would get (its "
      "word offset), or -1 where that launch would zero workspace counters instead.");
  m.attr("split_counter_pool_words") = jax_kv::split_decode::kCounterPoolWords;
}
