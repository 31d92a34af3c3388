// bench_train_step.cpp: throughput of one training step of the default model.
//
// One step is forward, backward and an SGD step of the MLP 64-256-256-10 on a global batch
// of B samples (64 and 512):
//
//   train_step/single/batch:B          one process, one thread, the whole batch
//   train_step/local/ranks:N/batch:B   N local ranks (threads), each on B/N samples, plus
//                                      the all-reduce (average) of every gradient
//
// And one step of dplab's default GPT (4 blocks, dim 128, 4 heads, context 64) on 8
// windows of text, in one process, without and with activation checkpointing:
//
//   gpt_step/single/checkpointing:off/batch:8
//   gpt_step/single/checkpointing:on/batch:8
//
// with the counters tokens_per_s and activations_peak_bytes (the step's peak of
// `MemoryCategory::kActivations` above the batch's inputs): their ratios are what checkpointing
// costs in time and saves in memory.
//
// The counter samples_per_s is B / (step time); for N ranks the step time is the slowest
// rank's from a common start. For one process, blas_fraction is the share of the step spent
// in BLAS (dp::blas_seconds_of_this_thread). After the timed loop, every rank's parameters must
// equal rank 0's bit for bit (the gradient average is the same on every rank).
#include <benchmark/benchmark.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "bench_support.h"
#include "dp/comm.h"
#include "dp/data.h"
#include "dp/memory.h"
#include "dp/model.h"
#include "dp/ops.h"
#include "dp/optimizer.h"
#include "dp/text_data.h"
#include "rank_pool.h"

namespace dp::bench {
namespace {

constexpr const char* kModelSpec = "64-256-256-10";
constexpr std::uint64_t kSeed = 1;

/// What one rank trains: its replica, optimizer and the batch rows it owns.
struct Replica {
  Model model;
  Sgd sgd;
  Batch batch;
  float last_loss = 0;

  Replica(const Dataset& data, std::size_t first_row, std::size_t rows)
      : model(Model::mlp(kModelSpec, {.seed = kSeed})),
        sgd(model.num_parameters(), {.lr = 0.1f}),
        batch(gather_batch(data, row_range(first_row, rows))) {}

  static std::vector<std::size_t> row_range(std::size_t first, std::size_t count) {
    std::vector<std::size_t> rows(count);
    std::iota(rows.begin(), rows.end(), first);
    return rows;
  }

