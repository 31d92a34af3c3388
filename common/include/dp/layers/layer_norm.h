// layer_norm.h: layer normalisation over the features of each row (Ba et al., 2016).
//
//   mean = (1/D) sum_j x_j,  var = (1/D) sum_j (x_j - mean)^2   (biased, as PyTorch)
//   xhat = (x - mean) / sqrt(var + eps),  y = gamma * xhat + beta
//
// Backward, per row, with g = dy * gamma:
//
//   dgamma += sum_rows(dy * xhat),  dbeta += sum_rows(dy)
//   dx = (g - mean_j(g) - xhat * mean_j(g * xhat)) / sqrt(var + eps)
//
// On a CUDA device one block per row computes the row sums in double as a tree (the host
// adds in index order), so the two agree within a few float ulps; dgamma and dbeta add the
// rows in groups in a fixed order of their own (cuda/layer_kernels.cu), within the float
// sum bound of the host's.
//
// Example:
//
//   dp::LayerNorm ln("ln1", 256);        // parameters "ln1.weight" (gamma), "ln1.bias" (beta)
//   dp::Tensor y = ln.forward(x);        // x: (B, 256) -> y: (B, 256)
//
// Precision: gamma, beta, the input, the output and the gradients are all of the type given
// at construction, float32 by default or bfloat16 / float16 (mixed-precision training). The
// 16-bit rule, as dp::Linear's: x, gamma, beta (and in backward dy) are widened to float32
// exactly, the float32 arithmetic above runs on them, and each result is rounded once to
// nearest even: y = round(LN(x)), dx = round(dx of the float32 layer), and the parameter
// gradients are added as grad = round(widen(grad) + this batch's float32 sum). The saved xhat
// and 1/sqrt(var + eps) stay float32 (4 bytes each, charged as activations), so backward is
// the float32 layer's on the same values. It runs on the host and the emulated device only
// (a 16-bit LayerNorm on a GPU throws).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dp/layer.h"

namespace dp {

/// The default eps of `LayerNorm` (PyTorch's), for a caller that names a type after it.
inline constexpr float kLayerNormEps = 1e-5f;

/// Normalises each row of (B, features) to mean 0 and variance 1, then scales by gamma
/// and shifts by beta (both learnable, (features)).
class LayerNorm final : public Layer {
 public:
  /// A layer `name` over rows of `features` elements; `eps` keeps the division finite;
  /// parameters and activations of element type `dtype` (see the top of this file). Throws
  /// `dp::Error` unless `features` and `eps` are positive and `dtype` is a tensor type.
  LayerNorm(std::string name, std::int64_t features, float eps = kLayerNormEps,
            DataType dtype = DataType::kFloat32);

  /// "layer_norm".
  std::string kind() const override { return "layer_norm"; }
  /// input: (B, features) -> (B, features); keeps xhat and 1/sqrt(var + eps) for backward.
  Tensor forward(const Tensor& input) override;
  /// grad_output: (B, features) -> (B, features); adds into the gamma and beta gradients.
  Tensor backward(const Tensor& grad_output) override;
  /// Drops what the last forward saved (see `Layer::discard_saved`).
  void discard_saved() override;
  /// {weight (gamma), bias (beta)}.
  std::vector<Parameter*> parameters() override { return {&weight_, &bias_}; }
  /// gamma = 1 and beta = 0, as PyTorch; `rng` is not used.
  void initialize(Parameter& parameter, CounterRng& rng) override;
  /// About 8 flops per element; read x, gamma, beta, write y and the saved xhat.
  OpCost forward_cost(std::int64_t batch) const override;
  /// About 10 flops per element; read dy, xhat, gamma, write dx, update dgamma and dbeta.
  OpCost backward_cost(std::int64_t batch) const override;

  /// Number of features per row.
  std::int64_t features() const { return features_; }
  /// The epsilon added to the variance.
  float eps() const { return eps_; }
  /// The scale gamma, (features).
  Parameter& weight() { return weight_; }
  /// The shift beta, (features).
  Parameter& bias() { return bias_; }

 private:
  // Throws unless `tensor` (called `what`) holds the parameters' element type.
  void require_type(const Tensor& tensor, std::string_view what) const;

  std::int64_t features_;
  float eps_;
  Parameter weight_;
  Parameter bias_;
  Tensor saved_normalized_;  // (B, features), xhat of the last forward
  Tensor saved_inv_std_;     // (B), 1 / sqrt(var + eps) per row
};

}  // namespace dp
