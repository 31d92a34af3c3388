// bench_collectives.cpp: bandwidth of the communicator's collectives, nccl-tests style.
//
// For each message size S (the whole array, 4 KiB to 256 MiB) it times all-reduce,
// reduce-scatter and all-gather and reports algbw = S / t and busbw = algbw x 2(n-1)/n
// (all-reduce) or x (n-1)/n (reduce-scatter, all-gather), so that every collective can be
// compared with the machine's copy bandwidth. t is the time of the slowest rank from a
// common start. Every benchmark checks the collective's result after its timed loop.
//
//   bench_collectives                       local backend at 2 and 4 ranks (threads of
//                                           this process), plus single-thread memcpy
//   mpirun -n 4 bench_collectives --backend mpi
//                                           mpi backend at 4 ranks, plus MPI_Allreduce
//                                           called directly, for comparison
//
// Under mpi every process runs the same benchmarks with fixed iteration counts, so the
// processes stay in lockstep; only rank 0 prints and writes --benchmark_out.
#include <benchmark/benchmark.h>
#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <exception>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#ifdef DP_BENCH_HAVE_MPI
#include <mpi.h>
#endif

#include "bench_support.h"
#include "dp/comm.h"
#include "dp/launch.h"
#include "dp/memory.h"
#include "rank_pool.h"

namespace dp::bench {
namespace {

enum class Collective { kAllReduce, kReduceScatter, kAllGather, kRawMpiAllreduce };

/// One benchmark: a collective over `ranks` ranks on an array of `bytes` bytes in all.
struct CollectiveCase {
  Collective op;
  std::size_t bytes;
  int ranks;

  std::size_t elements() const { return bytes / sizeof(float); }
  std::size_t shard() const { return elements() / static_cast<std::size_t>(ranks); }
  /// The nccl-tests factor from algorithm bandwidth to bus bandwidth.
  double bus_factor() const {
    const double n = ranks;
    return op == Collective::kReduceScatter || op == Collective::kAllGather ? (n - 1) / n
                                                                            : 2 * (n - 1) / n;
  }
};

/// One rank's buffers, kept across benchmarks: allocating (and first touching) them in
/// every benchmark would cost more than the collectives themselves.
struct RankBuffers {
  std::vector<float> input;
  std::vector<float> output;

