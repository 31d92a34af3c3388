#include "dp/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <numeric>

#include "dp/clock.h"
#include "dp/error.h"
#include "dp/rng.h"

namespace dp {
namespace {

using WallClock = std::chrono::steady_clock;

/// Throws if any gradient holds a NaN or infinity, naming where it is.
void check_gradients_finite(Model& model, int rank, int step, const char* when) {
  for (Parameter* parameter : model.parameters()) {
    if (parameter->frozen) continue;
    const std::span<const float> grad = parameter->grad.span();
    for (std::size_t i = 0; i < grad.size(); ++i) {
      if (!std::isfinite(grad[i]))
        throw Error(fmt::format(
            "step {}: the gradient of {} holds {} at element {} on rank {} ({}); expected "
            "finite values: lower the learning rate or check the input data",
            step, parameter->name, grad[i], i, rank, when));
    }
  }
}

float largest_gradient(Model& model) {
  float largest = 0;
  for (Parameter* parameter : model.parameters())
    for (float g : parameter->grad.span()) largest = std::max(largest, std::abs(g));
  return largest;
}

std::unique_ptr<Optimizer> make_optimizer_for(const TrainOptions& options, const Model& model) {
  return make_optimizer(options.optimizer, model.num_parameters(), options.lr, options.momentum,
                        options.weight_decay);
}

/// The training loop shared by both entry points; `comm` is null for a single process.
TrainResult train(const TrainOptions& options, const Dataset& data, Communicator* comm,
                  const ReportCallback& on_report) {
  const int world = comm != nullptr ? comm->size() : 1;
  const int rank = comm != nullptr ? comm->rank() : 0;
  if (options.global_batch <= 0 || options.global_batch % world != 0)
    throw Error(fmt::format(
        "the global batch must be a positive multiple of the world size {} so that every "
        "rank gets an equal slice, got {}",
        world, options.global_batch));
  if (options.steps < 0) throw Error(fmt::format("steps must be >= 0, got {}", options.steps));
  if (static_cast<std::size_t>(options.global_batch) > data.size())
    throw Error(fmt::format("the global batch {} is larger than the data set '{}' ({} samples)",
                            options.global_batch, data.name, data.size()));

  TrainResult result{make_model(options), {}, 0.0f};
  Model& model = result.model;
  if (comm != nullptr) {
    // As DDP does at construction: every replica starts from rank 0's weights.
    for (Parameter* parameter : model.parameters())
      comm->broadcast(parameter->value.span(), 0)->wait();
  }
  std::unique_ptr<Optimizer> optimizer = make_optimizer_for(options, model);
  // With overlap, each gradient's all-reduce starts the moment backward has finished it.
  std::vector<std::unique_ptr<Work>> pending;
  const bool overlap = comm != nullptr && options.overlap;
  if (overlap)
    model.on_gradient_ready([&](Parameter& parameter) {
      pending.push_back(comm->allreduce(parameter.grad.span(), ReduceOp::kAvg));
    });
  if (comm != nullptr) comm->clock().mark_step();
  double last_report_clock = comm != nullptr ? comm->clock().now() : 0.0;

  const std::int64_t local_batch = options.global_batch / world;
  auto last_report_time = WallClock::now();
  int last_report_step = 0;
  for (int step = 0; step < options.steps; ++step) {
    const std::vector<std::size_t> global =
        global_batch_indices(data.size(), options.global_batch, step, options.seed);
    const auto begin = global.begin() + rank * local_batch;
    const std::vector<std::size_t> local(begin, begin + local_batch);
    const Batch batch = gather_batch(data, local);

    model.zero_grad();
    const Tensor logits = model.forward(batch.inputs);  // (B/N, classes)
    const float loss = model.backward(logits, batch.labels);
    // (With overlap the all-reduces are already writing the gradients: checked after.)
    if (!overlap) check_gradients_finite(model, rank, step + 1, "before averaging");

    // metrics: (sum of losses, correct predictions) over the local batch
    std::array<float, 2> metrics = {
        loss * static_cast<float>(local_batch),
        accuracy(logits, batch.labels) * static_cast<float>(local_batch)};
    if (comm != nullptr) {
      if (!overlap)
        for (Parameter* parameter : model.parameters())
          if (!parameter->frozen)
            pending.push_back(comm->allreduce(parameter->grad.span(), ReduceOp::kAvg));
      pending.push_back(comm->allreduce(std::span<float>(metrics), ReduceOp::kSum));
      for (auto& work : pending) work->wait();
      pending.clear();
      if (overlap) check_gradients_finite(model, rank, step + 1, "after averaging");
    }
    result.max_abs_gradient = std::max(result.max_abs_gradient, largest_gradient(model));
    optimizer->step(model);
    if (comm != nullptr) comm->clock().mark_step();

    const int done = step + 1;
    if (done % std::max(options.log_every, 1) == 0 || done == options.steps) {
      const auto now = WallClock::now();
      const double seconds = std::chrono::duration<double>(now - last_report_time).count();
      StepReport report;
      report.step = done;
      report.loss = metrics[0] / static_cast<float>(options.global_batch);
      report.accuracy = metrics[1] / static_cast<float>(options.global_batch);
      report.samples_per_second =
          seconds > 0
              ? static_cast<double>((done - last_report_step) * options.global_batch) / seconds
              : 0.0;
      if (comm != nullptr) {
        const double clock_now = comm->clock().now();
        report.clock_seconds_per_step =
            (clock_now - last_report_clock) / static_cast<double>(done - last_report_step);
        last_report_clock = clock_now;
      }
      result.reports.push_back(report);
      if (on_report && rank == 0) on_report(report);
      last_report_time = now;
      last_report_step = done;
    }
  }
  if (overlap) model.clear_hooks();  // the hook refers to this function's locals
  return result;
}

}  // namespace

std::vector<std::size_t> global_batch_indices(std::size_t dataset_size, std::int64_t global_batch,
                                              int step, std::uint64_t seed) {
  const std::size_t batch = static_cast<std::size_t>(global_batch);
  if (batch == 0 || batch > dataset_size)
    throw Error(fmt::format("a global batch of {} cannot be drawn from {} samples", global_batch,
                            dataset_size));
  const std::size_t batches_per_epoch = dataset_size / batch;  // drop_last
  const std::size_t epoch = static_cast<std::size_t>(step) / batches_per_epoch;
  const std::size_t position = static_cast<std::size_t>(step) % batches_per_epoch;

  // Fisher-Yates with the epoch's own stream: every rank computes the same order.
  std::vector<std::size_t> order(dataset_size);
  std::iota(order.begin(), order.end(), std::size_t{0});
  CounterRng rng(seed, 0x5EED0000 + epoch);
  for (std::size_t i = dataset_size - 1; i > 0; --i) std::swap(order[i], order[rng.below(i + 1)]);
  return {order.begin() + static_cast<std::ptrdiff_t>(position * batch),
          order.begin() + static_cast<std::ptrdiff_t>((position + 1) * batch)};
}

Model make_model(const TrainOptions& options) {
  MlpOptions mlp;
  mlp.activation = options.activation;
  mlp.layer_norm = options.layer_norm;
  mlp.seed = options.seed;
  return Model::mlp(options.model, mlp);
}

TrainResult train_single_process(const TrainOptions& options, const Dataset& data,
                                 const ReportCallback& on_report) {
  return train(options, data, nullptr, on_report);
}

TrainResult train_data_parallel(const TrainOptions& options, const Dataset& data,
                                Communicator& comm, const ReportCallback& on_report) {
  return train(options, data, &comm, on_report);
}

float equivalence_tolerance(const TrainOptions& options, float max_abs_gradient) {
  constexpr float kUnitRoundoff = 0x1.0p-24f;
  float effective_lr = options.lr;
  if (options.optimizer == "sgd" && options.momentum > 0 && options.momentum < 1)
    effective_lr /= 1.0f - options.momentum;
  const float per_step = effective_lr * static_cast<float>(options.global_batch) * kUnitRoundoff *
                         std::max(max_abs_gradient, 1.0f);
  return 2.0f * static_cast<float>(std::max(options.steps, 1)) * per_step;
}

}  // namespace dp
