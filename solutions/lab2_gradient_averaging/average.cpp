// average.cpp: lab 2's gradient averaging, one all-reduce per parameter and then one
// over a flat buffer. Your part: the bodies of average_gradients and of the
// FlatGradientAverager's members, and what its State keeps.
#include <fmt/format.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "dp/error.h"
#include "dp/tensor_ops.h"
#include "lab2.h"

namespace dp::lab2 {

void average_gradients(Model& model, Communicator& comm) {
  // BEGIN SOLUTION
  // SKELETON: (void)model;
  // SKELETON: (void)comm;
  // SKELETON: throw NotImplemented("lab2::average_gradients");
  // Launch every all-reduce before waiting for any: they progress together on the
  // backend's thread. Frozen parameters have no gradient: nothing to send.
  std::vector<std::pair<Parameter*, std::unique_ptr<Work>>> pending;
  for (Parameter* parameter : model.parameters())
    if (!parameter->frozen)
      pending.emplace_back(parameter, comm.allreduce(parameter->grad.view(), ReduceOp::kSum));
  // Each sum may be read only once its own call is complete. Then a post-divide, as
  // ReduceOp::kAvg does: the sum is the same bits on every rank, so the quotients are too.
  const auto world = static_cast<float>(comm.size());
  for (auto& [parameter, work] : pending) {
    work->wait();
    divide(parameter->grad.view(), world);
  }
  // END SOLUTION
}

/// What a FlatGradientAverager keeps from its constructor to every average().
struct FlatGradientAverager::State {
  // BEGIN SOLUTION
  // SKELETON: // Your members.
  Tensor buffer;  // (T,): the trainable gradients one after another, in definition order
  // END SOLUTION
};

FlatGradientAverager::FlatGradientAverager(const Model& model) {
  // BEGIN SOLUTION
  // SKELETON: (void)model;
  // SKELETON: throw NotImplemented("lab2::FlatGradientAverager::FlatGradientAverager");
  // One float per trainable element, where the model lives, charged as what it is: memory
  // for communication, neither gradients nor activations.
  state_ = std::make_unique<State>(
      State{Tensor({static_cast<std::int64_t>(model.num_trainable_parameters())},
                   MemoryCategory::kCommunication, model.device())});
  // END SOLUTION
}

FlatGradientAverager::~FlatGradientAverager() = default;

void FlatGradientAverager::average(Model& model, Communicator& comm) {
  // BEGIN SOLUTION
  // SKELETON: (void)model;
  // SKELETON: (void)comm;
  // SKELETON: throw NotImplemented("lab2::FlatGradientAverager::average");
  Tensor& buffer = state_->buffer;
  if (buffer.size() != model.num_trainable_parameters())
    throw Error(fmt::format(
        "FlatGradientAverager: the buffer holds {} elements but the model has {} trainable "
        "ones; make the averager after freezing parameters",
        buffer.size(), model.num_trainable_parameters()));
  // Pack: trainable gradients one after another, in definition order.
  std::size_t offset = 0;
  for (const Parameter* parameter : model.parameters()) {
    if (parameter->frozen) continue;
    copy(parameter->grad.view(), buffer.view(offset, parameter->grad.size()));
    offset += parameter->grad.size();
  }

  comm.allreduce(buffer.view(), ReduceOp::kSum)->wait();
  divide(buffer.view(), static_cast<float>(comm.size()));

  // Unpack, in the same order.
  offset = 0;
  for (Parameter* parameter : model.parameters()) {
    if (parameter->frozen) continue;
    copy(buffer.view(offset, parameter->grad.size()), parameter->grad.view());
    offset += parameter->grad.size();
  }
  // END SOLUTION
}

}  // namespace dp::lab2
