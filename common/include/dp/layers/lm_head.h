// lm_head.h: a GPT's output layer, the final LayerNorm and the projection to the
// vocabulary without bias (untied from the token embedding).
//
// For x (B, T, C):
//
//   h = ln_f(x)                                  (B T, C), one row per token
//   logits = h W^T                               (B T, V), W (V, C), no bias
//   backward  dW += dlogits^T h,  dh = dlogits W,  dx = ln_f'(dh)     (B, T, C)
//
// The logits come out as rows, one per token: dp::SoftmaxCrossEntropy (rows, classes) then
// takes the B T next-token labels and averages over every predicted token, with no reshape
// in between. The two products go through dp::matmul (cuBLAS on a GPU) and ln_f is a
// dp::LayerNorm with its kernels, so this layer runs where its tensors live; it saves ln_f's
// own tensors and h, charged to `MemoryCategory::kActivations`.
//
// Parameters, named as GPT-2 names them whatever the layer's name: "ln_f.weight" (C),
// "ln_f.bias" (C), "lm_head.weight" (V, C), torch.nn.Linear's layout (out, in).
//
// Example:
//
//   dp::LanguageModelHead head("head", /*dim=*/128, /*vocab=*/65, /*context=*/64);
//   dp::Tensor logits = head.forward(x);   // x: (B, T, 128) -> logits: (B T, 65)
//   dp::Tensor dx = head.backward(dlogits); // dlogits: (B T, 65) -> dx: (B, T, 128)
//
// Precision: the parameters, the input, the logits and the gradients are of the type given
// at construction, float32 by default or bfloat16 / float16 (mixed-precision training). The
// 16-bit rule, as dp::Linear's, for each of its two operations: ln_f is a 16-bit
// dp::LayerNorm, and the projection widens h and W (and in backward dlogits) to float32
// exactly, multiplies in float32 and rounds each result once to nearest even:
// logits = round(h W^T), dh = round(dlogits W), and W's gradient is added as
// grad = round(widen(grad) + dlogits^T h). h is saved in 16 bits. (The loss takes the 16-bit
// logits widened: dp::Model::backward.) It runs on the host and the emulated device only (a
// 16-bit head on a GPU throws).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dp/layer.h"
#include "dp/layers/layer_norm.h"

namespace dp {

/// logits = ln_f(x) W^T: the final LayerNorm and a bias-free projection to the vocabulary.
class LanguageModelHead final : public Layer {
 public:
  /// A layer `name` from `dim` features to `vocab` logits per token, for sequences of at
  /// most `context` tokens (the length its costs assume); parameters zero-filled. Throws
  /// `dp::Error` unless all three are positive and `dtype` is a tensor type (see above).
  LanguageModelHead(std::string name, std::int64_t dim, std::int64_t vocab, std::int64_t context,
                    DataType dtype = DataType::kFloat32);

  /// "lm_head".
  std::string kind() const override { return "lm_head"; }
  /// input: (B, T, dim) with 1 <= T <= context -> logits (B T, vocab), token (b, t) in row
  /// b T + t. Throws `dp::Error` naming the layer on another shape.
  Tensor forward(const Tensor& input) override;
  /// grad_output: (B T, vocab) -> (B, T, dim); adds into the three gradients.
  Tensor backward(const Tensor& grad_output) override;
  /// Drops what the last forward saved (see `Layer::discard_saved`).
  void discard_saved() override;
  /// {ln_f.weight, ln_f.bias, lm_head.weight}.
  std::vector<Parameter*> parameters() override;
  /// ln_f weight 1 and bias 0; lm_head.weight normal with standard deviation 0.02 (GPT-2).
  void initialize(Parameter& parameter, CounterRng& rng) override;
  /// `batch` sequences of `context` tokens: ln_f and the (B T, C, V) product.
  OpCost forward_cost(std::int64_t batch) const override;
  /// `batch` sequences of `context` tokens: two (B T, C, V) products and ln_f's backward.
  OpCost backward_cost(std::int64_t batch) const override;

  /// Number of features (C).
  std::int64_t dim() const { return dim_; }
  /// Number of tokens in the vocabulary (V).
  std::int64_t vocab() const { return vocab_; }
  /// The longest sequence, the length the costs assume.
  std::int64_t context() const { return context_; }
  /// The final LayerNorm ln_f.
  LayerNorm& ln_f() { return ln_f_; }
  /// The projection W, (vocab, dim).
  Parameter& weight() { return weight_; }

 private:
  std::int64_t dim_;
  std::int64_t vocab_;
  std::int64_t context_;
  LayerNorm ln_f_;
  Parameter weight_;
  std::int64_t saved_time_ = 0;  // T of the last forward
  Tensor saved_normalized_;      // (B T, C), h = ln_f(x) of the last forward
};

}  // namespace dp
