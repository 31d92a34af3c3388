// accumulate.cpp: lab 2's gradient accumulation over k micro-batches, with one
// synchronisation per optimizer step. Your part: the body of accumulation_step.
#include <fmt/format.h>

#include "dp/error.h"
#include "lab2.h"

namespace dp::lab2 {

float accumulation_step(Model& model, Optimizer& optimizer, std::span<const Batch> micro_batches,
                        Communicator& comm) {
  if (micro_batches.empty())
    throw Error("accumulation_step: expected at least one micro-batch, got none");
  // BEGIN SOLUTION
  // SKELETON: (void)model;
  // SKELETON: (void)optimizer;
  // SKELETON: (void)comm;
  // SKELETON: throw NotImplemented("lab2::accumulation_step");
  const auto k = static_cast<float>(micro_batches.size());
  model.zero_grad();
  float loss_sum = 0;
  for (const Batch& micro : micro_batches) {
    const Tensor logits = model.forward(micro.inputs.to(model.device()));  // (B/(N k), classes)
    // Scaled by 1/k, the k backward passes add up to the gradient of the mean loss over
    // all of this rank's samples. Nothing is communicated yet: that is no_sync().
    loss_sum += model.backward(logits, micro.labels, 1.0f / k);
  }
  average_gradients(model, comm);  // once, after the last micro-batch
  optimizer.step(model);
  return loss_sum / k;
  // END SOLUTION
}

}  // namespace dp::lab2
