// CPU handler of jax_kv_grow_cache: out-of-place growth that copies only the live prefix.
#include <cstring>

#include "ffi/common.h"
#include "ffi/cpu_parallel.h"

namespace jax_kv {

static ffi::Error GrowCacheCpuDispatch(ffi::AnyBuffer cache, ffi::Buffer<ffi::S32> lengths,
                                       ffi::Result<ffi::AnyBuffer> new_cache,
                                       ffi::Result<ffi::Buffer<ffi::S32>> status, int32_t layout) {
  GrowParams p;
  ffi::Error err = FillGrowParams(cache, lengths, *new_cache, status, layout, &p);
  if (err.failure()) return err;
  for (int b = 0; b < p.batch; ++b) {
    if (p.lengths[b] < 0 || p.lengths[b] > p.src_capacity) {
      return InvalidArgument(
          "lengths[" + std::to_string(b) + "]=" + std::to_string(p.lengths[b]) +
          ": expected 0 <= lengths[b] <= capacity S=" + std::to_string(p.src_capacity));
    }
  }
  const int64_t row_bytes = static_cast<int64_t>(p.head_dim) * p.elem_bytes;
  std::memset(p.dst, 0, new_cache->size_bytes());
  int64_t live_bytes = 0;
  for (int b = 0; b < p.batch; ++b)
    live_bytes += int64_t{p.lengths[b]} * p.num_kv_heads * row_bytes;
  ParallelFor(int64_t{p.batch} * p.num_kv_heads, live_bytes, [&](int64_t item) {
    const int64_t b = item / p.num_kv_heads, h = item % p.num_kv_heads;
    for (int64_t s = 0; s < p.lengths[b]; ++s) {
      std::memcpy(p.dst + kv_offset(p.dst_strides, b, s, h) * p.elem_bytes,
                  p.src + kv_offset(p.src_strides, b, s, h) * p.elem_bytes, row_bytes);
    }
  });
  for (int b = 0; b < p.batch; ++b) p.status[b] = JKV_STATUS_OK;
  return ffi::Error::Success();
}

}  // namespace jax_kv

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxKvGrowCacheCpu, jax_kv::GrowCacheCpuDispatch, JKV_GROW_BINDING());
