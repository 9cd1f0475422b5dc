// parallel_for over XLA's intra-op thread pool, for the FFI kernels in this folder.
//
// The calling thread drains items too and then waits for the items, never for the tasks: a task that starts after
// the call returned finds no item left and touches nothing but the shared counters it co-owns, so a busy pool (or
// one whose only thread is the caller) cannot deadlock the call or read freed buffers.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace pagejax {

// Calls fn(i) once for every i in [0, total); fn is copied into each task and must be safe on any thread.
template <typename Fn>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t total, Fn fn) {
  struct Counters {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  if (total <= 0) return;
  auto counters = std::make_shared<Counters>();
  auto drain = [fn, counters, total]() {
    for (int64_t i; (i = counters->next.fetch_add(1)) < total;) {
      fn(i);
      counters->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), total - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(drain)(drain));
  drain();
  while (counters->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
}

}  // namespace pagejax
