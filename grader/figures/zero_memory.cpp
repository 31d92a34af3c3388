// zero_memory_figure: the memory one rank holds while it trains, for DDP (lab 4) and ZeRO
// stages 1, 2 and 3 (labs 5 to 7), measured with the `MemoryTracker` while the reference
// solutions train, against the number of ranks; beside each measurement, the handouts'
// formula for the model states alone (parameters, gradients, AdamW state).
//
//   zero_memory_figure                       # CSV on stdout: the default sweep
//   zero_memory_figure --ranks 1,2,4 --model 64-256-256-10   # another sweep
//   zero_memory_figure --ranks 1,4 --model gpt --activations [--activation-checkpointing]
//                                            # the default GPT on the fortunes, with a
//                                            # column for the activations' peak
//
// tools/zero-memory-figure draws lab 7's figure from this CSV. What is measured, per rank 0
// of N local ranks (threads), over the second step of AdamW training (the peaks are reset
// after the first, so that set-up, such as the whole model ZeRO-3 builds before it shards
// it, does not count): the peak of each category the strategy controls (parameters,
// gradients, optimizer state, communication buffers), and their sum. Activations are the
// same for every strategy and are left out of the sum; `--activations` adds their peak as a
// last column, which shows what no ZeRO stage shards and what activation checkpointing
// (`--activation-checkpointing`, a GPT's blocks) removes. Memory counts are exact and
// deterministic: the same on every machine.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dp/data.h"
#include "dp/error.h"
#include "dp/launch.h"
#include "dp/memory.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "dp/trainer.h"
#include "lab4.h"
#include "lab5.h"
#include "lab6.h"
#include "lab7.h"

namespace dp {
namespace {

/// The categories a data-parallel strategy decides; the sum of their peaks is plotted.
constexpr std::array<MemoryCategory, 4> kStateCategories = {
    MemoryCategory::kParameters, MemoryCategory::kGradients, MemoryCategory::kOptimizerState,
    MemoryCategory::kCommunication};

/// One row of the CSV: bytes per category of rank 0, and their sum.
struct Row {
  std::string kind;      // "measured" or "formula"
  std::string strategy;  // "DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"
  int ranks = 1;
  std::array<double, kStateCategories.size()> bytes{};
  double activations = 0;  // the peak of kActivations (not part of the total)

  double total() const { return bytes[0] + bytes[1] + bytes[2] + bytes[3]; }
};

/// What every run shares.
struct Setup {
  // 16 equal hidden layers: a unit is 1/16 of the model, so ZeRO-3's transient memory (one
  // unit's values and gradients, the unit buffers) is visible but does not hide the trend.
  std::string model = "64-256-256-256-256-256-256-256-256-256-256-256-256-256-256-256-256-10";
  std::int64_t rows = 8;  // per rank
  float lr = 1e-3f;
  bool activation_checkpointing = false;  // a GPT's blocks keep their inputs only
  bool activations = false;               // print the activations' peak as a column

  /// The data set of `options(ranks)`: a GPT's text cut into windows of its context.
  static Dataset data(const TrainOptions& options) {
    const std::int64_t context =
        is_gpt_spec(options.model) ? parse_gpt_spec(options.model).context : 0;
    return load_dataset(options.dataset, 1, context);
  }