  void reserve(std::size_t elements) {
    // Fresh vectors rather than resize(): growing would copy the old contents for nothing.
    if (input.size() < elements) input = std::vector<float>(elements);
    if (output.size() < elements) output = std::vector<float>(elements);
  }
};

// Small integers, so every sum is exact in float32 whatever the order of addition.
float initial_value(int rank, std::size_t index) {
  return static_cast<float>(rank + 1) + static_cast<float>(index % 5);
}

float sum_over_ranks(int ranks, std::size_t index) {
  return static_cast<float>(ranks * (ranks + 1) / 2) +
         static_cast<float>(ranks) * static_cast<float>(index % 5);
}

void fill_input(const CollectiveCase& c, int rank, RankBuffers& buffers) {
  const std::size_t count = c.op == Collective::kAllGather ? c.shard() : c.elements();
  for (std::size_t i = 0; i < count; ++i) buffers.input[i] = initial_value(rank, i);
}

void issue(const CollectiveCase& c, Communicator& comm, RankBuffers& buffers) {
  const std::span<float> whole(buffers.input.data(), c.elements());
  switch (c.op) {
    case Collective::kAllReduce: comm.allreduce(whole, ReduceOp::kSum)->wait(); return;
    case Collective::kReduceScatter:
      comm.reduce_scatter(whole, std::span(buffers.output.data(), c.shard()), ReduceOp::kSum)
          ->wait();
      return;
    case Collective::kAllGather:
      comm.allgather(std::span(buffers.input.data(), c.shard()),
                     std::span(buffers.output.data(), c.elements()))
          ->wait();
      return;
    case Collective::kRawMpiAllreduce:
#ifdef DP_BENCH_HAVE_MPI
      MPI_Allreduce(MPI_IN_PLACE, buffers.input.data(), static_cast<int>(c.elements()), MPI_FLOAT,
                    MPI_SUM, MPI_COMM_WORLD);
#endif
      return;
  }
}

/// Empty when rank `rank`'s output is right, otherwise what is wrong (the first bad element).
std::string check_output(const CollectiveCase& c, int rank, const RankBuffers& buffers) {
  auto mismatch = [&](std::size_t index, float seen, float expected) {
    return "rank " + std::to_string(rank) + ": element " + std::to_string(index) + " is " +
           std::to_string(seen) + ", expected " + std::to_string(expected);
  };
  switch (c.op) {
    case Collective::kAllReduce:
    case Collective::kRawMpiAllreduce:
      for (std::size_t i = 0; i < c.elements(); ++i)
        if (buffers.input[i] != sum_over_ranks(c.ranks, i))
          return mismatch(i, buffers.input[i], sum_over_ranks(c.ranks, i));
      return {};
    case Collective::kReduceScatter: {
      const std::size_t first = static_cast<std::size_t>(rank) * c.shard();
      for (std::size_t k = 0; k < c.shard(); ++k)
        if (buffers.output[k] != sum_over_ranks(c.ranks, first + k))
          return mismatch(k, buffers.output[k], sum_over_ranks(c.ranks, first + k));
      return {};
    }
    case Collective::kAllGather:
      for (std::size_t i = 0; i < c.elements(); ++i) {
        const int owner = static_cast<int>(i / c.shard());
        const float expected = initial_value(owner, i % c.shard());
        if (buffers.output[i] != expected) return mismatch(i, buffers.output[i], expected);
      }
      return {};
  }
  return "unknown collective";
}

/// Per-rank work: the rank's communicator and buffers.
using RankStep = std::function<void(Communicator&, RankBuffers&)>;
/// A per-rank check: empty when this rank's result is right, else what is wrong.
using RankCheck = std::function<std::string(Communicator&, RankBuffers&)>;

/// The ranks a benchmark runs on: threads of this process, or this MPI process's rank.
class RankGroup {
 public:
  virtual ~RankGroup() = default;
  virtual int size() const = 0;
  /// Runs `step` on every rank, untimed.
  virtual void run(const RankStep& step) = 0;
  /// Runs `step` `iterations` times on every rank, each from a common start: the slowest
  /// rank's seconds of each iteration.
  virtual std::vector<double> run_timed(const RankStep& step, std::int64_t iterations) = 0;
  /// Runs `check` on every rank: empty if every rank passed, else a failure message. Every
  /// rank returns the same verdict, so all skip a failed benchmark together.
  virtual std::string check(const RankCheck& check) = 0;
};

class LocalRanks final : public RankGroup {
 public:
  explicit LocalRanks(int ranks) : pool_(ranks), buffers_(static_cast<std::size_t>(ranks)) {}
  int size() const override { return pool_.size(); }
  bool healthy() const { return pool_.healthy(); }

  void run(const RankStep& step) override {
    pool_.run([&](Communicator& comm) { step(comm, buffers_of(comm)); });
  }
  std::vector<double> run_timed(const RankStep& step, std::int64_t iterations) override {
    return pool_.run_timed_repeatedly([&](Communicator& comm) { step(comm, buffers_of(comm)); },
                                      iterations);
  }
  std::string check(const RankCheck& check) override {
    std::vector<std::string> verdicts(buffers_.size());
    run([&](Communicator& comm, RankBuffers& buffers) {
      verdicts[static_cast<std::size_t>(comm.rank())] = check(comm, buffers);
    });
    for (const auto& verdict : verdicts)
      if (!verdict.empty()) return verdict;
    return {};
  }

 private:
  RankBuffers& buffers_of(Communicator& comm) {
    return buffers_[static_cast<std::size_t>(comm.rank())];
  }

  RankPool pool_;
  std::vector<RankBuffers> buffers_;  // each touched first by its own rank's thread
};

/// The pool of the local benchmarks now running; replaced when the rank count changes,
/// so that only one pool's buffers are held at a time.
LocalRanks& local_ranks(int ranks) {
  static std::unique_ptr<LocalRanks> current;
  if (!current || current->size() != ranks || !current->healthy()) {
    current.reset();
    current = std::make_unique<LocalRanks>(ranks);
  }
  return *current;
}

#ifdef DP_BENCH_HAVE_MPI
class MpiRanks final : public RankGroup {
 public:
  explicit MpiRanks(Communicator& comm) : comm_(comm) {}
  int size() const override { return comm_.size(); }
  void run(const RankStep& step) override { step(comm_, buffers_); }

  std::vector<double> run_timed(const RankStep& step, std::int64_t iterations) override {
    // MPI_Wtime need not be one clock across machines, so each process times itself
    // from the barrier and the slowest process's time is the collective's.
    std::vector<double> seconds(static_cast<std::size_t>(iterations));
    for (double& elapsed : seconds) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double start = MPI_Wtime();
      step(comm_, buffers_);
      elapsed = MPI_Wtime() - start;
    }
    MPI_Allreduce(MPI_IN_PLACE, seconds.data(), static_cast<int>(seconds.size()), MPI_DOUBLE,
                  MPI_MAX, MPI_COMM_WORLD);
    return seconds;
  }

