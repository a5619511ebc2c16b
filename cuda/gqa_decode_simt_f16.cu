// GQA decode, simt, instantiated for f16 at every supported head dim (cuda/gqa_decode_simt.cuh):
// one nvcc job per dtype, so the build's longest job is a third of what it was.
#include "cuda/gqa_decode_simt.cuh"
#include "cuda/head_dims.h"

namespace jax_kv {

JKV_FOR_EACH_HEAD_DIM(JKV_DECODE_SIMT_INSTANTIATE, f16_t)

}  // namespace jax_kv
