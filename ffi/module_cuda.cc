// NB_MODULE(_ffi_cuda): the CUDA handlers as capsules, the decode workspace size, the decode
// and prefill kernel selection, and the per-target host-call counters (the CUDA-graph replay
// signal).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/gqa_decode.cuh"
#include "cuda/gqa_prefill.cuh"
#include "ffi/host_calls.h"
#include "ffi/kernel_choice.h"
#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxKvGqaDecodeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxKvGqaPrefillCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxKvGrowCacheCuda);

namespace jax_kv {
std::atomic<int64_t> g_host_calls[kNumHostCallTargets];
std::atomic<int> g_decode_kernel{3};
std::atomic<int> g_prefill_kernel{static_cast<int>(PrefillKernel::kAuto)};
}  // namespace jax_kv

namespace nb = nanobind;

template <typename Fn>
static nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

static const char* const kTargetNames[jax_kv::kNumHostCallTargets] = {
    "jax_kv_gqa_decode", "jax_kv_gqa_prefill", "jax_kv_grow_cache"};

NB_MODULE(_ffi_cuda, m) {
  m.doc() = "jax_kv CUDA handlers (XLA FFI, command-buffer compatible)";
  m.def("registrations", []() {
    nb::dict d;
    d["jax_kv_gqa_decode"] = Capsule(JaxKvGqaDecodeCuda);
    d["jax_kv_gqa_prefill"] = Capsule(JaxKvGqaPrefillCuda);
    d["jax_kv_grow_cache"] = Capsule(JaxKvGrowCacheCuda);
    return d;
  });
  m.def(
      "workspace_floats",
      [](const std::string& op, int64_t batch, int64_t num_tokens, int64_t num_q_heads,
         int64_t head_dim, int64_t capacity) -> int64_t {
        (void)num_tokens;
        (void)capacity;  // the split count never depends on S (DESIGN.md, decode guidance)
        if (op == "prefill") return 0;
        if (op != "decode") {
          throw std::invalid_argument("op: expected 'decode' or 'prefill', got '" + op + "'");
        }
        if (batch <= 0 || num_q_heads <= 0 || head_dim <= 0) return 0;
        // Both kernels fit: the selection may change between tracing and recording.
        const int b = static_cast<int>(batch), hq = static_cast<int>(num_q_heads),
                  d = static_cast<int>(head_dim);
        return std::max(jax_kv::GqaDecodeWorkspaceFloats(b, hq, d),
                        jax_kv::GqaDecodeV2WorkspaceFloats(b, hq, d));
      },
      nb::arg("op"), nb::arg("batch"), nb::arg("num_tokens"), nb::arg("num_q_heads"),
      nb::arg("head_dim"), nb::arg("capacity"),
      "float32 workspace elements the op needs on the current device (split-K partials).");
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
      "num_splits",
      [](int batch, int num_q_heads, int num_kv_heads) {
        return jax_kv::GqaDecodeNumSplits(batch, num_q_heads, num_kv_heads);
      },
      nb::arg("batch"), nb::arg("num_q_heads"), nb::arg("num_kv_heads"),
      "Split count decode kernel 1 uses on the current device (for tests and benches).");
  m.def(
      "set_decode_kernel",
      [](int kernel) {
        if (kernel < 1 || kernel > 3) {
          throw std::invalid_argument("decode kernel: expected 1, 2 or 3, got " +
                                      std::to_string(kernel));
        }
        jax_kv::g_decode_kernel.store(kernel, std::memory_order_relaxed);
      },
      nb::arg("kernel"),
      "Selects the decode kernel (1, 2 or 3) the handler launches from now on; a CUDA graph "
      "recorded earlier keeps its kernel.");
  m.def(
      "decode_kernel", []() { return jax_kv::g_decode_kernel.load(std::memory_order_relaxed); },
      "The decode kernel (1, 2 or 3) the handler launches.");
  m.def(
      "set_prefill_kernel",
      [](const std::string& kernel) {
        jax_kv::PrefillKernel k;
        if (kernel == "auto") {
          k = jax_kv::PrefillKernel::kAuto;
        } else if (kernel == "mma") {
          k = jax_kv::PrefillKernel::kMma;
        } else {
          throw std::invalid_argument("prefill kernel: expected 'auto' or 'mma', got '" + kernel +
                                      "'");
        }
        jax_kv::g_prefill_kernel.store(static_cast<int>(k), std::memory_order_relaxed);
      },
      nb::arg("kernel"),
      "Selects the prefill kernel from now on: 'auto' (wgmma for bf16/f16 at head dims 64 and "
      "128 on a compute-capability 9.0 GPU, mma.sync otherwise) or 'mma' (mma.sync always); a "
      "CUDA graph recorded earlier keeps its kernel.");
  m.def(
      "prefill_kernel",
      []() -> std::string {
        return jax_kv::g_prefill_kernel.load(std::memory_order_relaxed) ==
                       static_cast<int>(jax_kv::PrefillKernel::kMma)
                   ? "mma"
                   : "auto";
      },
      "The prefill kernel setting: 'auto' or 'mma'.");
  m.def(
      "prefill_uses_wgmma",
      [](int head_dim, int itemsize) {
        return jax_kv::PrefillUsesWgmma(
            static_cast<jax_kv::PrefillKernel>(
                jax_kv::g_prefill_kernel.load(std::memory_order_relaxed)),
            head_dim, itemsize);
      },
      nb::arg("head_dim"), nb::arg("itemsize"),
      "Whether the prefill handler launches the wgmma kernel for this head dim and item size.");
  m.def(
      "set_decode_v2_ctas",
      [](const std::string& shape) {
        int v;
        if (shape == "auto") {
          v = jax_kv::kDecodeV2Auto;
        } else if (shape == "narrow") {
          v = jax_kv::kDecodeV2Narrow;
        } else if (shape == "wide") {
          v = jax_kv::kDecodeV2Wide;
        } else {
          throw std::invalid_argument("shape: expected 'auto', 'narrow' or 'wide', got '" + shape +
                                      "'");
        }
        jax_kv::g_decode_v2_ctas.store(v, std::memory_order_relaxed);
      },
      nb::arg("shape"),
      "Decode kernel 2's CTA shape: 'auto' (wide CTAs where B * Hkv is under the SM count), "
      "'narrow' (4 warps) or 'wide' (16, or 8 at group 8); a CUDA graph recorded earlier "
      "keeps its shape.");
  m.def(
      "decode_v2_ctas",
      []() -> std::string {
        switch (jax_kv::g_decode_v2_ctas.load(std::memory_order_relaxed)) {
          case jax_kv::kDecodeV2Narrow:
            return "narrow";
          case jax_kv::kDecodeV2Wide:
            return "wide";
          default:
            return "auto";
        }
      },
      "Decode kernel 2's CTA shape setting: 'auto', 'narrow' or 'wide'.");
  m.def(
      "set_split_counters",
      [](const std::string& where) {
        if (where != "pool" && where != "workspace") {
          throw std::invalid_argument("where: expected 'pool' or 'workspace', got '" + where + "'");
        }
        jax_kv::g_split_counter_pool.store(where == "pool", std::memory_order_relaxed);
      },
      nb::arg("where"),
      "Where decode kernels 2 and 3 keep their split counters: 'pool' (default: device memory "
      "the kernels keep at zero, no zeroing node) or 'workspace' (zeroed by a kernel node before "
      "each launch); a CUDA graph recorded earlier keeps its choice.");
  m.def(
      "split_counters",
      []() -> std::string {
        return jax_kv::g_split_counter_pool.load(std::memory_order_relaxed) ? "pool" : "workspace";
      },
      "Where decode kernels 2 and 3 keep their split counters: 'pool' or 'workspace'.");
  m.def(
      "_take_counter_region", [](int n) { return jax_kv::split_decode::TakeCounterRegion(n); },
      nb::arg("n"),
      "Tests only: takes the pool region a decode launch needing n counters would get (its "
      "word offset), or -1 where that launch would zero workspace counters instead.");
  m.attr("split_counter_pool_words") = jax_kv::split_decode::kCounterPoolWords;
  m.def(
      "decode_plan",
      [](int batch, int num_q_heads, int num_kv_heads, int head_dim, int itemsize) {
        if (batch <= 0 || num_q_heads <= 0 || num_kv_heads <= 0 ||
            num_q_heads % num_kv_heads != 0 || (itemsize != 2 && itemsize != 4)) {
          throw std::invalid_argument(
              "decode_plan: expected positive B, Hq, Hkv with Hq % Hkv == 0 and itemsize 2 or 4");
        }
        jax_kv::GqaDecodePlan plan{jax_kv::GqaDecodeNumSplits(batch, num_q_heads, num_kv_heads), 16,
                                   32};
        switch (jax_kv::g_decode_kernel.load(std::memory_order_relaxed)) {
          case 2:
            plan = jax_kv::GqaDecodeV2Plan(batch, num_q_heads, num_kv_heads, head_dim, itemsize);
            break;
          case 3:
            plan = jax_kv::GqaDecodeMmaPlan(batch, num_q_heads, num_kv_heads, head_dim, itemsize);
            break;
          default:
            break;
        }
        return nb::make_tuple(plan.num_splits, plan.chunk_multiple, plan.min_chunk);
      },
      nb::arg("batch"), nb::arg("num_q_heads"), nb::arg("num_kv_heads"), nb::arg("head_dim"),
      nb::arg("itemsize"),
      "(num_splits, chunk_multiple, min_chunk) of the selected decode kernel on the current "
      "device: each split covers a multiple of chunk_multiple tokens, at least min_chunk.");
}
