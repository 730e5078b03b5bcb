// Work shared out as it is done: a kernel's units (a product's panels or tiles) go to torch's
// threads a chunk at a time, in one of two orders:
//   - kShared: every thread takes the next chunk of one run, the threads streaming
//     neighbouring chunks (a decode step's bf16 products, which prefetch within a chunk);
//   - kOwnRuns: the units start split evenly, a run per thread (run r of R: [n r / R,
//     n (r + 1) / R)); each thread takes its own run's chunks from the front, and once done,
//     chunks from the back of another's. Undisturbed, a thread streams its run front to back
//     as with fixed runs, and prefetches may run ahead into its next chunk (the quantized
//     products' 8 KB; a prompt's bf16 products, which the shared order made ~5% slower).
//
// Why: the executor shares its cores with the other stages (scheduler, detokenizer, API
// workers), whose bursts of Python take a core from one of the threads for a while. With fixed
// runs, the thread that lost its core still owns the rest of its run, and every other thread
// waits for it at the kernel's end: the step is late by the whole time taken. Here the threads
// still running take over the chunks it has not reached.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "work_pool.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace llm_cpu_work {

enum class Order { kShared, kOwnRuns };

class WorkQueue {
 public:
  // Units [0, n) in `runs` runs (a run's bounds are two 32-bit halves of one atomic word),
  // taken `grain` at a time.
  WorkQueue(int64_t n, int64_t grain, int64_t runs)
      : runs_(runs), grain_(std::max<int64_t>(1, grain)), bounds_(new Bounds[runs]) {
    TORCH_CHECK(n >= 0 && n < (int64_t{1} << 31) && runs > 0, "WorkQueue: ", n, " units in ",
                runs, " runs");
    for (int64_t r = 0; r < runs; ++r)
      bounds_[r].value.store(pack(n * r / runs, n * (r + 1) / runs), std::memory_order_relaxed);
  }

  // The next chunk [begin, end) for the thread of run `self` (any index, with one run): from
  // the front of its own run, else from the back of another's; false once all are taken.
  bool take(int64_t self, int64_t& begin, int64_t& end) {
    self %= runs_;
    if (take_from(self, true, begin, end)) return true;
    for (int64_t i = 1; i < runs_; ++i) {
      if (take_from((self + i) % runs_, false, begin, end)) return true;
    }
    return false;
  }

 private:
  struct alignas(64) Bounds {  // a run's [lo, hi): lo in the low 32 bits; a cache line each
    std::atomic<uint64_t> value;
  };

  static uint64_t pack(int64_t lo, int64_t hi) {
    return static_cast<uint64_t>(lo) | (static_cast<uint64_t>(hi) << 32);
  }

  bool take_from(int64_t run, bool front, int64_t& begin, int64_t& end) {
    std::atomic<uint64_t>& bounds = bounds_[run].value;
    uint64_t seen = bounds.load(std::memory_order_relaxed);
    while (true) {
      const int64_t lo = static_cast<int64_t>(seen & 0xffffffffu);
      const int64_t hi = static_cast<int64_t>(seen >> 32);
      if (lo >= hi) return false;
      begin = front ? lo : std::max(lo, hi - grain_);
      end = front ? std::min(hi, lo + grain_) : hi;
      const uint64_t left = front ? pack(end, hi) : pack(lo, begin);
      if (bounds.compare_exchange_weak(seen, left, std::memory_order_relaxed)) return true;
    }
  }

  const int64_t runs_, grain_;
  std::unique_ptr<Bounds[]> bounds_;
};

// A chunk size for n units: about `per_thread` chunks in each thread's run, at least `least`.
inline int64_t grain_for(int64_t n, int64_t per_thread, int64_t least = 1) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  return std::max<int64_t>(least, n / (threads * per_thread));
}

// Runs worker(queue, w) on the pool's threads (work_pool.h: at most one per unit, w = 0 the
// caller), w the thread's index; a worker keeps its own state (tiles, buffers) across the chunks
// it takes (queue.take(w, begin, end)). A run whose thread did not come is taken by the others.
// Inside another parallel region it runs on the calling thread, which takes every chunk.
template <typename F>
void parallel_queue(int64_t n, int64_t grain, Order order, const F& worker) {
  if (n <= 0) return;
  const int64_t workers = std::min<int64_t>(n, std::max<int64_t>(1, at::get_num_threads()));
  WorkQueue queue(n, grain, order == Order::kShared ? 1 : workers);
  Pool::instance().run(workers, [&](int64_t w) { worker(queue, w); });
}

// at::parallel_for's contract on the pool: f(begin, end) over disjoint chunks of [begin, end)
// of at least `grain` units (the last may be shorter), each thread taking the next chunk as it
// goes; f may be called several times on a thread.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t least = std::max<int64_t>(1, grain);
  const int64_t workers = std::min<int64_t>(threads, (n + least - 1) / least);
  if (workers <= 1) {
    f(begin, end);
    return;
  }
  const int64_t chunk = std::max<int64_t>(least, n / (workers * 4));
  parallel_queue(n, chunk, Order::kShared, [&](WorkQueue& queue, int64_t w) {
    for (int64_t lo, hi; queue.take(w, lo, hi);) f(begin + lo, begin + hi);
  });
}

}  // namespace llm_cpu_work
