// A blocking parallel-for over [0, n) for the CPU reference handlers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace jax_kv {

// Static contiguous chunks: the work items (one (b, kv head) stripe each) cost about the same.
// Threads are spawned per call (~20 us each): negligible beside a 4096-token stripe, and it
// keeps the reference free of a pool's lifetime questions.
template <typename Fn>
void ParallelFor(int64_t n, int64_t min_items_per_thread, Fn fn) {
  const int64_t hw = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t threads =
      std::clamp<int64_t>(n / std::max<int64_t>(1, min_items_per_thread), 1, hw);
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (int64_t t = 0; t < threads; ++t) {
    pool.emplace_back([=, &fn] {
      for (int64_t i = n * t / threads; i < n * (t + 1) / threads; ++i) fn(i);
    });
  }
  for (auto& th : pool) th.join();
}

}  // namespace jax_kv
