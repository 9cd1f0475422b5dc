// parallel_for over a small pool of spinning worker threads, shared by every kernel of this library.
//
// Why not XLA's intra-op pool (ffi::ThreadPool): its workers sleep between ops, and waking one costs tens of
// microseconds on these VMs, longer than a batch-1 GEMV of a SmolLM2 layer (~30 us). Tasks scheduled there started
// after the caller had done all the work, so a decode step ran on one core (measured: the same time with and
// without helpers). These workers spin for a while after each job (by default 0.2 ms), so the back-to-back
// kernel calls of a decode step find them awake, and then sleep on a condition variable.
//
// One job at a time: a call that finds the pool busy (another device's shard running concurrently, say) runs its
// items on the calling thread. The caller always works too, and returns only after every item is done and no
// worker is inside the job, so `fn` and what it points to may live on the caller's stack. Thread count: all
// hardware threads (the caller plus std::thread::hardware_concurrency() - 1 workers), or $PAGEJAX_CPU_THREADS.
// The spin: $PAGEJAX_CPU_SPIN_US microseconds (default 200). A spinning worker holds a core that XLA's own thread
// pool may want for the parallel fusions between kernel calls; scripts/bench/cpu_spin_bench.py compares values
// (on a loaded 2-core machine the runs disagreed, BENCHMARKS.md), so the default stays until a quiet run decides.

#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace pagejax {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

class Workers {
 public:
  static Workers& get() {
    static Workers* workers = new Workers();  // never destroyed: workers may still wait when the process exits
    return *workers;
  }

  // Calls fn(i) once for every i in [0, total), on the caller and the workers.
  template <typename Fn>
  void parallel_for(int64_t total, const Fn& fn) {
    std::unique_lock<std::mutex> busy(job_mutex_, std::try_to_lock);
    if (total <= 1 || threads_.empty() || !busy.owns_lock()) {
      for (int64_t i = 0; i < total; ++i) fn(i);
      return;
    }
    call_ = [](const void* f, int64_t i) { (*static_cast<const Fn*>(f))(i); };
    fn_ = &fn;
    total_ = total;
    next_.store(0, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    open_.store(true, std::memory_order_release);
    generation_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    drain();
    open_.store(false, std::memory_order_seq_cst);
    while (done_.load(std::memory_order_acquire) < total || active_.load(std::memory_order_seq_cst) > 0) cpu_relax();
  }

 private:
  std::chrono::microseconds spin_{200};

  Workers() {
    int64_t n = std::thread::hardware_concurrency();
    if (const char* env = std::getenv("PAGEJAX_CPU_THREADS")) n = std::atoll(env);
    if (const char* env = std::getenv("PAGEJAX_CPU_SPIN_US")) spin_ = std::chrono::microseconds(std::atoll(env));
    for (int64_t i = 1; i < n; ++i) threads_.emplace_back([this] { loop(); });
    for (auto& t : threads_) t.detach();
  }

  void drain() {
    for (int64_t i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < total_;) {
      call_(fn_, i);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void loop() {
    uint64_t seen = generation_.load();
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + spin_;
      for (int64_t spins = 0; generation_.load(std::memory_order_acquire) == seen; ++spins) {
        cpu_relax();
        if (spins % 64 == 0 && std::chrono::steady_clock::now() > until) break;
      }
      if (generation_.load(std::memory_order_acquire) == seen) {
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        std::unique_lock<std::mutex> lock(sleep_mutex_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
      }
      seen = generation_.load(std::memory_order_acquire);
      active_.fetch_add(1, std::memory_order_seq_cst);  // enter, then check: a closed job is never touched
      if (open_.load(std::memory_order_seq_cst)) drain();
      active_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  std::vector<std::thread> threads_;
  std::mutex job_mutex_;
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> sleepers_{0};
  std::atomic<int64_t> active_{0};
  std::atomic<bool> open_{false};
  std::atomic<int64_t> next_{0};
  std::atomic<int64_t> done_{0};
  void (*call_)(const void*, int64_t) = nullptr;
  const void* fn_ = nullptr;
  int64_t total_ = 0;
};

// Calls fn(i) once for every i in [0, total), spread over the caller and the shared workers.
template <typename Fn>
void parallel_for(int64_t total, const Fn& fn) {
  Workers::get().parallel_for(total, fn);
}

}  // namespace pagejax
