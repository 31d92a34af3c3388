// average.cpp: lab 2's gradient averaging, one all-reduce per parameter and then one
// over a flat buffer. Your part: the bodies of average_gradients and
// FlatGradientAverager::average.
#include <algorithm>
#include <memory>
#include <vector>

#include "dp/error.h"
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
      pending.emplace_back(parameter, comm.allreduce(parameter->grad.span(), ReduceOp::kSum));
  // A post-divide, as ReduceOp::kAvg does: the sum is the same on every rank, so the
  // quotients are too, bit for bit.
  const auto world = static_cast<float>(comm.size());
  for (auto& [parameter, work] : pending) {
    work->wait();
    for (float& g : parameter->grad.span()) g /= world;
  }
  // END SOLUTION
}

FlatGradientAverager::FlatGradientAverager(const Model& model)
    : buffer_({static_cast<std::int64_t>(model.num_trainable_parameters())},
              MemoryCategory::kCommunication) {}

void FlatGradientAverager::average(Model& model, Communicator& comm) {
  if (buffer_.size() != model.num_trainable_parameters())
    throw Error(fmt::format(
        "FlatGradientAverager: the buffer holds {} elements but the model has {} trainable "
        "ones; make the averager after freezing parameters",
        buffer_.size(), model.num_trainable_parameters()));
  // BEGIN SOLUTION
  // SKELETON: (void)model;
  // SKELETON: (void)comm;
  // SKELETON: throw NotImplemented("lab2::FlatGradientAverager::average");
  // Pack: trainable gradients one after another, in definition order.
  std::span<float> flat = buffer_.span();
  std::size_t position = 0;
  for (const Parameter* parameter : model.parameters()) {
    if (parameter->frozen) continue;
    const std::span<const float> grad = parameter->grad.span();
    std::copy(grad.begin(), grad.end(), flat.begin() + static_cast<std::ptrdiff_t>(position));
    position += grad.size();
  }

  comm.allreduce(flat, ReduceOp::kSum)->wait();

  // Unpack, dividing on the way: one pass over the data instead of two.
  const auto world = static_cast<float>(comm.size());
  position = 0;
  for (Parameter* parameter : model.parameters()) {
    if (parameter->frozen) continue;
    for (float& g : parameter->grad.span()) g = flat[position++] / world;
  }
  // END SOLUTION
}

}  // namespace dp::lab2
