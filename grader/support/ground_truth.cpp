#include "ground_truth.h"

#include <algorithm>
#include <cmath>

#include "dp/error.h"
#include "dp/tensor_ops.h"

namespace dp::grading {
namespace {

/// On the check device: the same arithmetic on the same device as the lab code it is
/// compared with, so bitwise checks hold on a GPU too.
Model model_with_frozen(const TrainOptions& options, std::span<const std::string> frozen) {
  Model model = make_check_model(options);
  for (const std::string& name : frozen) model.freeze(name);
  return model;
}

float largest_magnitude(std::span<const float> values) {
  float largest = 0;
  for (float value : values) largest = std::max(largest, std::abs(value));
  return largest;
}

/// Sets every trainable gradient of `model` from `flat` (the model's flat index space).
void set_gradients(Model& model, std::span<const float> flat) {
  for (Parameter* parameter : model.parameters()) {
    if (parameter->frozen) continue;
    copy(ConstTensorView(flat.data() + parameter->offset, parameter->grad.size()),
         parameter->grad.view());  // host to wherever the model lives
  }
}

}  // namespace

void draw_optimizer(Draws& draws, const std::string& optimizer, TrainOptions& options) {
  options.optimizer = optimizer;
  if (optimizer == "sgd") {
    options.lr = draws.uniform("lr", 0.02f, 0.1f);
    options.momentum = draws.coin("momentum 0.9") ? 0.9f : 0.0f;
  } else {
    options.lr = draws.uniform("lr", 5e-4f, 3e-3f);
    options.weight_decay = 0.01f;
  }
}

std::unique_ptr<Optimizer> optimizer_for(const TrainOptions& options, std::size_t num_parameters) {
  return make_optimizer(options.optimizer, num_parameters, options.lr, options.momentum,
                        options.weight_decay, check_device());
}

Model make_check_model(TrainOptions options) {
  options.device = check_device();
  return make_model(options);
}

Trajectory single_process_trajectory(const TrainOptions& options, const Dataset& data,
                                     std::span<const std::string> frozen) {
  Model model = model_with_frozen(options, frozen);
  const std::unique_ptr<Optimizer> optimizer = optimizer_for(options, model.num_parameters());
  Trajectory trajectory;
  for (int step = 0; step < options.steps; ++step) {
    const Batch batch = local_batch(data, options, step, /*rank=*/0, /*world_size=*/1);
    model.zero_grad();
    const Tensor logits = model.forward(batch.inputs.to(model.device()));  // (B, classes)
    model.backward(logits, batch.labels);
    trajectory.gradients_of_step.push_back(model.flat_gradients());
    trajectory.max_abs_gradient = std::max(trajectory.max_abs_gradient,
                                           largest_magnitude(trajectory.gradients_of_step.back()));
    optimizer->step(model);
    trajectory.parameters_after_step.push_back(model.flat_parameters());
  }
  return trajectory;
}

std::vector<float> sum_in_rank_order(const std::vector<std::vector<float>>& local) {
  std::vector<float> sum = local.front();
  for (std::size_t rank = 1; rank < local.size(); ++rank)
    for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += local[rank][i];
  return sum;
}

Trajectory emulate_data_parallel(const TrainOptions& options, const Dataset& data, int world_size,
                                 std::span<const std::string> frozen, int micro_batches_per_rank) {
  return emulate_data_parallel(
      options, data, world_size,
      Emulation{.frozen = frozen, .micro_batches = micro_batches_per_rank});
}

Trajectory emulate_data_parallel(const TrainOptions& options, const Dataset& data, int world_size,
                                 const Emulation& how) {
  const int k = how.micro_batches;
  DP_CHECK(world_size > 0 && k > 0 && options.global_batch % (world_size * k) == 0,
           "a global batch of {} does not split into {} ranks x {} micro-batches",
           options.global_batch, world_size, k);
  DP_CHECK(how.staleness >= 0, "staleness {} < 0", how.staleness);
  Model model = model_with_frozen(options, how.frozen);
  const std::unique_ptr<Optimizer> optimizer = optimizer_for(options, model.num_parameters());
  // The ranks' gradients are computed on `probe`, at the parameters of the version they
  // read: the current ones, or with staleness s those of s steps before.
  Model probe = model_with_frozen(options, how.frozen);
  std::vector<std::vector<float>> versions = {model.flat_parameters()};
  // The loss scale of a micro-batch, computed as lab code computes it: 1/k in float.
  const float loss_scale = 1.0f / static_cast<float>(k);
  Trajectory trajectory;
  // After a resume the steps run on other ranks with another global batch.
  TrainOptions resumed = options;
  resumed.global_batch = how.resume_global_batch;
  DP_CHECK(how.resume_step < 0 ||
               (how.resume_world > 0 && resumed.global_batch % (how.resume_world * k) == 0),
           "a resumed global batch of {} does not split into {} ranks x {} micro-batches",
           resumed.global_batch, how.resume_world, k);
  for (int step = 0; step < options.steps; ++step) {
    const bool after_resume = how.resume_step >= 0 && step >= how.resume_step;
    const TrainOptions& step_options = after_resume ? resumed : options;
    const int world = after_resume ? how.resume_world : world_size;
    probe.set_flat_parameters(
        versions[static_cast<std::size_t>(std::max(0, step - how.staleness))]);
    std::vector<std::vector<float>> local;
    std::vector<float>& losses = trajectory.rank_losses.emplace_back();
    for (int rank = 0; rank < world; ++rank) {
      probe.zero_grad();
      float loss_sum = 0;
      for (const Batch& micro : micro_batches(data, step_options, step, rank, world, k)) {
        const Tensor logits = probe.forward(micro.inputs.to(probe.device()));
        loss_sum += probe.backward(logits, micro.labels, loss_scale);
      }
      losses.push_back(loss_sum / static_cast<float>(k));
      local.push_back(probe.flat_gradients());
    }
    std::vector<float> sum = how.sum(local);
    // Then a division by N (a division: g / N, not g * (1/N)).
    const auto divisor = static_cast<float>(world);
    for (float& value : sum) value = value / divisor;
    if (how.before_step) how.before_step(step, sum);
    set_gradients(model, sum);
    trajectory.max_abs_gradient = std::max(trajectory.max_abs_gradient, largest_magnitude(sum));
    trajectory.gradients_of_step.push_back(std::move(sum));
    optimizer->step(model);
    if (how.after_step) how.after_step(step, *optimizer);
    trajectory.parameters_after_step.push_back(model.flat_parameters());
    versions.push_back(trajectory.parameters_after_step.back());
  }
  return trajectory;
}

std::vector<float> global_batch_gradient(const TrainOptions& options, const Dataset& data, int step,
                                         std::span<const float> parameters,
                                         std::span<const std::string> frozen) {
  Model model = model_with_frozen(options, frozen);
  model.set_flat_parameters(parameters);
  const Batch batch = local_batch(data, options, step, /*rank=*/0, /*world_size=*/1);
  model.zero_grad();
  const Tensor logits = model.forward(batch.inputs.to(model.device()));  // (B, classes)
  model.backward(logits, batch.labels);
  return model.flat_gradients();
}

void average_gradients_flat(Model& model, Communicator& comm, Tensor& flat) {
  for (Parameter* parameter : model.parameters())
    copy(parameter->grad.view(), flat.view(parameter->offset, parameter->grad.size()));
  comm.allreduce(flat.view(), ReduceOp::kSum)->wait();
  divide(flat.view(), static_cast<float>(comm.size()));
  for (Parameter* parameter : model.parameters())
    copy(flat.view(parameter->offset, parameter->grad.size()), parameter->grad.view());
}

Batch local_batch(const Dataset& data, const TrainOptions& options, int step, int rank,
                  int world_size) {
  return std::move(micro_batches(data, options, step, rank, world_size, 1).front());
}

std::vector<Batch> micro_batches(const Dataset& data, const TrainOptions& options, int step,
                                 int rank, int world_size, int count) {
  DP_CHECK(world_size > 0 && count > 0 && options.global_batch % (world_size * count) == 0,
           "global batch {} does not split into {} ranks x {} micro-batches", options.global_batch,
           world_size, count);
  const std::vector<std::size_t> global =
      global_batch_indices(data.size(), options.global_batch, step, options.seed);
  const auto local = static_cast<std::size_t>(options.global_batch / world_size);
  const std::size_t micro = local / static_cast<std::size_t>(count);
  const std::span<const std::size_t> mine =
      std::span(global).subspan(static_cast<std::size_t>(rank) * local, local);
  std::vector<Batch> batches;
  for (int j = 0; j < count; ++j)
    batches.push_back(gather_batch(data, mine.subspan(static_cast<std::size_t>(j) * micro, micro)));
  return batches;
}

RecordingOptimizer::RecordingOptimizer(std::unique_ptr<Optimizer> inner, std::size_t num_parameters)
    : Optimizer(inner->state_size(), inner->device()),
      inner_(std::move(inner)),
      last_gradients_(num_parameters) {}

void RecordingOptimizer::begin_step() {
  Optimizer::begin_step();
  inner_->begin_step();
  std::fill(last_gradients_.begin(), last_gradients_.end(), 0.0f);
  last_updates_.clear();
}

void RecordingOptimizer::update(std::size_t offset, std::span<float> params,
                                std::span<const float> grads) {
  last_updates_.emplace_back(offset, grads.size());
  if (offset + grads.size() <= last_gradients_.size())
    std::copy(grads.begin(), grads.end(),
              last_gradients_.begin() + static_cast<std::ptrdiff_t>(offset));
  inner_->update(offset, params, grads);
}

void RecordingOptimizer::update_on_device(std::size_t offset, float* params, const float* grads,
                                          std::size_t n) {
  const ConstTensorView gradients(grads, n, device());
  last_updates_.emplace_back(offset, n);
  if (offset + n <= last_gradients_.size())  // a copy to the host, where the checks read it
    copy(gradients, TensorView(last_gradients_.data() + offset, n));
  inner_->update(offset, TensorView(params, n, device()), gradients);
}

}  // namespace dp::grading
