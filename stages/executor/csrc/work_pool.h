// The kernels' own threads: a fork-join pool whose join waits only for the threads that took
// part, not for every thread of the team.
//
// Why: the executor shares its cores with the other stages and with whatever else runs on the
// host (a client, a proxy, a benchmark's load generator). An OpenMP parallel region ends at a
// barrier every thread of the team must reach, so a thread the kernel's scheduler has taken off
// its core stalls every region until it comes back, even one it had no part in (a region starts
// by waking it, and ends by waiting for it). With a process busy half of one core beside a bf16
// decode at batch 32 on two cores, the forward kept 0.61-0.64x of its undisturbed speed under
// OpenMP's barriers; spinning less (GOMP_SPINCOUNT, OMP_WAIT_POLICY) did not help. On this pool
// it keeps 0.70-0.72x (a core and a half left to it: 0.75x at best), as fast undisturbed.
//
// Here a region (run) is a job the calling thread posts and starts on at once; a helper joins
// only if it is running and sees the job open, and the caller, once its own part is done, closes
// the job and waits only for the helpers that joined. Work inside a job is shared out as it goes
// (work_queue.h), so a helper that never came leaves its share to the threads that did. The one
// wait left is for a helper taken off its core in the middle of a chunk: the caller spins a
// little, then sleeps (a futex), which frees its core for the helper to finish on.
//
// Helpers spin between jobs for a while (kSpinMicros), as OpenMP's threads do, so that a decode
// step's hundreds of jobs do not each pay a wake-up; while they spin they yield the core to any
// thread the scheduler has waiting on it (sched_yield), so that a spinning helper does not hold
// back the caller or a helper in the middle of a chunk. Past the spin they sleep on a futex
// until the next job.
//
// The pool has torch's thread count (at::get_num_threads(), set by the executor) less the
// caller: helpers are started as first needed, and live as long as the process.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <omp.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

namespace llm_cpu_work {

namespace pool_detail {

inline void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr,
          nullptr, 0);
}

inline void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr,
          nullptr, 0);
}

// Spins until done() or `micros` have passed; true if done. After the first few microseconds
// each round of pauses ends with a sched_yield, so that a thread the scheduler has queued on
// this core runs instead of the spin.
template <typename Done>
bool spin_until(const Done& done, int64_t micros) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  for (int64_t round = 0;; ++round) {
    for (int i = 0; i < 32; ++i) {
      if (done()) return true;
      _mm_pause();
    }
    const int64_t spent = std::chrono::duration_cast<std::chrono::microseconds>(
        Clock::now() - start).count();
    if (spent >= micros) return done();
    if (spent >= 2) sched_yield();
  }
}

}  // namespace pool_detail

class Pool {
 public:
  static Pool& instance() {
    static Pool* pool = new Pool();  // never destroyed: helpers may still sleep at exit
    return *pool;
  }

  // Runs fn(w) for w in [0, workers) on at most `workers` threads, w = 0 on the calling thread,
  // each other w on a helper that joined in time; returns once every call has returned. The
  // calls that run are not all of [0, workers): a worker must not count on another index running
  // (the work queue hands the work of a run no thread took to the threads that came).
  template <typename F>
  void run(int64_t workers, const F& fn) {
    if (workers <= 1 || in_region()) {
      fn(0);
      return;
    }
    ensure_helpers(workers - 1);
    std::lock_guard<std::mutex> lock(post_);  // one job at a time (callers outside a job)
    call_ = [](const void* f, int64_t w) { (*static_cast<const F*>(f))(w); };
    fn_ = &fn;
    const uint64_t gen = (ticket_.load(std::memory_order_relaxed) >> 32) + 1;
    ticket_.store(pack(gen, 1, workers), std::memory_order_seq_cst);
    wake_.store(static_cast<uint32_t>(gen), std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) pool_detail::futex_wake_all(&wake_);
    t_in_job = true;
    try {
      fn(0);
    } catch (...) {
      t_in_job = false;
      close_and_wait(gen);
      failed_ = false;  // (the caller's own error is the one raised)
      failure_ = nullptr;
      throw;
    }
    t_in_job = false;
    close_and_wait(gen);
    if (failed_) {
      failed_ = false;
      std::rethrow_exception(std::exchange(failure_, nullptr));
    }
  }

