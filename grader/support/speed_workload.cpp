// speed_workload.cpp: see speed_workload.h.
#include "speed_workload.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <limits>
#include <memory>
#include <tuple>
#include <utility>

#include "compare.h"
#include "dp/error.h"
#include "dp/memory.h"
#include "dp/ops.h"
#include "dp/optimizer.h"
#include "dp/tensor_ops.h"
#include "ground_truth.h"
#include "sharded.h"

namespace dp::grading {

TrainOptions equal_layers_sgd_step(Draws& draws, std::int64_t hidden, std::int64_t layers,
                                   std::int64_t rows_per_rank, int world,
                                   const std::string& prefix) {
  std::string spec = "64";
  for (std::int64_t layer = 0; layer < layers; ++layer) spec += fmt::format("-{}", hidden);
  TrainOptions options;
  options.model = spec + "-10";
  options.activation = "relu";
  options.global_batch = rows_per_rank * world;
  options.dataset = fmt::format("synthetic:{}", options.global_batch);
  options.seed = draws.seed(prefix + "seed");
  options.steps = 1;
  options.optimizer = "sgd";
  options.lr = 0.01f;
  return options;
}

DeviceModel free_compute_device() {
  DeviceModel device;
  device.name = "free";
  device.flops_per_second = std::numeric_limits<double>::infinity();
  device.bytes_per_second = std::numeric_limits<double>::infinity();
  device.launch_seconds = 0;
  return device;
}

LaunchOptions simulated_launch(const Draws& draws, int world, const char* network,
                               const char* device) {
  LaunchOptions launch_options;
  launch_options.world_size = world;
  launch_options.backend = Backend::kLocal;
  launch_options.comm.completion = Completion::kAdversarial;
  launch_options.comm.completion_seed = draws.completion_seed();
  launch_options.simulation.enabled = true;
  launch_options.simulation.network = NetworkModel::preset(network);
  launch_options.simulation.device = DeviceModel::preset(device);
  return launch_options;
}

std::vector<std::vector<float>> speed_workload_parameters(const TrainOptions& options,
                                                          const Dataset& data, int world,
                                                          int steps) {
  DP_CHECK(world > 0 && steps > 0, "speed_workload_parameters: {} ranks, {} steps", world, steps);
  // One BLAS thread, as dp::launch sets for the ranks: a matrix product's summation order,
  // and so its bits, depend on how many threads share it.
  set_blas_threads(1);
  Model model = make_check_model(options);
  const std::unique_ptr<Optimizer> optimizer = optimizer_for(options, model.num_parameters());
  std::vector<Batch> batches;  // rank r's batch 0
  for (int rank = 0; rank < world; ++rank)
    batches.push_back(on_check_device(local_batch(data, options, 0, rank, world)));
  std::vector<std::vector<float>> after_step;
  for (int step = 0; step < steps; ++step) {
    // Each rank's local gradient at the same parameters, in rank order, added as kSum adds.
    std::vector<float> sum;
    for (const Batch& batch : batches) {
      model.zero_grad();
      model.backward(forward(model, batch), batch.labels);
      std::vector<float> local = model.flat_gradients();
      if (sum.empty()) {
        sum = std::move(local);
      } else {
        for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += local[i];
      }
    }
    const auto n = static_cast<float>(world);
    for (float& value : sum) value = value / n;
    for (Parameter* parameter : model.parameters())
      copy(ConstTensorView(sum.data() + parameter->offset, parameter->grad.size()),
           parameter->grad.view());
    optimizer->step(model);
    after_step.push_back(model.flat_parameters());
  }
  return after_step;
}

TimedRunNumbers::TimedRunNumbers(std::vector<std::vector<float>> after_step)
    : after_step_(std::move(after_step)) {}

const std::vector<float>& TimedRunNumbers::after_step(int step) const {
  DP_CHECK(step >= 1 && static_cast<std::size_t>(step) <= after_step_.size(),
           "TimedRunNumbers: step {} of {}", step, after_step_.size());
  return after_step_[static_cast<std::size_t>(step - 1)];
}

void TimedRunNumbers::record(std::string_view run, int rank, std::string finding) {
  if (finding.empty()) return;
  const std::lock_guard lock(mutex_);
  findings_.push_back({std::string(run), rank, std::move(finding)});
}

void TimedRunNumbers::compare_parameters(std::string_view run, int rank, const Model& model,
                                         int step) {
  const std::string finding = grading::compare_parameters(model, after_step(step), 0.0f);
  if (!finding.empty()) record(run, rank, fmt::format("after step {}: {}", step, finding));
}

bool TimedRunNumbers::report(std::string_view where, const Draws& draws) const {
  std::vector<Finding> findings;
  {
    const std::lock_guard lock(mutex_);
    findings = findings_;
  }
  if (findings.empty()) return true;
  std::ranges::sort(findings, [](const Finding& a, const Finding& b) {
    return std::tie(a.run, a.rank) < std::tie(b.run, b.rank);
  });
  std::vector<std::string> lines;  // each run's lowest rank, and how many ranks differ
  for (std::size_t i = 0; i < findings.size();) {
    std::size_t end = i;
    while (end < findings.size() && findings[end].run == findings[i].run) ++end;
    lines.push_back(fmt::format(
        "{}, rank {}{}: {}", findings[i].run, findings[i].rank,
        end - i > 1 ? fmt::format(" (and {} other rank(s))", end - i - 1) : std::string(),
        findings[i].text));
    i = end;
  }
  ADD_FAILURE() << fmt::format(
      "{}: a run timed on the simulated clock did not leave the contract's parameters (the "
      "same steps emulated in one process on a fresh model, bitwise). A design must be right "
      "on every model it runs, timed or not\n  {}\n  drawn: {}",
      where, fmt::join(lines, "\n  "), draws.describe());
  return false;
}

}  // namespace dp::grading
