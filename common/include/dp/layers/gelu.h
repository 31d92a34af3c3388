// gelu.h: the Gaussian error linear unit, tanh approximation, elementwise.
//
// GELU(x) = x Phi(x) with Phi the standard normal CDF (Hendrycks and Gimpel, 2016). We
// use the tanh approximation (PyTorch's `approximate="tanh"`, as in GPT-2):
//
//   y = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
//   dy/dx = 0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
//
// computed through the identity 1 + tanh(u) = 2 s with s = 1 / (1 + exp(-2u)), the logistic
// sigmoid of 2u, so that 1 - tanh(u)^2 = 4 s (1 - s):
//
//   y = x s,   dy/dx = s + 2 x s (1 - s) du/dx
//
// The same function, but one exp per element instead of a tanh (glibc's tanhf, through
// expm1f, is several times slower: it was 40% of a GPT's training step), and no 1 + tanh(u)
// that cancels for large negative u. For u far below 0, exp(-2u) overflows to infinity and
// s = 0 exactly, as the limit says.
//
// On a CUDA device a kernel computes the same formulas; its expf differs from the host's
// std::exp by an ulp or two, so device and host agree within a few ulps, not bitwise.
//
// Example:
//
//   dp::GELU gelu("gelu1", 256);
//   dp::Tensor y = gelu.forward(x);      // x: (B, 256) -> y: (B, 256)
//   dp::Tensor dx = gelu.backward(dy);
//
// Precision: the output and the gradient are of the input's type, float32 or bfloat16 /
// float16 (mixed-precision training; it has no parameters). The 16-bit rule, as
// dp::Linear's: x (and in backward dy) widened to float32 exactly, the float32 formulas
// above, each result rounded once to nearest even: y = round(GELU(x)),
// dx = round(dy dy/dx). It saves the input in its own type (2 bytes an element), and the
// float32 temporaries are charged as activations while a call runs. It runs on the host and
// the emulated device only (16-bit activations on a GPU throw).
#pragma once

#include <cstdint>
#include <string>

#include "dp/layer.h"

namespace dp {

/// GELU with the tanh approximation, elementwise on (B, features).
class GELU final : public Layer {
 public:
  /// An activation `name` on rows of `features` elements (the width fixes its cost).
  /// Throws `dp::Error` unless `features` is positive.
  GELU(std::string name, std::int64_t features);

  /// "gelu".
  std::string kind() const override { return "gelu"; }
  /// input: (B, features) -> (B, features).
  Tensor forward(const Tensor& input) override;
  /// grad_output: (B, features) -> (B, features).
  Tensor backward(const Tensor& grad_output) override;
  /// Drops what the last forward saved (see `Layer::discard_saved`).
  void discard_saved() override;
  /// About 10 flops per element (a tanh counted as one), read x, write y.
  OpCost forward_cost(std::int64_t batch) const override;
  /// About 15 flops per element, read dy and x, write dx.
  OpCost backward_cost(std::int64_t batch) const override;

  /// Number of features per row.
  std::int64_t features() const { return features_; }

 private:
  std::int64_t features_;
  Tensor saved_input_;  // (B, features)
};

}  // namespace dp
