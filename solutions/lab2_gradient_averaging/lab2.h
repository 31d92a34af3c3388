// lab2.h: lab 2, gradient averaging. The contract between your code and the grader.
//
// Every rank computes the gradient of the mean loss over its own B/N samples. Averaging
// those N gradients over the ranks gives the gradient of the mean loss over all B
// samples, so after the optimizer step every replica equals the model one process would
// have trained on the whole global batch (up to float32 rounding). That equivalence is
// what makes data parallelism correct, and the grader checks it step by step.
//
// You write three ways to synchronise, in average.cpp and accumulate.cpp:
//   * `average_gradients`: one all-reduce per parameter, then divide by the world size;
//   * `FlatGradientAverager`: every gradient packed into one buffer, one all-reduce;
//   * `accumulation_step`: k micro-batches, gradients kept locally for the first k-1 and
//     averaged once after the last (PyTorch's `no_sync()`).
// Read README.md beside this file first; do not change this header.
//
// Example (one data-parallel step):
//
//   model.zero_grad();
//   dp::Tensor logits = model.forward(batch.inputs);   // (B/N, classes)
//   model.backward(logits, batch.labels);               // local mean-loss gradients
//   dp::lab2::average_gradients(model, comm);            // now the global batch's gradients
//   optimizer.step(model);                               // the same step on every rank
#pragma once

#include <span>

#include "dp/comm.h"
#include "dp/data.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "dp/tensor.h"

namespace dp::lab2 {

/// Replaces every trainable parameter's gradient by its average over all ranks: one
/// all-reduce (sum) per parameter, in definition order, then a division by
/// `comm.size()`. Frozen parameters have no gradient to share: they are not
/// communicated. Every rank ends with bitwise the same gradients.
void average_gradients(Model& model, Communicator& comm);

/// Averages every trainable gradient with a single all-reduce over one flat buffer.
///
/// Many small all-reduces each pay the network's latency; one large one pays it once.
/// The buffer is allocated once, at construction, and reused every step (fresh memory
/// is slow to touch and allocation on a hot path is waste).
class FlatGradientAverager {
 public:
  /// Allocates the flat buffer for `model`'s trainable parameters (frozen ones excluded),
  /// charged as communication memory.
  explicit FlatGradientAverager(const Model& model);

  /// Copies every trainable gradient into the buffer (definition order), all-reduces it
  /// once (sum), divides by `comm.size()`, and copies the averages back into the
  /// gradients. Exactly one collective call per step.
  void average(Model& model, Communicator& comm);

  /// The flat buffer: (number of trainable parameter elements).
  const Tensor& buffer() const { return buffer_; }

 private:
  Tensor buffer_;
};

/// One optimizer step with gradient accumulation over `micro_batches.size()` = k
/// micro-batches (this rank's share of the global batch, cut in k equal parts).
///
/// Zero the gradients; for each micro-batch run forward and backward with the loss
/// scaled by 1/k (`Model::backward`'s `loss_scale`), so that the gradients add up to
/// the mean over all k; communicate nothing until the last micro-batch's backward is
/// done; then `average_gradients` once and `optimizer.step(model)`. Returns the mean of
/// the k micro-batch losses. Throws `dp::Error` when there are no micro-batches.
float accumulation_step(Model& model, Optimizer& optimizer, std::span<const Batch> micro_batches,
                        Communicator& comm);

}  // namespace dp::lab2
