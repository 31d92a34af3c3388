// rank_pool.h: a persistent set of local-backend ranks that run the jobs handed to them.
//
// Benchmarks must not time thread creation or a new `LocalWorld` per iteration, so a
// `RankPool` starts `dp::launch` once on a background thread and keeps its ranks waiting
// for work. `run` hands every rank the same job and returns when all have finished;
// `run_timed` also lines the ranks up at a spinning start line and returns the time from
// the moment the last rank arrived (the common start) to the moment the slowest rank
// finished.
//
// Like `mpirun --bind-to core`, which tools/run-benchmarks uses for the MPI side of the same
// comparison, the pool binds rank r's thread to the r-th core this process may use when
// there are at least as many cores as ranks. Unbound, two rank threads woken on one core
// can share it for a whole run (under `chrt -f` the scheduler need not move either), and a
// 64 MiB all-reduce then takes 7 ms instead of 4 on two cores.
//
// Example:
//
//   RankPool pool(4);
//   std::vector<std::vector<float>> data(4, std::vector<float>(1 << 20));
//   double seconds = pool.run_timed([&](dp::Communicator& comm) {   // or run_timed_repeatedly
//     comm.allreduce(std::span(data[comm.rank()]), dp::ReduceOp::kSum)->wait();
//   });
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "dp/comm.h"
#include "dp/launch.h"

namespace dp::bench {

/// N local ranks, started once, that execute jobs until the pool is destroyed.
class RankPool {
 public:
  /// What every rank runs: it receives the rank's communicator.
  using Job = std::function<void(Communicator&)>;

  /// Starts `world_size` ranks and returns once they wait for work.
  explicit RankPool(int world_size);
  /// Starts the ranks `options` describe (local backend; e.g. with the simulated clock).
  explicit RankPool(const LaunchOptions& options);
  /// Lets the ranks return from `dp::launch` and joins it.
  ~RankPool();
  RankPool(const RankPool&) = delete;
  RankPool& operator=(const RankPool&) = delete;

  /// Number of ranks.
  int size() const { return world_size_; }
  /// False once a job threw: the ranks' world is aborted and the pool must be replaced.
  bool healthy() const;

  /// Runs `job` on every rank; returns when all have finished. Rethrows a rank's error.
  void run(const Job& job);
  /// Like `run`, but every rank first waits at a barrier: returns the seconds from the
  /// barrier's release to the end of the slowest rank's job.
  double run_timed(const Job& job);
  /// `run_timed` `iterations` times within one job, so that the ranks never sleep between
  /// iterations (as MPI processes, which poll, never do): the seconds of each iteration.
  std::vector<double> run_timed_repeatedly(const Job& job, std::int64_t iterations);

 private:
  using TimePoint = std::chrono::steady_clock::time_point;

  /// The start line of a timed job: the last rank to arrive records the common start and
  /// releases the others, who spin meanwhile. (std::barrier puts waiters to sleep: waking
  /// them would be timed too, tens of microseconds against a 4 KiB all-reduce's few.)
  class StartLine {
   public:
    explicit StartLine(int ranks) : ranks_(ranks) {}
    /// Waits for every rank; returns once the last one has recorded `start`.
    void arrive_and_wait(TimePoint& start);

   private:
    const int ranks_;
    std::atomic<int> arrived_{0};
    std::atomic<std::uint64_t> generation_{0};
  };

  void serve(Communicator& comm);
  /// Binds the calling rank thread to its own core when the cores outnumber the ranks.
  void bind_to_core(int rank) const;

  const int world_size_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  const Job* job_ = nullptr;
  std::uint64_t generation_ = 0;  // incremented for each job handed out
  int ranks_ready_ = 0;
  int ranks_done_ = 0;
  bool stopping_ = false;
  bool failed_ = false;
  std::exception_ptr error_;

  TimePoint start_;
  StartLine start_line_;
  std::vector<TimePoint> finish_;  // per rank, of the last timed job

  std::thread launcher_;  // runs dp::launch; last member, so it starts after the rest
};

}  // namespace dp::bench
