// zero1.cpp: lab 5, ZeRO-1. Your part: the partition rule, the members of
// ZeroOneOptimizer::State and the bodies below.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dp/error.h"
#include "dp/memory.h"
#include "dp/sharded_checkpoint.h"
#include "dp/tensor_ops.h"
#include "lab5.h"

namespace dp::lab5 {

std::size_t Partition::shard_offset(int rank) const {
  // BEGIN SOLUTION
  // SKELETON: (void)rank;
  // SKELETON: throw NotImplemented("lab5::Partition::shard_offset");
  return static_cast<std::size_t>(rank) * shard_elements;
  // END SOLUTION
}

std::size_t Partition::real_elements(int rank) const {
  // BEGIN SOLUTION
  // SKELETON: (void)rank;
  // SKELETON: throw NotImplemented("lab5::Partition::real_elements");
  const std::size_t offset = shard_offset(rank);
  if (offset >= num_parameters) return 0;
  return std::min(shard_elements, num_parameters - offset);
  // END SOLUTION
}

Partition partition(std::size_t num_parameters, int world_size) {
  // BEGIN SOLUTION
  // SKELETON: (void)num_parameters;
  // SKELETON: (void)world_size;
  // SKELETON: throw NotImplemented("lab5::partition");
  if (world_size < 1) throw Error(fmt::format("partition: world size {} < 1", world_size));
  const auto n = static_cast<std::size_t>(world_size);
  Partition p;
  p.num_parameters = num_parameters;
  p.world_size = world_size;
  p.shard_elements = (num_parameters + n - 1) / n;
  p.padded_elements = p.shard_elements * n;
  return p;
  // END SOLUTION
}

/// Everything a ZeroOneOptimizer keeps between steps.
struct ZeroOneOptimizer::State {
  // BEGIN SOLUTION
  // SKELETON: // Your members.
  State(Model& m, Communicator& c) : model(m), comm(c) {}

