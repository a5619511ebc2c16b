// The head dims jax_kv supports, spelled once for C++, and the one switch that turns a runtime
// head dim into a compile-time one. Plain C++ (no CUDA, no XLA headers): the CPU module, the CUDA
// handlers and the kernels all include it. Python spells the same set once too
// (jax_kv/ops/_common.py SUPPORTED_HEAD_DIMS); tests/ops/test_dispatch.py checks that the two
// agree through _ffi_cpu.supported_head_dims().
#pragma once

#include <cstdint>
#include <string>

// X(D, args...) for every supported head dim D, in increasing order: the list itself. Pass at
// least one argument after X (C++17 wants one for the `...`).
#define JKV_FOR_EACH_HEAD_DIM(X, ...) \
  X(64, __VA_ARGS__) X(80, __VA_ARGS__) X(96, __VA_ARGS__) X(128, __VA_ARGS__) X(256, __VA_ARGS__)

#define JKV_HEAD_DIM_CASE_(D, NAME, ...) \
  case D: {                              \
    constexpr int NAME = D;              \
    __VA_ARGS__                          \
  } break;

// Runs the body with `constexpr int NAME` equal to head_dim (FlashInfer's DISPATCH_HEAD_DIM);
// for any other value it runs `otherwise`, a statement that returns or throws an error naming
// the value and the supported set (HeadDimError). A kernel that takes fewer head dims branches
// on NAME at compile time (if constexpr) inside the body.
#define JKV_DISPATCH_HEAD_DIM(head_dim, NAME, otherwise, ...)    \
  switch (head_dim) {                                            \
    JKV_FOR_EACH_HEAD_DIM(JKV_HEAD_DIM_CASE_, NAME, __VA_ARGS__) \
    default:                                                     \
      otherwise;                                                 \
  }

namespace jax_kv {

#define JKV_HEAD_DIM_ITEM_(D, ...) D,
inline constexpr int kSupportedHeadDims[] = {JKV_FOR_EACH_HEAD_DIM(JKV_HEAD_DIM_ITEM_, _)};
#undef JKV_HEAD_DIM_ITEM_

constexpr bool SupportedHeadDim(int64_t d) {
  for (int s : kSupportedHeadDims) {
    if (s == d) return true;
  }
  return false;
}

// "64, 80, 96, 128, 256"
inline std::string SupportedHeadDimsText() {
  std::string s;
  for (int d : kSupportedHeadDims) s += (s.empty() ? "" : ", ") + std::to_string(d);
  return s;
}

// "head_dim must be one of 64, 80, 96, 128, 256, got 48": what every dispatch's default says.
inline std::string HeadDimError(int64_t head_dim) {
  return "head_dim must be one of " + SupportedHeadDimsText() + ", got " + std::to_string(head_dim);
}

}  // namespace jax_kv
