// Out-of-place cache growth: live prefix copied, the rest zero-filled, both layouts by strides.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/grow_cache.cuh"

namespace jax_kv {
namespace {

constexpr int kThreads = 256;
constexpr int kBytesPerBlock = 16384;  // ~64 B per thread: enough blocks even at B*Hkv = 8

// Grid (row blocks, Hkv, B). VEC is the copy unit in bytes: 16 when every row and base
// pointer is 16-byte aligned (any D >= 8 in bf16), else 1.
template <int VEC>
__global__ void __launch_bounds__(kThreads)
    GrowCacheKernel(const GrowParams p, int rows_per_block) {
  using Unit = std::conditional_t<VEC == 16, uint4, uint8_t>;
  const int h = blockIdx.y, b = blockIdx.z;
  const int L = p.lengths[b];
  const bool bad = L < 0 || L > p.src_capacity;
  if (blockIdx.x == 0 && h == 0 && threadIdx.x == 0) {
    p.status[b] = bad ? JKV_STATUS_LENGTH_OUT_OF_RANGE : JKV_STATUS_OK;
  }
  const int live = bad ? 0 : L;
  const int units = p.head_dim * p.elem_bytes / VEC;
  const int64_t s0 = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t e = p.elem_bytes;
  for (int i = threadIdx.x; i < rows_per_block * units; i += kThreads) {
    const int64_t s = s0 + i / units;
    const int c = i % units;
    if (s >= p.dst_capacity) break;
    Unit* dst = reinterpret_cast<Unit*>(p.dst + kv_offset(p.dst_strides, b, s, h) * e) + c;
    if (s < live) {
      *dst = reinterpret_cast<const Unit*>(p.src + kv_offset(p.src_strides, b, s, h) * e)[c];
    } else {
      *dst = Unit{};
    }
  }
}

}  // namespace

cudaError_t LaunchGrowCache(const GrowParams& p, cudaStream_t stream) {
  if (p.batch <= 0 || p.num_kv_heads <= 0) return cudaSuccess;
  if (p.batch > 65535 || p.num_kv_heads > 65535) return cudaErrorInvalidConfiguration;
  const int row_bytes = p.head_dim * p.elem_bytes;
  const bool aligned = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(p.src) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(p.dst) % 16 == 0;
  const int rows = row_bytes > 0 ? std::max(1, kBytesPerBlock / row_bytes) : 1;
  const int64_t blocks =
      std::max<int64_t>(1, (static_cast<int64_t>(p.dst_capacity) + rows - 1) / rows);
  const dim3 grid(static_cast<unsigned>(blocks), p.num_kv_heads, p.batch);
  if (aligned) {
    GrowCacheKernel<16><<<grid, kThreads, 0, stream>>>(p, rows);
  } else {
    GrowCacheKernel<1><<<grid, kThreads, 0, stream>>>(p, rows);
  }
  return cudaGetLastError();
}

}  // namespace jax_kv
