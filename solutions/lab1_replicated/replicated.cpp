// replicated.cpp: lab 1's broadcast of the initial weights and the training loop with no
// synchronisation. Your part: both function bodies.
#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <span>

#include "dp/error.h"
#include "lab1.h"

namespace dp::lab1 {

void broadcast_initial_weights(Model& model, Communicator& comm) {
  // BEGIN SOLUTION
  // SKELETON: (void)model;
  // SKELETON: (void)comm;
  // SKELETON: throw NotImplemented("lab1::broadcast_initial_weights");
  // Issue every broadcast first and wait afterwards: the calls overlap instead of paying
  // one round trip each. Frozen parameters too: a replica must equal rank 0's whole model.
  std::vector<std::unique_ptr<Work>> pending;
  for (Parameter* parameter : model.parameters())
    pending.push_back(comm.broadcast(parameter->value.view(), /*root=*/0));
  for (auto& work : pending) work->wait();
  // END SOLUTION
}

std::vector<float> train_replicated(Model& model, Optimizer& optimizer, const Dataset& data,
                                    Communicator& comm, const ReplicatedOptions& options) {
  if (options.local_batch <= 0)
    throw Error(
        fmt::format("train_replicated: local_batch must be positive, got {}", options.local_batch));
  // BEGIN SOLUTION
  // SKELETON: (void)model;
  // SKELETON: (void)optimizer;
  // SKELETON: (void)data;
  // SKELETON: (void)comm;
  // SKELETON: throw NotImplemented("lab1::train_replicated");
  std::vector<float> losses;
  DistributedSampler sampler(data.size(), comm.size(), comm.rank(), options.sampler);
  const auto batch_size = static_cast<std::size_t>(options.local_batch);
  for (int epoch = 0; epoch < options.epochs; ++epoch) {
    sampler.set_epoch(static_cast<std::uint64_t>(epoch));
    const std::vector<std::size_t> shard = sampler.indices();
    for (std::size_t start = 0; start < shard.size(); start += batch_size) {
      if (options.max_steps >= 0 && static_cast<int>(losses.size()) >= options.max_steps)
        return losses;
      const std::size_t count = std::min(batch_size, shard.size() - start);
      const Batch batch = gather_batch(data, std::span(shard).subspan(start, count));
      model.zero_grad();
      // The batch is gathered in host memory: it goes to wherever the model lives.
      const Tensor logits = model.forward(batch.inputs.to(model.device()));  // (count, classes)
      losses.push_back(model.backward(logits, batch.labels));
      // No gradient exchange: each replica follows its own shard's gradient.
      optimizer.step(model);
    }
  }
  return losses;
  // END SOLUTION
}

}  // namespace dp::lab1
