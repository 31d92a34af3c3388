// hierarchical.cpp: lab 9, two levels of network. Your part: the split, the hierarchical
// all-reduce, the members of HsdpOptimizer::State and the bodies below.
#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "dp/error.h"
#include "dp/memory.h"
#include "dp/tensor_ops.h"
#include "lab9.h"

namespace dp::lab9 {

Levels split_levels(Communicator& comm, int ranks_per_node) {
  // BEGIN SOLUTION
  // SKELETON: (void)comm;
  // SKELETON: (void)ranks_per_node;
  // SKELETON: throw NotImplemented("lab9::split_levels");
  if (ranks_per_node < 1 || comm.size() % ranks_per_node != 0)
    throw Error(fmt::format("split_levels: {} ranks per node does not divide {} ranks",
                            ranks_per_node, comm.size()));
  const int rank = comm.rank();
  Levels levels;
  // Both splits keep the communicator's order (key = rank): inside a node the ranks of the
  // node in order, across the nodes in order, which is the contract's sum order.
  levels.node = comm.split(rank / ranks_per_node, rank);
  levels.across = comm.split(rank % ranks_per_node, rank);
  return levels;
  // END SOLUTION
}

void hierarchical_allreduce(TensorView data, const Levels& levels) {
  // BEGIN SOLUTION
  // SKELETON: (void)data;
  // SKELETON: (void)levels;
  // SKELETON: throw NotImplemented("lab9::hierarchical_allreduce");
  const auto k = static_cast<std::size_t>(levels.node->size());
  if (data.size() % k != 0)
    throw Error(
        fmt::format("hierarchical_allreduce: {} elements are not a multiple of the {} "
                    "ranks of a node",
                    data.size(), k));
  // The node's sum of this rank's k-th of the buffer, then the sum over nodes of that shard,
  // then every shard to every rank of the node. The shard is a buffer of its own: the
  // reduce-scatter reads all of `data` while it writes the shard.
  Tensor shard({static_cast<std::int64_t>(data.size() / k)}, MemoryCategory::kCommunication,
               data.device());
  const ConstTensorView whole = data;
  levels.node->reduce_scatter(whole, shard.view(), ReduceOp::kSum)->wait();
  levels.across->allreduce(shard.view(), ReduceOp::kSum)->wait();
  levels.node->allgather(std::as_const(shard).view(), data)->wait();
  // END SOLUTION
}

/// Everything an HsdpOptimizer keeps between steps.
struct HsdpOptimizer::State {
  // BEGIN SOLUTION
  // SKELETON: // Your members.
  State(Model& m, Communicator& c) : model(m), comm(c) {}

  Model& model;
  Communicator& comm;
  Levels levels;
  std::size_t shard = 0;  ///< S
  std::unique_ptr<Optimizer> inner;
  /// (k S): the packed local gradients, then the all-gathered parameters; padding zero.
  Tensor flat;
  /// (S): this rank's shard of the gradient: the node's sum, then everyone's, then / p.
  Tensor shard_grad;
  /// (S): this rank's shard of the parameters, which the inner optimizer updates.
  Tensor shard_params;
  // END SOLUTION
};

HsdpOptimizer::HsdpOptimizer(Model& model, Communicator& comm, int ranks_per_node,
                             OptimizerFactory make_inner) {
  // BEGIN SOLUTION
  // SKELETON: (void)model;
  // SKELETON: (void)comm;
  // SKELETON: (void)ranks_per_node;
  // SKELETON: (void)make_inner;
  // SKELETON: throw NotImplemented("lab9::HsdpOptimizer::HsdpOptimizer");
  for (const Parameter* parameter : model.parameters())
    if (parameter->frozen)
      throw Error(fmt::format("HsdpOptimizer: parameter {} is frozen", parameter->name));
  if (!make_inner) throw Error("HsdpOptimizer: no optimizer factory");
  auto state = std::make_unique<State>(model, comm);
  state->levels = split_levels(comm, ranks_per_node);
  const auto k = static_cast<std::size_t>(ranks_per_node);
  const std::size_t psi = model.num_parameters();
  state->shard = (psi + k - 1) / k;
  state->inner = make_inner(state->shard);
  if (state->inner == nullptr) throw Error("HsdpOptimizer: the factory returned no optimizer");
  if (state->inner->state_size() != state->shard)
    throw Error(
        fmt::format("HsdpOptimizer: the factory's optimizer keeps state for {} elements; "
                    "expected the shard's {}",
                    state->inner->state_size(), state->shard));
  const Device device = model.device();
  const auto shard = static_cast<std::int64_t>(state->shard);
  state->flat = Tensor({shard * ranks_per_node}, MemoryCategory::kCommunication, device);
  state->shard_grad = Tensor({shard}, MemoryCategory::kGradients, device);
  state->shard_params = Tensor({shard}, MemoryCategory::kParameters, device);
  // This rank's shard of the (identical) initial parameters; the padding stays zero.
  const std::size_t begin = static_cast<std::size_t>(state->levels.node->rank()) * state->shard;
  for (const Parameter* parameter : model.parameters()) {
    const std::size_t first = std::max(begin, parameter->offset);
    const std::size_t last =
        std::min(begin + state->shard, parameter->offset + parameter->value.size());
    if (first >= last) continue;
    copy(parameter->value.view(first - parameter->offset, last - first),
         state->shard_params.view(first - begin, last - first));
  }
  state_ = std::move(state);
  // END SOLUTION
}

HsdpOptimizer::~HsdpOptimizer() = default;

void HsdpOptimizer::step() {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab9::HsdpOptimizer::step");
  State& s = *state_;
  const std::size_t psi = s.model.num_parameters();
  for (const Parameter* parameter : s.model.parameters())
    copy(parameter->grad.view(), s.flat.view(parameter->offset, parameter->grad.size()));
  // The all-gather of the previous step wrote the (zero) padding of the parameters there.
  if (s.flat.size() > psi) fill(s.flat.view(psi, s.flat.size() - psi), 0.0f);
  s.levels.node->reduce_scatter(std::as_const(s.flat).view(), s.shard_grad.view(), ReduceOp::kSum)
      ->wait();
  s.levels.across->allreduce(s.shard_grad.view(), ReduceOp::kSum)->wait();
  divide(s.shard_grad.view(), static_cast<float>(s.comm.size()));
  s.inner->begin_step();
  s.inner->update(0, s.shard_params.view(), std::as_const(s.shard_grad).view());
  s.levels.node->allgather(std::as_const(s.shard_params).view(), s.flat.view())->wait();
  for (Parameter* parameter : s.model.parameters())
    copy(std::as_const(s.flat).view(parameter->offset, parameter->value.size()),
         parameter->value.view());
  // END SOLUTION
}

std::size_t HsdpOptimizer::shard_elements() const {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab9::HsdpOptimizer::shard_elements");
  return state_->shard;
  // END SOLUTION
}

const Tensor& HsdpOptimizer::shard_parameters() const {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab9::HsdpOptimizer::shard_parameters");
  return state_->shard_params;
  // END SOLUTION
}

Optimizer& HsdpOptimizer::inner() {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab9::HsdpOptimizer::inner");
  return *state_->inner;
  // END SOLUTION
}

}  // namespace dp::lab9
