// bench_support.h: what the benchmark programs share: sizes, counters, flags, reporting.
#pragma once

#include <benchmark/benchmark.h>

#include <cstddef>
#include <string>
#include <vector>

#include "dp/launch.h"

namespace dp::bench {

/// Registers the program's benchmarks; each program that uses bench_main.cpp defines it.
void register_benchmarks();

/// Message sizes in bytes: 4 KiB to 256 MiB in steps of 4 (nccl-tests sweeps the same way).
std::vector<std::size_t> message_sizes();

/// "4KiB", "64MiB": a size as the benchmark names show it.
std::string size_label(std::size_t bytes);

/// A fixed iteration count for a message of `bytes`: about 1 GiB moved per benchmark,
/// between 5 and 1000 iterations. Fixed, not adaptive, so that every MPI process runs
/// exactly the same calls and the processes stay in lockstep.
benchmark::IterationCount iterations_for(std::size_t bytes);

/// Sets the counters nccl-tests reports, from the total manual time of the run:
/// algbw = S / t and busbw = algbw x `bus_factor` (GB/s, 1 GB = 1e9 bytes), plus the
/// message size `bytes` and the number of `ranks`.
void set_bandwidth_counters(benchmark::State& state, std::size_t bytes, double total_seconds,
                            double bus_factor, int ranks);

/// Discards everything: the reporter of every MPI process but rank 0.
class NullReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

/// Removes `--backend=NAME` or `--backend NAME` from the arguments and returns the backend
/// it names. Without the flag: the environment variable DPLAB_BENCH_BACKEND, otherwise
/// mpi when this process was started by mpirun and local when it was not.
Backend take_backend_flag(int& argc, char** argv);

/// Removes the --benchmark_out flags, so that only one process writes the output file.
void drop_output_flags(int& argc, char** argv);

}  // namespace dp::bench
