// GQA decode, kernel 2, instantiated for f16 (cuda/gqa_decode_v2.cuh): one nvcc job per
// dtype, so the build's longest job is a third of what it was.
#include "cuda/gqa_decode_v2.cuh"

namespace jax_kv {

template cudaError_t LaunchGqaDecodeV2<f16_t>(const GqaParams<f16_t>&, cudaStream_t);

}  // namespace jax_kv
