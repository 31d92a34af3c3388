// Lab 2's graded checks: N ranks, each on B/N samples and averaging gradients, must train
// the model one process trains on all B samples; replicas must stay bitwise identical;
// frozen parameters stay put and unsent; the flat version makes one collective call per
// step; accumulation over k micro-batches matches the large batch and syncs once.
// rubric.json gives each check its points and states the tolerance.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <optional>

#include "dp/data.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "dp/trainer.h"
#include "grading.h"
#include "lab2.h"

namespace dp::lab2 {
namespace {

using grading::run_on_ranks;
using grading::Verdict;
using grading::world_sizes;

/// Which of the student's synchronisations a run uses.
enum class Sync { kPerParameter, kFlat };

/// 5 steps of the default model on 60 samples per step: 60 divides among 1 to 5 ranks.
TrainOptions options_for(const std::string& optimizer) {
  TrainOptions options;
  options.model = "64-128-64-10";
  options.dataset = "synthetic:600";
  options.global_batch = 60;
  options.steps = 5;
  options.optimizer = optimizer;
  options.lr = optimizer == "sgd" ? 0.05f : 1e-3f;
  options.momentum = optimizer == "sgd" ? 0.9f : 0.0f;
  options.seed = 17;
  return options;
}

/// The tolerance of the rubric: `dp::equivalence_tolerance` for SGD; for AdamW, whose
/// step lr * m / (sqrt(v) + eps) is a ratio of gradient sums, the absolute floor of
/// PyTorch's own DDP tests (atol 1e-5) scaled by lr / 1e-3 (see rubric.json).
float tolerance_for(const TrainOptions& options, float max_abs_gradient) {
  if (options.optimizer == "adamw") return 1e-5f * options.lr / 1e-3f;
  return equivalence_tolerance(options, max_abs_gradient);
}

/// What the check sees after each step on one rank.
using AfterStep = std::function<void(int step, Model& model, const CommCounters& during_sync)>;

/// Trains on this rank as the handout's loop does, with the student's synchronisation,
/// and calls `after_step` after every optimizer step with the counters of that step.
void train_on_rank(const TrainOptions& options, std::span<const std::string> frozen, Sync sync,
                   const Dataset& data, Communicator& comm, const AfterStep& after_step) {
  Model model = make_model(options);
  for (const std::string& name : frozen) model.freeze(name);
  std::unique_ptr<Optimizer> optimizer =
      make_optimizer(options.optimizer, model.num_parameters(), options.lr, options.momentum,
                     options.weight_decay);
  std::optional<FlatGradientAverager> flat;
  if (sync == Sync::kFlat) flat.emplace(model);
  for (int step = 0; step < options.steps; ++step) {
    const Batch batch = grading::local_batch(data, options, step, comm.rank(), comm.size());
    model.zero_grad();
    const Tensor logits = model.forward(batch.inputs);  // (B/N, classes)
    model.backward(logits, batch.labels);
    comm.reset_counters();
    if (sync == Sync::kFlat)
      flat->average(model, comm);
    else
      average_gradients(model, comm);
    const CommCounters counters = comm.counters();
    optimizer->step(model);
    after_step(step + 1, model, counters);
  }
}

/// The equivalence check: every rank after every step against the one-process run.
void expect_matches_single_process(const std::string& optimizer, Sync sync) {
  const TrainOptions options = options_for(optimizer);
  const Dataset data = load_dataset(options.dataset, options.seed);
  const grading::Trajectory truth = grading::single_process_trajectory(options, data);
  const float tolerance = tolerance_for(options, truth.max_abs_gradient);
  for (int world : world_sizes()) {
    run_on_ranks(world, [&](Communicator& comm, Verdict& verdict) {
      train_on_rank(
          options, {}, sync, data, comm, [&](int step, Model& model, const CommCounters&) {
            if (!verdict.passed()) return;  // the first step that differs says enough
            verdict.expect_empty(
                grading::compare_parameters(
                    model, truth.parameters_after_step[static_cast<std::size_t>(step - 1)],
                    tolerance),
                fmt::format("{} after step {}, compared with 1 rank on the global batch of {}",
                            optimizer, step, options.global_batch));
          });
    });
  }
}

TEST(Lab2PerParameter, SgdMatchesSingleProcess) {
  expect_matches_single_process("sgd", Sync::kPerParameter);
}

TEST(Lab2PerParameter, AdamWMatchesSingleProcess) {
  expect_matches_single_process("adamw", Sync::kPerParameter);
}

TEST(Lab2PerParameter, ReplicasAreBitwiseIdentical) {
  const TrainOptions options = options_for("sgd");
  const Dataset data = load_dataset(options.dataset, options.seed);
  for (int world : world_sizes()) {
    if (world == 1) continue;
    run_on_ranks(world, [&](Communicator& comm, Verdict& verdict) {
      train_on_rank(options, {}, Sync::kPerParameter, data, comm,
                    [&](int step, Model& model, const CommCounters&) {
                      // Every rank compares at every step: the comparison is a collective.
                      const std::string finding = grading::compare_with_rank0(model, comm);
                      if (verdict.passed())
                        verdict.expect_empty(finding, fmt::format("after step {}", step));
                    });
    });
  }
}

/// The parameters whose freezing the checks below try: a weight and a bias.
const std::vector<std::string> kFrozen = {"fc1.weight", "fc2.bias"};

/// Element counts of the trainable parameters, in definition order.
std::vector<std::size_t> trainable_sizes(const TrainOptions& options) {
  Model model = make_model(options);
  for (const std::string& name : kFrozen) model.freeze(name);
  std::vector<std::size_t> sizes;
  for (const Parameter* parameter : model.parameters())
    if (!parameter->frozen) sizes.push_back(parameter->value.size());
  return sizes;
}

TEST(Lab2PerParameter, FrozenParametersNeverChangeAndAreNotSent) {
  const TrainOptions options = options_for("sgd");
  const Dataset data = load_dataset(options.dataset, options.seed);
  const grading::Trajectory truth = grading::single_process_trajectory(options, data, kFrozen);
  const float tolerance = tolerance_for(options, truth.max_abs_gradient);
  const std::vector<float> initial = make_model(options).flat_parameters();
  const std::vector<std::size_t> sizes = trainable_sizes(options);
  for (int world : world_sizes()) {
    run_on_ranks(world, [&](Communicator& comm, Verdict& verdict) {
      const std::uint64_t expected_bytes = grading::allreduce_bytes_sent(comm, sizes);
      train_on_rank(
          options, kFrozen, Sync::kPerParameter, data, comm,
          [&](int step, Model& model, const CommCounters& counters) {
            if (!verdict.passed()) return;
            for (const std::string& name : kFrozen) {
              const Parameter& parameter = model.parameter(name);
              const std::span<const float> before(initial.data() + parameter.offset,
                                                  parameter.value.size());
              if (!std::equal(before.begin(), before.end(), parameter.value.span().begin()))
                verdict.fail(fmt::format("after step {}: frozen parameter {} changed", step, name));
            }
            const std::uint64_t calls = counters.of(CommOp::kAllReduce).calls;
            if (calls != sizes.size() || counters.total_bytes_sent() != expected_bytes)
              verdict.fail(
                  fmt::format("step {}: average_gradients made {} all-reduce calls sending {} "
                              "bytes; expected {} "
                              "calls (one per trainable parameter, the {} frozen ones left out) "
                              "sending {} bytes",
                              step, calls, counters.total_bytes_sent(), sizes.size(),
                              kFrozen.size(), expected_bytes));
            verdict.expect_empty(
                grading::compare_parameters(
                    model, truth.parameters_after_step[static_cast<std::size_t>(step - 1)],
                    tolerance),
                fmt::format("after step {}, compared with 1 rank (same parameters frozen)", step));
          });
    });
  }
}

TEST(Lab2Flat, MatchesSingleProcess) {
  expect_matches_single_process("sgd", Sync::kFlat);
  expect_matches_single_process("adamw", Sync::kFlat);
}

TEST(Lab2Flat, OneCollectivePerStepOfTheTrainableGradients) {
  const TrainOptions options = options_for("sgd");
  const Dataset data = load_dataset(options.dataset, options.seed);
  const grading::Trajectory truth = grading::single_process_trajectory(options, data, kFrozen);
  const float tolerance = tolerance_for(options, truth.max_abs_gradient);
  std::size_t trainable = 0;
  for (std::size_t size : trainable_sizes(options)) trainable += size;
  for (int world : world_sizes()) {
    run_on_ranks(world, [&](Communicator& comm, Verdict& verdict) {
      const std::size_t one_buffer[] = {trainable};
      const std::uint64_t expected_bytes = grading::allreduce_bytes_sent(comm, one_buffer);
      train_on_rank(
          options, kFrozen, Sync::kFlat, data, comm,
          [&](int step, Model& model, const CommCounters& counters) {
            if (!verdict.passed()) return;
            if (counters.collective_calls() != 1 || counters.of(CommOp::kAllReduce).calls != 1 ||
                counters.total_bytes_sent() != expected_bytes)
              verdict.fail(fmt::format(
                  "step {}: FlatGradientAverager::average made {} collective calls ({} "
                  "all-reduces) "
                  "sending {} bytes; expected exactly 1 all-reduce of the {} trainable elements "
                  "({} bytes)",
                  step, counters.collective_calls(), counters.of(CommOp::kAllReduce).calls,
                  counters.total_bytes_sent(), trainable, expected_bytes));
            verdict.expect_empty(
                grading::compare_parameters(
                    model, truth.parameters_after_step[static_cast<std::size_t>(step - 1)],
                    tolerance),
                fmt::format("after step {}, compared with 1 rank (fc1.weight and fc2.bias frozen)",
                            step));
          });
    });
  }
}

// --- gradient accumulation -----------------------------------------------------------------

constexpr int kMicroBatches = 4;

/// 240 samples per step: 240 / (N k) is a whole micro-batch for N = 1..5 and k = 4.
TrainOptions accumulation_options() {
  TrainOptions options = options_for("sgd");
  options.global_batch = 240;
  return options;
}

/// Runs accumulation_step on this rank, calling `after_step` after each optimizer step
/// with the counters of the whole step.
void accumulate_on_rank(const TrainOptions& options, const Dataset& data, Communicator& comm,
                        const AfterStep& after_step) {
  Model model = make_model(options);
  std::unique_ptr<Optimizer> optimizer =
      make_optimizer(options.optimizer, model.num_parameters(), options.lr, options.momentum,
                     options.weight_decay);
  const std::int64_t local = options.global_batch / comm.size();
  const std::int64_t micro = local / kMicroBatches;
  for (int step = 0; step < options.steps; ++step) {
    // This rank's slice of the global batch, cut into k micro-batches in order.
    const std::vector<std::size_t> global =
        global_batch_indices(data.size(), options.global_batch, step, options.seed);
    const std::span<const std::size_t> mine = std::span(global).subspan(
        static_cast<std::size_t>(comm.rank() * local), static_cast<std::size_t>(local));
    std::vector<Batch> micro_batches;
    for (int j = 0; j < kMicroBatches; ++j)
      micro_batches.push_back(gather_batch(data, mine.subspan(static_cast<std::size_t>(j * micro),
                                                              static_cast<std::size_t>(micro))));
    comm.reset_counters();
    accumulation_step(model, *optimizer, micro_batches, comm);
    after_step(step + 1, model, comm.counters());
  }
}

TEST(Lab2Accumulation, MatchesTheLargeBatch) {
  const TrainOptions options = accumulation_options();
  const Dataset data = load_dataset(options.dataset, options.seed);
  const grading::Trajectory truth = grading::single_process_trajectory(options, data);
  const float tolerance = tolerance_for(options, truth.max_abs_gradient);
  for (int world : world_sizes()) {
    run_on_ranks(world, [&](Communicator& comm, Verdict& verdict) {
      accumulate_on_rank(options, data, comm, [&](int step, Model& model, const CommCounters&) {
        if (!verdict.passed()) return;
        verdict.expect_empty(
            grading::compare_parameters(
                model, truth.parameters_after_step[static_cast<std::size_t>(step - 1)], tolerance),
            fmt::format("after step {} ({} micro-batches per rank), compared with 1 rank on the "
                        "global batch of {}",
                        step, kMicroBatches, options.global_batch));
      });
    });
  }
}

TEST(Lab2Accumulation, SynchronisesOncePerStep) {
  const TrainOptions options = accumulation_options();
  const Dataset data = load_dataset(options.dataset, options.seed);
  const Model reference_model = make_model(options);
  std::vector<std::size_t> sizes;
  for (const Parameter* parameter : reference_model.parameters())
    sizes.push_back(parameter->value.size());
  for (int world : world_sizes()) {
    if (world == 1) continue;  // one rank has nothing to send
    run_on_ranks(world, [&](Communicator& comm, Verdict& verdict) {
      const std::uint64_t expected_bytes = grading::allreduce_bytes_sent(comm, sizes);
      accumulate_on_rank(
          options, data, comm, [&](int step, Model& model, const CommCounters& counters) {
            (void)model;
            if (!verdict.passed()) return;
            const std::uint64_t calls = counters.collective_calls();
            if (calls != sizes.size() || counters.total_bytes_sent() != expected_bytes)
              verdict.fail(fmt::format(
                  "step {} ({} micro-batches): {} collective calls sending {} bytes; expected one "
                  "average_gradients per optimizer step: {} all-reduces sending {} bytes",
                  step, kMicroBatches, calls, counters.total_bytes_sent(), sizes.size(),
                  expected_bytes));
          });
    });
  }
}

}  // namespace
}  // namespace dp::lab2