  Model& model;
  Communicator& comm;
  float max_norm = 0;
  Partition layout;
  std::unique_ptr<Optimizer> inner;
  /// (N S): the packed local gradients going into the reduce-scatter, then the
  /// all-gathered parameters coming out of the all-gather. Padding stays zero in both.
  Tensor flat;
  /// (S): this rank's shard of the averaged gradient.
  Tensor shard_grad;
  /// (S): this rank's shard of the parameters, which the inner optimizer updates.
  Tensor shard_params;
  /// (1): this rank's partial squared norm, then the sum over ranks (clipping only).
  Tensor norm_buffer;
  // END SOLUTION
};

ZeroOneOptimizer::ZeroOneOptimizer(Model& model, Communicator& comm, OptimizerFactory make_inner,
                                   float max_norm) {
  // BEGIN SOLUTION
  // SKELETON: (void)model;
  // SKELETON: (void)comm;
  // SKELETON: (void)make_inner;
  // SKELETON: (void)max_norm;
  // SKELETON: throw NotImplemented("lab5::ZeroOneOptimizer::ZeroOneOptimizer");
  for (const Parameter* parameter : model.parameters())
    if (parameter->frozen)
      throw Error(
          fmt::format("ZeroOneOptimizer: parameter {} is frozen; ZeRO-1 steps the whole flat space",
                      parameter->name));
  if (!std::isfinite(max_norm) || max_norm < 0)
    throw Error(fmt::format("ZeroOneOptimizer: max_norm {} is not finite and >= 0", max_norm));
  if (!make_inner) throw Error("ZeroOneOptimizer: no optimizer factory");
  auto state = std::make_unique<State>(model, comm);
  state->max_norm = max_norm;
  state->layout = lab5::partition(model.num_parameters(), comm.size());
  const Partition& p = state->layout;
  state->inner = make_inner(p.shard_elements);
  if (state->inner == nullptr) throw Error("ZeroOneOptimizer: the factory returned no optimizer");
  if (state->inner->state_size() != p.shard_elements)
    throw Error(fmt::format(
        "ZeroOneOptimizer: the factory's optimizer keeps state for {} elements; expected the "
        "shard's {}",
        state->inner->state_size(), p.shard_elements));
  // Every buffer lives where the model does, so the same code runs on the host or a GPU.
  const Device device = model.device();
  if (state->inner->device() != device)
    throw Error(fmt::format(
        "ZeroOneOptimizer: the factory's optimizer keeps its state in {} memory; expected the "
        "model's, {} memory",
        to_string(state->inner->device()), to_string(device)));
  const auto padded = static_cast<std::int64_t>(p.padded_elements);
  const auto shard = static_cast<std::int64_t>(p.shard_elements);
  state->flat = Tensor({padded}, MemoryCategory::kCommunication, device);  // zero-filled
  state->shard_grad = Tensor({shard}, MemoryCategory::kGradients, device);
  state->shard_params = Tensor({shard}, MemoryCategory::kParameters, device);
  if (max_norm > 0) state->norm_buffer = Tensor({1}, MemoryCategory::kCommunication, device);
  // This rank's shard of the (identical) initial parameters; the padding stays zero.
  const std::size_t begin = p.shard_offset(comm.rank());
  for (const Parameter* parameter : model.parameters()) {
    const std::size_t first = std::max(begin, parameter->offset);
    const std::size_t last =
        std::min(begin + p.shard_elements, parameter->offset + parameter->value.size());
    if (first >= last) continue;
    copy(parameter->value.view(first - parameter->offset, last - first),
         state->shard_params.view(first - begin, last - first));
  }
  state_ = std::move(state);
  // END SOLUTION
}

ZeroOneOptimizer::~ZeroOneOptimizer() = default;  // step() leaves no call running

std::optional<float> ZeroOneOptimizer::step() {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab5::ZeroOneOptimizer::step");
  State& s = *state_;
  const Partition& p = s.layout;
  const int rank = s.comm.rank();
  // Pack the local gradients; the padding of `flat` is zeroed, since the all-gather of the
  // previous step wrote the parameters' (zero) padding there.
  for (const Parameter* parameter : s.model.parameters())
    copy(parameter->grad.view(), s.flat.view(parameter->offset, parameter->grad.size()));
  if (p.padded_elements > p.num_parameters)
    fill(s.flat.view(p.num_parameters, p.padded_elements - p.num_parameters), 0.0f);
  s.comm.reduce_scatter(s.flat.view(), s.shard_grad.view(), ReduceOp::kSum)->wait();
  divide(s.shard_grad.view(), static_cast<float>(p.world_size));

  std::optional<float> norm;
  if (s.max_norm > 0) {
    const std::size_t real = p.real_elements(rank);
    const ConstTensorView mine = std::as_const(s.shard_grad).view(0, real);
    fill(s.norm_buffer.view(), static_cast<float>(dot(mine, mine)));
    s.comm.allreduce(s.norm_buffer.view(), ReduceOp::kSum)->wait();
    // The sum may live on a GPU: copy it into a host float (no allocation) to read it.
    std::array<float, 1> sum{};
    copy(std::as_const(s.norm_buffer).view(), TensorView(std::span<float>(sum)));
    norm = std::sqrt(sum[0]);
    const float coefficient = s.max_norm / (*norm + 1e-6f);
    if (coefficient < 1.0f) scale(s.shard_grad.view(), coefficient);
  }

  s.inner->begin_step();
  s.inner->update(0, s.shard_params.view(), std::as_const(s.shard_grad).view());

  s.comm.allgather(std::as_const(s.shard_params).view(), s.flat.view())->wait();
  for (Parameter* parameter : s.model.parameters())
    copy(std::as_const(s.flat).view(parameter->offset, parameter->value.size()),
         parameter->value.view());
  return norm;
  // END SOLUTION
}

const Partition& ZeroOneOptimizer::partition() const {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab5::ZeroOneOptimizer::partition");
  return state_->layout;
  // END SOLUTION
}

const Tensor& ZeroOneOptimizer::shard_parameters() const {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab5::ZeroOneOptimizer::shard_parameters");
  return state_->shard_params;
  // END SOLUTION
}

const Tensor& ZeroOneOptimizer::flat_parameters() const {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab5::ZeroOneOptimizer::flat_parameters");
  return state_->flat;
  // END SOLUTION
}

Optimizer& ZeroOneOptimizer::inner() {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab5::ZeroOneOptimizer::inner");
  return *state_->inner;
  // END SOLUTION
}

// BEGIN SOLUTION
// SKELETON: // Your helpers for the checkpoints, if any.
namespace {

/// ZeRO-1's checkpoint plan for `model` on `world_size` ranks: one segment of every
/// parameter, cut into the partition's N equal shards (the last ones padded), so that the
/// index says exactly which flat elements each shard holds.
ShardedCheckpointPlan checkpoint_plan(const Model& model, int world_size, Optimizer& inner) {
  ShardedCheckpointPlan plan;
  plan.parameters = checkpoint_parameters(model);
  const std::vector<std::vector<std::size_t>> segments = {all_parameters(plan.parameters)};
  plan.layouts = chunked_layouts(plan.parameters, segments, world_size);
  plan.tensors = {kShardParameters};
  for (const OptimizerState& state : inner.state()) plan.tensors.push_back(state.name);
  plan.metadata = {{"step", std::to_string(inner.step_count())}};
  return plan;
}

}  // namespace
// END SOLUTION

void ZeroOneOptimizer::save_checkpoint(const std::filesystem::path& directory) const {
  // BEGIN SOLUTION
  // SKELETON: (void)directory;
  // SKELETON: throw NotImplemented("lab5::ZeroOneOptimizer::save_checkpoint");
  State& s = *state_;
  const ShardedCheckpointPlan plan = checkpoint_plan(s.model, s.comm.size(), *s.inner);
  // Each rank saves what it holds, as it lies in memory: its shard and its optimizer state.
  std::vector<NamedTensor> mine = {{kShardParameters, &s.shard_params}};
  for (const OptimizerState& state : s.inner->state()) mine.push_back({state.name, state.tensor});
  save_checkpoint_shard(directory, plan, s.comm.rank(), mine);
  s.comm.barrier();  // complete only when every rank's shard (and rank 0's index) is written
  // END SOLUTION
}

void ZeroOneOptimizer::load_checkpoint(const std::filesystem::path& directory) {
  // BEGIN SOLUTION
  // SKELETON: (void)directory;
  // SKELETON: throw NotImplemented("lab5::ZeroOneOptimizer::load_checkpoint");
  State& s = *state_;
  const int rank = s.comm.rank();
  const ShardedCheckpointPlan plan = checkpoint_plan(s.model, s.comm.size(), *s.inner);
  const ShardedCheckpointPlan saved = load_checkpoint_index(directory);
  check_checkpoint_compatible(saved, plan);  // before changing anything
  const std::int64_t step = checkpoint_count(saved, "step");
  // This rank's shard at the current world size, whatever world size saved it: the runtime
  // copies every range by parameter name and offset and zeroes the padding.
  std::vector<ShardTarget> targets = {{kShardParameters, &s.shard_params}};
  for (const OptimizerState& state : s.inner->state())
    targets.push_back({state.name, state.tensor});
  load_checkpoint_shard(directory, plan.layouts[static_cast<std::size_t>(rank)], targets);
  s.inner->set_step_count(step);
  // Every rank's model must hold the parameters again: all-gather the shards, as a step does.
  s.comm.allgather(std::as_const(s.shard_params).view(), s.flat.view())->wait();
  for (Parameter* parameter : s.model.parameters())
    copy(std::as_const(s.flat).view(parameter->offset, parameter->value.size()),
         parameter->value.view());
  // END SOLUTION
}

std::size_t predicted_state_bytes_per_rank(std::size_t num_parameters, int world_size,
                                           std::size_t state_floats_per_element) {
  // BEGIN SOLUTION
  // SKELETON: (void)num_parameters;
  // SKELETON: (void)world_size;
  // SKELETON: (void)state_floats_per_element;
  // SKELETON: throw NotImplemented("lab5::predicted_state_bytes_per_rank");
  const Partition p = partition(num_parameters, world_size);
  const std::size_t model = 2 * 4 * num_parameters;     // parameters and gradients
  const std::size_t flat = 4 * p.padded_elements;       // the flat buffer
  const std::size_t shards = 2 * 4 * p.shard_elements;  // shard gradient and parameters
  const std::size_t state = 4 * state_floats_per_element * p.shard_elements;
  return model + flat + shards + state;
  // END SOLUTION
}

}  // namespace dp::lab5
