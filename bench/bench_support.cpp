// bench_support.cpp: sizes, counters and flags shared by the benchmark programs.
#include "bench_support.h"

#include <algorithm>
#include <cstdlib>
#include <string_view>

namespace dp::bench {

std::vector<std::size_t> message_sizes() {
  std::vector<std::size_t> sizes;
  for (std::size_t bytes = std::size_t{4} << 10; bytes <= std::size_t{256} << 20; bytes *= 4)
    sizes.push_back(bytes);
  return sizes;
}

std::string size_label(std::size_t bytes) {
  if (bytes >= (std::size_t{1} << 20) && bytes % (std::size_t{1} << 20) == 0)
    return std::to_string(bytes >> 20) + "MiB";
  if (bytes >= (std::size_t{1} << 10) && bytes % (std::size_t{1} << 10) == 0)
    return std::to_string(bytes >> 10) + "KiB";
  return std::to_string(bytes) + "B";
}

benchmark::IterationCount iterations_for(std::size_t bytes) {
  constexpr std::size_t kBytesPerBenchmark = std::size_t{1} << 30;
  const auto wanted = static_cast<benchmark::IterationCount>(kBytesPerBenchmark / bytes);
  return std::clamp<benchmark::IterationCount>(wanted, 5, 1000);
}

void set_bandwidth_counters(benchmark::State& state, std::size_t bytes, double total_seconds,
                            double bus_factor, int ranks) {
  // Computed here rather than with Counter::kIsRate, whose divisor is not the manual time.
  const double seconds_per_call = total_seconds / static_cast<double>(state.iterations());
  const double algbw = static_cast<double>(bytes) / seconds_per_call / 1e9;
  state.counters["algbw_GBps"] = algbw;
  state.counters["busbw_GBps"] = algbw * bus_factor;
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["ranks"] = ranks;
}

namespace {

// Removes argv[index] .. argv[index + count - 1], keeping argv[argc] == nullptr.
void erase_arguments(int& argc, char** argv, int index, int count) {
  for (int i = index; i + count <= argc; ++i) argv[i] = argv[i + count];
  argc -= count;
}

}  // namespace

Backend take_backend_flag(int& argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view argument = argv[i];
    if (argument.starts_with("--backend=")) {
      const Backend backend = parse_backend(argument.substr(10));
      erase_arguments(argc, argv, i, 1);
      return backend;
    }
    if (argument == "--backend" && i + 1 < argc) {
      const Backend backend = parse_backend(argv[i + 1]);
      erase_arguments(argc, argv, i, 2);
      return backend;
    }
  }
  if (const char* name = std::getenv("DPLAB_BENCH_BACKEND"); name && *name)
    return parse_backend(name);
  return started_by_mpi() ? Backend::kMpi : Backend::kLocal;
}

void drop_output_flags(int& argc, char** argv) {
  for (int i = 1; i < argc;) {
    if (std::string_view(argv[i]).starts_with("--benchmark_out")) {
      erase_arguments(argc, argv, i, 1);
    } else {
      ++i;
    }
  }
}

}  // namespace dp::bench
