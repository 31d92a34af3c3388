// rank_pool.cpp: the persistent local ranks of the benchmarks (see rank_pool.h).
#include "rank_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <thread>

#include "dp/launch.h"

namespace dp::bench {

RankPool::RankPool(int world_size)
    : RankPool(LaunchOptions{.world_size = world_size, .backend = Backend::kLocal}) {}

RankPool::RankPool(const LaunchOptions& options)
    : world_size_(options.world_size),
      start_line_(options.world_size),
      finish_(static_cast<std::size_t>(options.world_size)) {
  launcher_ = std::thread([this, options] {
    try {
      launch(options, [this](Communicator& comm) { serve(comm); });
    } catch (...) {
      // A rank's job failed: `serve` recorded the error for `run` to rethrow.
    }
  });
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return ranks_ready_ == world_size_ || failed_; });
}

RankPool::~RankPool() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  launcher_.join();
}

bool RankPool::healthy() const {
  std::lock_guard lock(mutex_);
  return !failed_;
}

void RankPool::bind_to_core(int rank) const {
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return;  // unbound: still correct
  if (CPU_COUNT(&allowed) < world_size_) return;  // oversubscribed: let the scheduler share
  int seen = -1;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &allowed) || ++seen != rank) continue;
    cpu_set_t own;
    CPU_ZERO(&own);
    CPU_SET(cpu, &own);
    pthread_setaffinity_np(pthread_self(), sizeof(own), &own);  // a failure leaves it unbound
    return;
  }
}

void RankPool::serve(Communicator& comm) {
  bind_to_core(comm.rank());
  std::uint64_t seen = 0;
  std::unique_lock lock(mutex_);
  if (++ranks_ready_ == world_size_) changed_.notify_all();
  for (;;) {
    changed_.wait(lock, [&] { return stopping_ || failed_ || generation_ != seen; });
    if (stopping_ || failed_) return;
    seen = generation_;
    const Job& job = *job_;
    lock.unlock();
    try {
      job(comm);
    } catch (...) {
      lock.lock();
      if (!error_) error_ = std::current_exception();
      failed_ = true;
      changed_.notify_all();
      lock.unlock();
      // Leaving rank_main lets dp::launch abort the peers that are inside a collective.
      throw;
    }
    lock.lock();
    if (++ranks_done_ == world_size_) changed_.notify_all();
  }
}

void RankPool::StartLine::arrive_and_wait(TimePoint& start) {
  const std::uint64_t generation = generation_.load(std::memory_order_acquire);
  if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == ranks_) {
    arrived_.store(0, std::memory_order_relaxed);
    start = std::chrono::steady_clock::now();
    generation_.fetch_add(1, std::memory_order_release);
    return;
  }
  // Spin; past a few microseconds (more ranks than cores?) let the others run between checks.
  for (int spins = 0; generation_.load(std::memory_order_acquire) == generation; ++spins) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
    if (spins > 512) std::this_thread::yield();
  }
}

void RankPool::run(const Job& job) {
  std::unique_lock lock(mutex_);
  if (failed_) std::rethrow_exception(error_);
  job_ = &job;
  ranks_done_ = 0;
  ++generation_;
  changed_.notify_all();
  changed_.wait(lock, [&] { return ranks_done_ == world_size_ || failed_; });
  if (failed_) std::rethrow_exception(error_);
}

double RankPool::run_timed(const Job& job) {
  run([&](Communicator& comm) {
    start_line_.arrive_and_wait(start_);
    job(comm);
    finish_[static_cast<std::size_t>(comm.rank())] = std::chrono::steady_clock::now();
  });
  const TimePoint last = *std::max_element(finish_.begin(), finish_.end());
  return std::chrono::duration<double>(last - start_).count();
}

}  // namespace dp::bench

namespace dp::bench {

std::vector<double> RankPool::run_timed_repeatedly(const Job& job, std::int64_t iterations) {
  const auto count = static_cast<std::size_t>(iterations);
  std::vector<TimePoint> starts(count);
  std::vector<std::vector<TimePoint>> finishes(static_cast<std::size_t>(world_size_),
                                               std::vector<TimePoint>(count));
  run([&](Communicator& comm) {
    std::vector<TimePoint>& mine = finishes[static_cast<std::size_t>(comm.rank())];
    for (std::size_t i = 0; i < count; ++i) {
      start_line_.arrive_and_wait(starts[i]);
      job(comm);
      mine[i] = std::chrono::steady_clock::now();
    }
  });
  std::vector<double> seconds(count);
  for (std::size_t i = 0; i < count; ++i) {
    TimePoint last = starts[i];
    for (const auto& rank_finishes : finishes) last = std::max(last, rank_finishes[i]);
    seconds[i] = std::chrono::duration<double>(last - starts[i]).count();
  }
  return seconds;
}

}  // namespace dp::bench
