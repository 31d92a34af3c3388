// cross_entropy.h: softmax cross-entropy loss with mean reduction over the batch.
//
// For logits z (B, C) and labels y (B):
//
//   loss = (1/B) sum_i [ logsumexp(z_i) - z_i[y_i] ]
//   dloss/dz_i = (softmax(z_i) - onehot(y_i)) / B
//
// logsumexp subtracts the row maximum first, so large logits do not overflow exp().
// It is not a `Layer`: it ends the model, takes labels, and returns a number. The labels
// stay on the host; for logits on a CUDA device the kernels copy them over, and the loss
// comes back to the host (the read waits for the forward's kernels).
//
// Example:
//
//   dp::SoftmaxCrossEntropy loss;
//   float mean_loss = loss.forward(logits, labels);   // logits: (B, C), labels: B ints
//   dp::Tensor dlogits = loss.backward(0.5f);         // (B, C), scaled for 2 micro-batches
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "dp/layer.h"
#include "dp/tensor.h"

namespace dp {

/// Softmax followed by the negative log-likelihood of the labels, averaged over rows.
class SoftmaxCrossEntropy {
 public:
  /// Returns the mean loss of `logits` (B, C) against `labels` (B values in [0, C)) and
  /// keeps the softmax for backward. Throws `dp::Error` on a batch-size mismatch or a label
  /// out of range (naming its index and value).
  float forward(const Tensor& logits, std::span<const int> labels);
  /// dLogits = scale * (softmax - onehot) / B, (B, C), of the last forward.
  /// Throws `dp::Error` if forward was not called.
  Tensor backward(float scale = 1.0f);

  /// About 4 flops per logit (max, subtract, exp, sum); reads the logits, writes softmax.
  static OpCost forward_cost(std::int64_t batch, std::int64_t classes);
  /// About 2 flops per logit; reads the softmax, writes dLogits.
  static OpCost backward_cost(std::int64_t batch, std::int64_t classes);

 private:
  Tensor probabilities_;     // (B, C), softmax of the last forward's logits
  std::vector<int> labels_;  // (B)
};

}  // namespace dp