  /// Forward, backward and the gradient average (when `comm` has peers), then SGD.
  void step(Communicator* comm) {
    model.zero_grad();
    const Tensor logits = model.forward(batch.inputs);
    last_loss = model.backward(logits, batch.labels);
    if (comm != nullptr)
      for (Parameter* parameter : model.parameters())
        comm->allreduce(parameter->grad.span(), ReduceOp::kAvg)->wait();
    sgd.step(model);
  }
};

const Dataset& dataset() {
  static const Dataset data =
      make_synthetic_classification({.samples = 512, .features = 64, .classes = 10, .seed = kSeed});
  return data;
}

void set_throughput_counters(benchmark::State& state, std::size_t batch, int ranks,
                             double total_seconds) {
  const double seconds_per_step = total_seconds / static_cast<double>(state.iterations());
  state.counters["samples_per_s"] = static_cast<double>(batch) / seconds_per_step;
  state.counters["batch"] = static_cast<double>(batch);
  state.counters["ranks"] = ranks;
}

void benchmark_single(benchmark::State& state, std::size_t batch) {
  try {
    // The same single BLAS thread a rank of dp::launch gets, so that N ranks compare with
    // one rank on equal terms.
    set_blas_threads(1);
    Replica replica(dataset(), 0, batch);
    replica.step(nullptr);  // warm-up: the caching allocator fills up here
    double total_seconds = 0;
    const double blas_before = blas_seconds_of_this_thread();
    for (auto _ : state) {
      const auto start = std::chrono::steady_clock::now();
      replica.step(nullptr);
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      state.SetIterationTime(seconds);
      total_seconds += seconds;
    }
    if (!std::isfinite(replica.last_loss)) {
      state.SkipWithError("the loss is not finite");
      return;
    }
    set_throughput_counters(state, batch, 1, total_seconds);
    // The share of the step spent in matrix products (the rest: element-wise layers, the
    // loss, the optimizer, gathering the batch).
    state.counters["blas_fraction"] = (blas_seconds_of_this_thread() - blas_before) / total_seconds;
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

/// The pool of the data-parallel benchmarks now running (one at a time, as in
/// bench_collectives).
RankPool& local_pool(int ranks) {
  static std::unique_ptr<RankPool> current;
  if (!current || current->size() != ranks || !current->healthy()) {
    current.reset();
    current = std::make_unique<RankPool>(ranks);
  }
  return *current;
}

void benchmark_data_parallel(benchmark::State& state, int ranks, std::size_t batch) {
  try {
    RankPool& pool = local_pool(ranks);
    const std::size_t rows_per_rank = batch / static_cast<std::size_t>(ranks);
    std::vector<std::unique_ptr<Replica>> replicas(static_cast<std::size_t>(ranks));
    // Built on the ranks' own threads, so each replica is charged to its rank's memory.
    pool.run([&](Communicator& comm) {
      const auto rank = static_cast<std::size_t>(comm.rank());
      replicas[rank] = std::make_unique<Replica>(dataset(), rank * rows_per_rank, rows_per_rank);
      replicas[rank]->step(&comm);  // warm-up
    });

    // The steps run back to back within one job (as a training loop runs them), then the
    // benchmark loop reports each one's time.
    const std::vector<double> times = pool.run_timed_repeatedly(
        [&](Communicator& comm) { replicas[static_cast<std::size_t>(comm.rank())]->step(&comm); },
        state.max_iterations);
    double total_seconds = 0;
    std::size_t iteration = 0;
    for (auto _ : state) {
      state.SetIterationTime(times[iteration]);
      total_seconds += times[iteration++];
    }

    const std::vector<float> reference = replicas[0]->model.flat_parameters();
    for (int r = 1; r < ranks; ++r) {
      const std::vector<float> mine =
          replicas[static_cast<std::size_t>(r)]->model.flat_parameters();
      if (std::memcmp(mine.data(), reference.data(), reference.size() * sizeof(float)) != 0) {
        state.SkipWithError(
            ("rank " + std::to_string(r) + "'s parameters differ from rank 0's").c_str());
        return;
      }
    }
    if (!std::isfinite(replicas[0]->last_loss)) {
      state.SkipWithError("the loss is not finite");
      return;
    }
    // The replicas' tensors belong to the ranks' memory: release them on their threads.
    pool.run([&](Communicator& comm) { replicas[static_cast<std::size_t>(comm.rank())].reset(); });
    set_throughput_counters(state, batch, ranks, total_seconds);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

/// Text for the GPT: sentences drawn from a small vocabulary of words (not a corpus file, so
/// that the benchmark needs nothing installed). The step's time does not depend on the words.
const Dataset& text_dataset() {
  static const Dataset data = [] {
    const std::vector<std::string> words = {
        "the",  "data", "parallel", "ranks", "reduce", "gradients", "while", "backward",
        "runs", "a",    "bucket",   "shard", "of",     "memory",    "each",  "step"};
    CounterRng rng(kSeed, 29);
    std::string text;
    while (text.size() < 64 * 1024) {
      text += words[rng.below(words.size())];
      text += rng.below(8) == 0 ? ". " : " ";
    }
    return make_text_dataset(text, GptSpec{}.context, "bench-text");
  }();
  return data;
}

void benchmark_gpt(benchmark::State& state, bool checkpointing, std::size_t batch) {
  try {
    set_blas_threads(1);
    // A memory account of its own, so that the peak is this model's.
    ScopedRankMemory memory(std::make_shared<RankMemory>());
    const Dataset& data = text_dataset();
    Model model = Model::gpt(GptSpec{}, data.num_classes,
                             {.seed = kSeed, .activation_checkpointing = checkpointing});
    Sgd sgd(model.num_parameters(), {.lr = 0.1f});
    const Batch windows = gather_batch(data, Replica::row_range(0, batch));
    float loss = 0;
    const auto step = [&] {
      model.zero_grad();
      const Tensor logits = model.forward(windows.inputs);
      loss = model.backward(logits, windows.labels);
      sgd.step(model);
    };
    step();  // warm-up: the caching allocator fills up here
    MemoryTracker& tracker = this_rank_memory().tracker();
    const std::size_t before = tracker.current(MemoryCategory::kActivations);
    tracker.reset_peaks();
    double total_seconds = 0;
    for (auto _ : state) {
      const auto start = std::chrono::steady_clock::now();
      step();
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      state.SetIterationTime(seconds);
      total_seconds += seconds;
    }
    if (!std::isfinite(loss)) {
      state.SkipWithError("the loss is not finite");
      return;
    }
    const double seconds_per_step = total_seconds / static_cast<double>(state.iterations());
    state.counters["tokens_per_s"] =
        static_cast<double>(batch * static_cast<std::size_t>(data.labels_per_sample)) /
        seconds_per_step;
    state.counters["activations_peak_bytes"] =
        static_cast<double>(tracker.peak(MemoryCategory::kActivations) - before);
    state.counters["batch"] = static_cast<double>(batch);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

}  // namespace

void register_benchmarks() {
  for (const bool checkpointing : {false, true})
    benchmark::RegisterBenchmark(
        (std::string("gpt_step/single/checkpointing:") + (checkpointing ? "on" : "off") +
         "/batch:8")
            .c_str(),
        [checkpointing](benchmark::State& state) { benchmark_gpt(state, checkpointing, 8); })
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  for (const std::size_t batch : {64, 512}) {
    benchmark::RegisterBenchmark(
        ("train_step/single/batch:" + std::to_string(batch)).c_str(),
        [batch](benchmark::State& state) { benchmark_single(state, batch); })
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
    for (const int ranks : {2, 4})
      benchmark::RegisterBenchmark(
          ("train_step/local/ranks:" + std::to_string(ranks) + "/batch:" + std::to_string(batch))
              .c_str(),
          [ranks, batch](benchmark::State& state) { benchmark_data_parallel(state, ranks, batch); })
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
  }
}

}  // namespace dp::bench
