// Standalone driver of the CUDA prefill kernels for Nsight Compute, built without Python, XLA
// or the FFI module (seconds to compile against minutes for the package):
//
//   nvcc -O3 -std=c++17 -I. -arch=sm_90a -DJKV_PREFILL_ALL_CONFIGS -o /tmp/prefill_profile
//       bench/prefill_profile.cu cuda/gqa_prefill.cu cuda/gqa_prefill_wgmma.cu
//       cuda/device_info.cu    (one command)
//   /tmp/prefill_profile [T] [past]    # times the kernels (CUDA events, median), checks each
//                                      # wgmma configuration's output against mma.sync's
//   ncu --set full -k regex:GqaPrefill -c 1 /tmp/prefill_profile 16384 0 1
//
// bf16, B=1, Hq=32, Hkv=8, D=128, seq-major cache, random inputs. The third argument limits the
// run to one launch of the default kernel (for the profiler). The check is a smoke test of the
// configurations the handler does not launch; the GPU tests (tests/ops/test_gpu_ops.py) check
// the default one, and bench/attention.py gives the figures of record.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "cuda/dtypes.h"
#include "cuda/gqa_prefill.cuh"
#include "cuda/gqa_prefill_common.cuh"

namespace {

constexpr int kHq = 32, kHkv = 8, kD = 128;

#define CHECK(x)                                                                             \
  do {                                                                                       \
    cudaError_t e = (x);                                                                     \
    if (e != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

__global__ void FillRandom(jax_kv::bf16_t* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    x[i] = __float2bfloat16((h & 0xffff) / 32768.0f - 1.0f);
  }
}

jax_kv::bf16_t* Random(int64_t n, uint32_t seed) {
  jax_kv::bf16_t* p = nullptr;
  CHECK(cudaMalloc(&p, std::max<int64_t>(n, 1) * sizeof(jax_kv::bf16_t)));
  FillRandom<<<1024, 256>>>(p, n, seed);
  CHECK(cudaGetLastError());
  return p;
}

using P = jax_kv::GqaParams<jax_kv::bf16_t>;

// One wgmma kernel shape (bf16, D=128), instantiated under -DJKV_PREFILL_ALL_CONFIGS.
template <int WGS, int BLOCK_N, bool PINGPONG>
cudaError_t LaunchShape(const P& p) {
  return jax_kv::LaunchGqaPrefillWgmmaConfig<jax_kv::bf16_t, kD, WGS, BLOCK_N, PINGPONG>(p,
                                                                                         nullptr);
}

}  // namespace

int main(int argc, char** argv) {
  const int T = argc > 1 ? std::atoi(argv[1]) : 16384;
  const int past = argc > 2 ? std::atoi(argv[2]) : 0;
  const bool once = argc > 3 && std::atoi(argv[3]) != 0;
  const int S = past + T;
  jax_kv::GqaParams<jax_kv::bf16_t> p{};
  p.q = Random(int64_t{T} * kHq * kD, 1);
  p.k_new = Random(int64_t{T} * kHkv * kD, 2);
  p.v_new = Random(int64_t{T} * kHkv * kD, 3);
  p.k_cache = Random(int64_t{S} * kHkv * kD, 4);
  p.v_cache = Random(int64_t{S} * kHkv * kD, 5);
  CHECK(cudaMalloc(&p.out, int64_t{T} * kHq * kD * sizeof(jax_kv::bf16_t)));
  int32_t* ints = nullptr;
  CHECK(cudaMalloc(&ints, 2 * sizeof(int32_t)));
  CHECK(cudaMemcpy(ints, &past, sizeof(int32_t), cudaMemcpyHostToDevice));
  p.lengths = ints;
  p.status = ints + 1;
  p.cache = {int64_t{S} * kHkv * kD, kHkv * kD, kD};  // seq-major [B, S, Hkv, D]
  p.batch = 1;
  p.num_tokens = T;
  p.num_q_heads = kHq;
  p.num_kv_heads = kHkv;
  p.head_dim = kD;
  p.capacity = S;
  p.scale = 0.08838834764831845f;
  CHECK(cudaDeviceSynchronize());

  if (once) {
    CHECK((jax_kv::LaunchGqaPrefill<jax_kv::bf16_t, kD>(p, nullptr)));
    CHECK(cudaDeviceSynchronize());
    return 0;
  }
  const double flops = 4.0 * kHq * kD * (double(T) * past + double(T) * (T + 1) / 2);
  using jax_kv::bf16_t;
  const std::pair<const char*, std::function<cudaError_t(const P&)>> kernels[] = {
      {"mma.sync",
       [](const P& q) {
         return jax_kv::LaunchGqaPrefill<bf16_t, kD>(q, nullptr, jax_kv::PrefillKernel::kMma);
       }},
      {"wgmma default (2 wg, 128 keys)",
       [](const P& q) { return jax_kv::LaunchGqaPrefill<bf16_t, kD>(q, nullptr); }},
      {"wgmma 2 wg, 128 keys, ping-pong", LaunchShape<2, 128, true>},
      {"wgmma 2 wg, 64 keys, ping-pong", LaunchShape<2, 64, true>},
      {"wgmma 2 wg, 64 keys", LaunchShape<2, 64, false>},
      {"wgmma 1 wg, 64 keys (2 CTAs/SM)", LaunchShape<1, 64, false>},
      {"wgmma 1 wg, 128 keys", LaunchShape<1, 128, false>},
  };
  const int64_t n_out = int64_t{T} * kHq * kD;
  std::vector<bf16_t> ref(n_out), got(n_out);
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  for (const auto& [name, launch] : kernels) {
    CHECK(cudaMemset(p.out, 0xff, n_out * sizeof(bf16_t)));  // NaN: a row left unwritten shows
    CHECK(launch(p));
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(got.data(), p.out, n_out * sizeof(bf16_t), cudaMemcpyDeviceToHost));
    if (&name == &kernels[0].first) ref = got;
    double max_diff = 0;
    for (int64_t i = 0; i < n_out; ++i) {
      const double d = std::fabs(double(__bfloat162float(got[i])) - __bfloat162float(ref[i]));
      max_diff = std::isnan(d) ? INFINITY : std::max(max_diff, d);
    }
    std::vector<float> ms;
    for (int rep = 0; rep < 7; ++rep) {
      constexpr int kIters = 5;
      CHECK(cudaEventRecord(start));
      for (int i = 0; i < kIters; ++i) CHECK(launch(p));
      CHECK(cudaEventRecord(stop));
      CHECK(cudaEventSynchronize(stop));
      float t = 0;
      CHECK(cudaEventElapsedTime(&t, start, stop));
      ms.push_back(t / kIters);
    }
    std::sort(ms.begin(), ms.end());
    const float med = ms[ms.size() / 2];
    std::printf("T=%d past=%d %-34s %8.3f ms %6.1f TFLOP/s  max |out - mma.sync| %.2e %s\n", T,
                past, name, med, flops / (med * 1e-3) / 1e12, max_diff,
                max_diff <= 2e-2 ? "ok" : "MISMATCH");
  }
  return 0;
}
