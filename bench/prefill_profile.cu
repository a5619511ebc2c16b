// Standalone driver of the CUDA prefill kernels for Nsight Compute, built without Python, XLA
// or the FFI module (seconds to compile against minutes for the package):
//
//   nvcc -O3 -std=c++17 -I. -arch=sm_90a -o /tmp/prefill_profile bench/prefill_profile.cu \
//       cuda/gqa_prefill.cu cuda/gqa_prefill_wgmma.cu cuda/device_info.cu
//   /tmp/prefill_profile [T] [past]           # times both kernels (CUDA events, median)
//   ncu --set full -k regex:GqaPrefill -c 1 /tmp/prefill_profile 16384 0 1
//
// bf16, B=1, Hq=32, Hkv=8, D=128, seq-major cache, random inputs. The third argument limits the
// run to one launch of the default kernel (for the profiler). It checks nothing: the GPU tests
// do (tests/ops/test_gpu_ops.py); bench/attention.py gives the figures of record.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/dtypes.h"
#include "cuda/gqa_prefill.cuh"

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
    CHECK(jax_kv::LaunchGqaPrefill(p, nullptr));
    CHECK(cudaDeviceSynchronize());
    return 0;
  }
  const double flops = 4.0 * kHq * kD * (double(T) * past + double(T) * (T + 1) / 2);
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  for (auto kernel : {jax_kv::PrefillKernel::kAuto, jax_kv::PrefillKernel::kMma}) {
    std::vector<float> ms;
    for (int rep = 0; rep < 7; ++rep) {
      CHECK(jax_kv::LaunchGqaPrefill(p, nullptr, kernel));  // warm-up / smem opt-in
      CHECK(cudaEventRecord(start));
      constexpr int kIters = 5;
      for (int i = 0; i < kIters; ++i) CHECK(jax_kv::LaunchGqaPrefill(p, nullptr, kernel));
      CHECK(cudaEventRecord(stop));
      CHECK(cudaEventSynchronize(stop));
      float t = 0;
      CHECK(cudaEventElapsedTime(&t, start, stop));
      ms.push_back(t / kIters);
    }
    std::sort(ms.begin(), ms.end());
    std::printf("T=%d past=%d %-5s %.3f ms %.1f TFLOP/s\n", T, past,
                kernel == jax_kv::PrefillKernel::kAuto ? "auto" : "mma", ms[ms.size() / 2],
                flops / (ms[ms.size() / 2] * 1e-3) / 1e12);
  }
  return 0;
}
