// relu.h: the rectified linear unit, y = max(x, 0), elementwise.
//
// Its gradient is 1 where the input was positive and 0 elsewhere (0 at exactly 0, as in
// PyTorch), so backward keeps the input of the last forward. On a CUDA device a kernel
// computes both directions, bitwise the host loops. A bfloat16 or float16 input gives an
// output of its type, the float32 rule applied to the widened values (exact: each result is
// an input element or +0); that runs on the host and the emulated device only.
//
// Example:
//
//   dp::ReLU relu("relu1", 256);
//   dp::Tensor y = relu.forward(x);      // x: (B, 256) -> y: (B, 256)
//   dp::Tensor dx = relu.backward(dy);   // dx = dy where x > 0, else 0
#pragma once

#include <cstdint>
#include <string>

#include "dp/layer.h"

namespace dp {

/// y = max(x, 0) elementwise on (B, features).
class ReLU final : public Layer {
 public:
  /// An activation `name` on rows of `features` elements (the width fixes its cost).
  /// Throws `dp::Error` unless `features` is positive.
  ReLU(std::string name, std::int64_t features);

  /// "relu".
  std::string kind() const override { return "relu"; }
  /// input: (B, features) -> (B, features).
  Tensor forward(const Tensor& input) override;
  /// grad_output: (B, features) -> (B, features).
  Tensor backward(const Tensor& grad_output) override;
  /// Drops what the last forward saved (see `Layer::discard_saved`).
  void discard_saved() override;
  /// One comparison per element, reading the input and writing the output.
  OpCost forward_cost(std::int64_t batch) const override;
  /// One select per element, reading dy and x and writing dx.
  OpCost backward_cost(std::int64_t batch) const override;

  /// Number of features per row.
  std::int64_t features() const { return features_; }

 private:
  std::int64_t features_;
  Tensor saved_input_;  // (B, features)
};

}  // namespace dp