 private:
  // A job's ticket: its generation (high 32 bits), the next w to hand out (16 bits) and its
  // worker count (16 bits, 0 once closed).
  static uint64_t pack(uint64_t gen, int64_t next, int64_t workers) {
    return (gen << 32) | (static_cast<uint64_t>(next) << 16) | static_cast<uint64_t>(workers);
  }

  static bool in_region() { return t_in_job || omp_in_parallel() || at::in_parallel_region(); }

  void ensure_helpers(int64_t wanted) {
    if (helpers_.load(std::memory_order_acquire) >= wanted) return;
    std::lock_guard<std::mutex> lock(grow_);
    TORCH_CHECK(wanted < (1 << 15), "work pool: ", wanted, " helper threads");
    for (int64_t h = helpers_.load(std::memory_order_relaxed); h < wanted; ++h) {
      std::thread([this] { helper(); }).detach();
      helpers_.store(h + 1, std::memory_order_release);
    }
  }

  void close_and_wait(uint64_t gen) {
    ticket_.store(pack(gen, 0, 0), std::memory_order_seq_cst);  // no helper joins from here
    auto idle = [this] { return running_.load(std::memory_order_seq_cst) == 0; };
    if (pool_detail::spin_until(idle, kCallerSpinMicros)) return;
    waiting_.store(1, std::memory_order_seq_cst);
    for (uint32_t seen; (seen = running_.load(std::memory_order_seq_cst)) != 0;)
      pool_detail::futex_wait(&running_, seen);
    waiting_.store(0, std::memory_order_relaxed);
  }

  // Joins the open job of ticket t if a w is left: running_ counts it first, so the caller
  // (which closes the ticket, then waits for running_ to fall to 0) waits for it.
  void try_join(uint64_t t) {
    running_.fetch_add(1, std::memory_order_seq_cst);
    uint64_t seen = t;
    while (true) {
      const int64_t next = static_cast<int64_t>((seen >> 16) & 0xffff);
      const int64_t workers = static_cast<int64_t>(seen & 0xffff);
      if ((seen >> 32) != (t >> 32) || next >= workers) break;
      if (ticket_.compare_exchange_weak(seen, pack(seen >> 32, next + 1, workers),
                                        std::memory_order_seq_cst)) {
        t_in_job = true;
        try {
          call_(fn_, next);
        } catch (...) {
          std::lock_guard<std::mutex> lock(grow_);
          if (!failed_) failure_ = std::current_exception();
          failed_ = true;
        }
        t_in_job = false;
        break;
      }
    }
    if (running_.fetch_sub(1, std::memory_order_seq_cst) == 1 &&
        waiting_.load(std::memory_order_seq_cst) != 0)
      pool_detail::futex_wake_all(&running_);
  }

  [[noreturn]] void helper() {
    uint64_t last_gen = ticket_.load(std::memory_order_acquire) >> 32;
    auto posted = [&] { return (ticket_.load(std::memory_order_acquire) >> 32) != last_gen; };
    while (true) {
      if (!pool_detail::spin_until(posted, kSpinMicros)) {
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        const uint32_t seen = static_cast<uint32_t>(last_gen);
        if (!posted()) pool_detail::futex_wait(&wake_, seen);
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        continue;
      }
      const uint64_t t = ticket_.load(std::memory_order_acquire);
      last_gen = t >> 32;
      try_join(t);
    }
  }

  inline static thread_local bool t_in_job = false;
  // Spins: a helper's for the next job (a decode step posts one every ~80 us, and a wake-up
  // from the futex costs tens of microseconds), the caller's for helpers still in their last
  // chunk (past it, a helper has most likely lost its core: the caller's sleep frees one).
  static constexpr int64_t kSpinMicros = 200;
  static constexpr int64_t kCallerSpinMicros = 30;

  std::mutex post_, grow_;
  void (*call_)(const void*, int64_t) = nullptr;
  const void* fn_ = nullptr;
  bool failed_ = false;
  std::exception_ptr failure_;
  std::atomic<int64_t> helpers_{0};
  alignas(64) std::atomic<uint64_t> ticket_{0};
  alignas(64) std::atomic<uint32_t> wake_{0};     // the generation's low bits: helpers sleep on it
  alignas(64) std::atomic<uint32_t> running_{0};  // helpers inside try_join: the caller sleeps on it
  alignas(64) std::atomic<int32_t> sleepers_{0};
  std::atomic<uint32_t> waiting_{0};
};

}  // namespace llm_cpu_work