  std::string check(const RankCheck& check) override {
    const std::string verdict = check(comm_, buffers_);
    int failed = verdict.empty() ? 0 : 1;
    MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (!verdict.empty()) return verdict;
    return failed ? "wrong result on another rank" : "";
  }

 private:
  Communicator& comm_;
  RankBuffers buffers_;
};

MpiRanks* mpi_ranks = nullptr;  // set while the mpi benchmarks run
#endif

/// How many cores this process kept busy since construction: CPU time / wall time. Two
/// local ranks that really run in parallel show about 2; a shared, loaded machine less.
class ProcessCpuMeter {
 public:
  ProcessCpuMeter() : cpu_start_(process_cpu_seconds()), wall_start_(Clock::now()) {}
  double cores_busy() const {
    const double wall = std::chrono::duration<double>(Clock::now() - wall_start_).count();
    return wall > 0 ? (process_cpu_seconds() - cpu_start_) / wall : 0;
  }

 private:
  using Clock = std::chrono::steady_clock;
  static double process_cpu_seconds() {
    timespec now{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &now);
    return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
  }

  double cpu_start_;
  Clock::time_point wall_start_;
};

/// Seconds of untimed iterations before the timed ones.
constexpr double kWarmUpSeconds = 0.25;

/// Runs `step` untimed, as nccl-tests and the OSU benchmarks discard their first
/// iterations: the backend's temporaries get touched, and the OS settles where the ranks
/// run (two local rank threads woken on one core share it until the scheduler moves one,
/// which took about 0.1 s here). Rounds of `iterations` run until kWarmUpSeconds of
/// collective time have passed; under MPI every process sees the same times (the slowest
/// process's), so all run the same number of rounds.
void warm_up(RankGroup& group, const RankStep& step, std::int64_t iterations) {
  double elapsed = 0;
  while (elapsed < kWarmUpSeconds)
    for (const double seconds : group.run_timed(step, iterations)) elapsed += seconds;
}

void benchmark_collective(benchmark::State& state, RankGroup& group, const CollectiveCase& c) {
  try {
    group.run([&](Communicator& comm, RankBuffers& buffers) {
      buffers.reserve(c.elements());
      fill_input(c, comm.rank(), buffers);
    });
    warm_up(
        group, [&](Communicator& comm, RankBuffers& buffers) { issue(c, comm, buffers); },
        state.max_iterations);

    // Every iteration runs first, without the benchmark loop between them (the ranks keep
    // running, as MPI processes do); the loop then reports each iteration's time.
    const ProcessCpuMeter cpu;
    const std::vector<double> times =
        group.run_timed([&](Communicator& comm, RankBuffers& buffers) { issue(c, comm, buffers); },
                        state.max_iterations);
    state.counters["cpu_cores"] = cpu.cores_busy();
    // The median call as well as the mean: on a shared machine a few calls preempted by a
    // neighbour raise the mean of a microsecond-long call, not its median.
    std::vector<double> sorted = times;
    std::nth_element(sorted.begin(),
                     sorted.begin() + static_cast<std::ptrdiff_t>(sorted.size() / 2), sorted.end());
    state.counters["median_us"] = sorted[sorted.size() / 2] * 1e6;
    double total_seconds = 0;
    std::size_t iteration = 0;
    for (auto _ : state) {
      state.SetIterationTime(times[iteration]);
      total_seconds += times[iteration++];
    }

    // The timed loop summed in place over and over; check one call on fresh inputs.
    group.run([&](Communicator& comm, RankBuffers& buffers) {
      fill_input(c, comm.rank(), buffers);
      issue(c, comm, buffers);
    });
    const std::string failure = group.check([&](Communicator& comm, RankBuffers& buffers) {
      return check_output(c, comm.rank(), buffers);
    });
    if (!failure.empty()) {
      state.SkipWithError(("wrong result: " + failure).c_str());
      return;
    }
    set_bandwidth_counters(state, c.bytes, total_seconds, c.bus_factor(), c.ranks);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void benchmark_memcpy(benchmark::State& state, std::size_t bytes) {
  // Kept across sizes for the same reason as the ranks' buffers.
  static std::vector<char> source;
  static std::vector<char> destination;
  if (source.size() < bytes) {
    source = std::vector<char>(bytes, 1);
    destination = std::vector<char>(bytes);
  }
  std::memcpy(destination.data(), source.data(), bytes);  // warm-up, like the collectives
  double total_seconds = 0;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    std::memcpy(destination.data(), source.data(), bytes);
    benchmark::ClobberMemory();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    state.SetIterationTime(seconds);
    total_seconds += seconds;
  }
  if (std::memcmp(destination.data(), source.data(), bytes) != 0) {
    state.SkipWithError("memcpy: the destination differs from the source");
    return;
  }
  set_bandwidth_counters(state, bytes, total_seconds, 1.0, 1);
}

const char* name_of(Collective op) {
  switch (op) {
    case Collective::kAllReduce: return "allreduce";
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kAllGather: return "allgather";
    case Collective::kRawMpiAllreduce: return "MPI_Allreduce";
  }
  return "unknown";
}

constexpr Collective kCommunicatorCollectives[] = {
    Collective::kAllReduce, Collective::kReduceScatter, Collective::kAllGather};

void register_fixed(const std::string& name, std::size_t bytes,
                    std::function<void(benchmark::State&)> body) {
  benchmark::RegisterBenchmark(name.c_str(), [body](benchmark::State& state) { body(state); })
      ->Iterations(iterations_for(bytes))
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
}

void register_local_benchmarks() {
  for (const int ranks : {2, 4})
    for (const Collective op : kCommunicatorCollectives)
      for (const std::size_t bytes : message_sizes()) {
        const CollectiveCase c{op, bytes, ranks};
        register_fixed(std::string(name_of(op)) + "/local/ranks:" + std::to_string(ranks) +
                           "/size:" + size_label(bytes),
                       bytes, [c](benchmark::State& state) {
                         benchmark_collective(state, local_ranks(c.ranks), c);
                       });
      }
  for (const std::size_t bytes : message_sizes())
    register_fixed("memcpy/size:" + size_label(bytes), bytes,
                   [bytes](benchmark::State& state) { benchmark_memcpy(state, bytes); });
}

#ifdef DP_BENCH_HAVE_MPI
void register_mpi_benchmarks(int ranks) {
  for (const Collective op : kCommunicatorCollectives)
    for (const std::size_t bytes : message_sizes()) {
      const CollectiveCase c{op, bytes, ranks};
      register_fixed(std::string(name_of(op)) + "/mpi/ranks:" + std::to_string(ranks) +
                         "/size:" + size_label(bytes),
                     bytes,
                     [c](benchmark::State& state) { benchmark_collective(state, *mpi_ranks, c); });
    }
  for (const std::size_t bytes : message_sizes()) {
    const CollectiveCase c{Collective::kRawMpiAllreduce, bytes, ranks};
    register_fixed("MPI_Allreduce/ranks:" + std::to_string(ranks) + "/size:" + size_label(bytes),
                   bytes,
                   [c](benchmark::State& state) { benchmark_collective(state, *mpi_ranks, c); });
  }
}
#endif

int run_local(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  // dp::launch does this too, but the memcpy benchmark runs outside any launch.
  configure_process_allocator();
  register_local_benchmarks();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

int run_mpi(int argc, char** argv) {
#ifdef DP_BENCH_HAVE_MPI
  if (!started_by_mpi() || mpi_world_size() < 2) {
    fmt::print(stderr,
               "bench_collectives: --backend mpi needs at least 2 processes: start it with "
               "mpirun -n 2 (or more)\n");
    return 2;
  }
  const bool reports = mpi_world_rank() == 0;
  if (!reports) drop_output_flags(argc, argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  register_mpi_benchmarks(mpi_world_size());
  launch({.world_size = mpi_world_size(), .backend = Backend::kMpi}, [&](Communicator& comm) {
    MpiRanks ranks(comm);
    mpi_ranks = &ranks;
    if (reports) {
      benchmark::RunSpecifiedBenchmarks();
    } else {
      NullReporter silent;
      benchmark::RunSpecifiedBenchmarks(&silent);
    }
    mpi_ranks = nullptr;
  });
  benchmark::Shutdown();
  return 0;
#else
  (void)argc;
  (void)argv;
  fmt::print(stderr,
             "bench_collectives: this build has no Open MPI: --backend mpi is unavailable\n");
  return 2;
#endif
}

}  // namespace
}  // namespace dp::bench

int main(int argc, char** argv) {
  try {
    const dp::Backend backend = dp::bench::take_backend_flag(argc, argv);
    return backend == dp::Backend::kMpi ? dp::bench::run_mpi(argc, argv)
                                        : dp::bench::run_local(argc, argv);
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_collectives: {}\n", e.what());
    return 1;
  }
}
