# Builds _ffi_cuda: the CUDA kernels (cuda/*.cu) and their XLA FFI handlers (ffi/*.cc).
# sm_90a SASS for the H100/H200 (the arch-specific target: wgmma) plus compute_90 PTX, so a
# newer GPU can still JIT the kernels (the wgmma ones compile to a trap there and are not chosen).
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES "90a-real;90-virtual")
endif()
enable_language(CUDA)
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
find_package(CUDAToolkit REQUIRED)

nanobind_add_module(_ffi_cuda NB_STATIC
  ffi/module_cuda.cc
  ffi/gqa_decode.cc
  ffi/gqa_prefill.cc
  ffi/grow_cache.cc
  cuda/device_info.cu
  cuda/gqa_decode_simt.cu
  cuda/gqa_decode_simt_bf16.cu
  cuda/gqa_decode_simt_f16.cu
  cuda/gqa_decode_mma.cu
  cuda/gqa_prefill.cu
  cuda/gqa_prefill_wgmma.cu
  cuda/grow_cache.cu)
target_include_directories(_ffi_cuda PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}")
target_include_directories(_ffi_cuda SYSTEM PRIVATE "${XLA_FFI_INCLUDE_DIR}")
# Handlers see CUDA's bf16/f16 types, the same ones the kernels are instantiated for.
target_compile_definitions(_ffi_cuda PRIVATE JKV_CUDA_TYPES)
target_compile_options(_ffi_cuda PRIVATE
  $<$<COMPILE_LANGUAGE:CXX>:${JKV_WARNINGS} -O2>
  $<$<COMPILE_LANGUAGE:CUDA>:-O3 -Xcompiler=-Wall,-Wextra,-Werror
    -Werror=all-warnings -lineinfo>)
# Static cudart: the module needs no libcudart.so at import, whatever jax's CUDA plugin ships.
target_link_libraries(_ffi_cuda PRIVATE CUDA::cudart_static)
install(TARGETS _ffi_cuda LIBRARY DESTINATION jax_kv)
