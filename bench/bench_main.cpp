// The main() of the benchmark programs that register their benchmarks in code
// (bench_train_step, bench_simulation): Google Benchmark's own main, with the process
// allocator set up first so that large buffers stay mapped between iterations.
#include <benchmark/benchmark.h>

#include "bench_support.h"
#include "dp/memory.h"

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  dp::configure_process_allocator();
  dp::bench::register_benchmarks();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