  /// The training options of this model (a GPT trains on the fortunes, an MLP on synthetic
  /// data) on `ranks` ranks.
  TrainOptions options(int ranks) const {
    TrainOptions options;
    options.model = model;
    options.global_batch = rows * ranks;
    options.dataset = is_gpt_spec(model) ? "fortunes" : fmt::format("synthetic:{}", rows * ranks);
    options.activation_checkpointing = activation_checkpointing;
    return options;
  }
};

/// One step of a strategy, given the rank's batch.
using StepFunction = std::function<void(const Batch&)>;
/// Builds a strategy for `model` on `comm` and returns its step.
using StrategyFactory = std::function<StepFunction(Model&, Communicator&)>;

/// AdamW over a shard of `elements` elements, as every ZeRO stage's inner optimizer.
std::unique_ptr<Optimizer> adamw(std::size_t elements, const Setup& setup) {
  return make_optimizer("adamw", elements, setup.lr, 0.0f, 0.01f);
}

/// Rank 0's peaks per category over the second of two steps of `strategy` on `ranks` ranks.
Row measure(const Setup& setup, const std::string& name, int ranks,
            const StrategyFactory& strategy) {
  TrainOptions options = setup.options(ranks);
  const Dataset data = Setup::data(options);
  options.vocab = data.num_classes;  // a GPT's, from its text
  LaunchOptions launch_options;
  launch_options.world_size = ranks;
  Row row{"measured", name, ranks, {}};
  launch(launch_options, [&](Communicator& comm) {
    Model model = make_model(options);
    const StepFunction step = strategy(model, comm);
    std::vector<std::size_t> indices;
    for (std::int64_t i = 0; i < setup.rows; ++i)
      indices.push_back(static_cast<std::size_t>(comm.rank() * setup.rows + i));
    const Batch batch = gather_batch(data, indices);
    MemoryTracker& tracker = this_rank_memory().tracker();
    step(batch);
    tracker.reset_peaks();
    step(batch);
    if (comm.rank() != 0) return;
    for (std::size_t c = 0; c < kStateCategories.size(); ++c)
      row.bytes[c] = static_cast<double>(tracker.peak(kStateCategories[c]));
    row.activations = static_cast<double>(tracker.peak(MemoryCategory::kActivations));
  });
  return row;
}

/// The handouts' model states per rank for Psi parameters on N ranks (float32: 4 bytes of
/// parameters, 4 of gradients, 8 of AdamW state per parameter), without any buffer.
Row formula(const std::string& name, int ranks, double psi) {
  const double n = ranks;
  Row row{"formula", name, ranks, {}};
  const double sharded_params = name == "ZeRO-3" ? 1 / n : 1;
  const double sharded_grads = name == "ZeRO-2" || name == "ZeRO-3" ? 1 / n : 1;
  const double sharded_state = name == "DDP" ? 1 : 1 / n;
  row.bytes = {4 * psi * sharded_params, 4 * psi * sharded_grads, 8 * psi * sharded_state, 0};
  return row;
}

void print(const Row& row, double psi, bool activations) {
  fmt::print("{},{},{},{:.0f},{:.0f},{:.0f},{:.0f},{:.0f},{:.4f}", row.kind, row.strategy,
             row.ranks, row.bytes[0], row.bytes[1], row.bytes[2], row.bytes[3], row.total(),
             row.total() / psi);
  // The formula is for the model states only: no activations.
  if (activations)
    fmt::print(",{}", row.kind == "measured" ? fmt::format("{:.0f}", row.activations) : "");
  fmt::print("\n");
}

int run(int argc, char** argv) {
  Setup setup;
  std::vector<int> world_sizes = {1, 2, 4, 8, 16};
  CLI::App app{"Memory per rank of DDP and ZeRO-1/2/3 against the number of ranks (CSV)"};
  app.add_option("--model", setup.model, "MLP spec, input first, or a GPT spec (gpt:...)")
      ->capture_default_str();
  app.add_flag("--activations", setup.activations, "Add a column: the activations' peak");
  app.add_flag("--activation-checkpointing", setup.activation_checkpointing,
               "A GPT's blocks keep only their inputs (dplab train --activation-checkpointing)");
  app.add_option("--rows", setup.rows, "rows per rank in a step")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--ranks", world_sizes, "world sizes")
      ->delimiter(',')
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  TrainOptions options = setup.options(1);
  check_train_options(options);
  if (is_gpt_spec(setup.model)) options.vocab = Setup::data(options).num_classes;
  const double psi = static_cast<double>(make_model(options).num_parameters());

  const std::vector<std::pair<std::string, StrategyFactory>> strategies = {
      {"DDP",
       [&](Model& model, Communicator& comm) -> StepFunction {
         auto ddp = std::make_shared<lab4::BucketedDDP>(model, comm);
         std::shared_ptr<Optimizer> optimizer = adamw(model.num_parameters(), setup);
         return [&model, ddp, optimizer](const Batch& batch) {
           model.zero_grad();
           model.backward(model.forward(batch.inputs), batch.labels);
           ddp->finish_gradient_sync();
           optimizer->step(model);
         };
       }},
      {"ZeRO-1",
       [&](Model& model, Communicator& comm) -> StepFunction {
         auto zero = std::make_shared<lab5::ZeroOneOptimizer>(
             model, comm, [&](std::size_t shard) { return adamw(shard, setup); });
         return [&model, zero](const Batch& batch) {
           model.zero_grad();
           model.backward(model.forward(batch.inputs), batch.labels);
           (void)zero->step();
         };
       }},
      {"ZeRO-2",
       [&](Model& model, Communicator& comm) -> StepFunction {
         auto zero = std::make_shared<lab6::ZeroTwoOptimizer>(
             model, comm, [&](std::size_t shard) { return adamw(shard, setup); },
             std::size_t{1} << 20);  // 1 MiB buckets: about one layer of the default model
         return [&model, zero](const Batch& batch) {
           model.backward(model.forward(batch.inputs), batch.labels);
           (void)zero->step();
         };
       }},
      {"ZeRO-3",
       [&](Model& model, Communicator& comm) -> StepFunction {
         auto zero = std::make_shared<lab7::ZeroThreeOptimizer>(
             model, comm, [&](std::size_t shard) { return adamw(shard, setup); });
         return [&model, zero](const Batch& batch) {
           model.backward(model.forward(batch.inputs), batch.labels);
           (void)zero->step();
         };
       }},
  };

  fmt::print(
      "kind,strategy,ranks,parameters_bytes,gradients_bytes,optimizer_state_bytes,"
      "communication_bytes,total_bytes,bytes_per_parameter{}\n",
      setup.activations ? ",activations_bytes" : "");
  for (const auto& [name, strategy] : strategies)
    for (int ranks : world_sizes) {
      print(measure(setup, name, ranks, strategy), psi, setup.activations);
      print(formula(name, ranks, psi), psi, setup.activations);
    }
  return 0;
}

}  // namespace
}  // namespace dp

int main(int argc, char** argv) {
  try {
    return dp::run(argc, argv);
  } catch (const dp::Error& error) {
    fmt::print(stderr, "zero_memory_figure: {}\n", error.what());
    return 1;
  }
}
