// linear.h: the fully connected layer y = x W^T + b.
//
// The weight is stored (out, in), as in PyTorch, so a checkpoint's layout matches
// `torch.nn.Linear`. Forward and backward are three matrix products through BLAS (cuBLAS
// when the tensors live on a CUDA device, dp/ops.h):
//
//   forward   y  = x W^T + b      (B, out) = (B, in) (in, out)
//   backward  dW += dY^T x        (out, in) = (out, B) (B, in)
//             db += sum_rows(dY)  (out)
//             dx  = dY W          (B, in) = (B, out) (out, in)
//
// A model's first layer skips dx (`backward_parameters_only`): its input is the data, which
// needs no gradient, so a step of an L-layer MLP does 3L - 1 products, as PyTorch does.
//
// Example:
//
//   dp::Linear fc("fc1", 64, 256);    // parameters "fc1.weight" (256, 64), "fc1.bias" (256)
//   dp::Tensor y = fc.forward(x);      // x: (B, 64) -> y: (B, 256)
//   dp::Tensor dx = fc.backward(dy);   // dy: (B, 256) -> dx: (B, 64)
//
// Precision: the parameters, the input, the output and the gradients are all of the type
// given at construction, float32 by default or bfloat16 / float16 (mixed-precision training,
// dp::MixedPrecisionOptimizer keeps the float32 masters). The 16-bit rule: the operands are
// widened to float32 exactly, the products are BLAS sgemm in float32 (on a GPU cuBLAS in
// float32, as a float32 layer), and each result is rounded once, to nearest even: the output
// y = round(x W^T + b), dX = round(dY W), and the parameter gradients are added as
// grad = round(widen(grad) + contribution). The float32 temporaries are charged as
// activations while the call runs. On the emulated device the same host code runs.
//
// As every layer, it runs where its tensors live (dp/layer.h): the bias broadcast (equal to
// the loop bit for bit) and the bias gradient's column sums (the rows added in groups in a
// fixed order, within the float sum bound of the loop's) have kernels of their own.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dp/layer.h"

namespace dp {

/// A fully connected layer: y = x W^T + b with W (out, in) and b (out).
class Linear final : public Layer {
 public:
  /// A layer `name` mapping `in_features` to `out_features`, parameters zero-filled
  /// (`Model::init_parameters` draws them), of element type `dtype` (see the top of this
  /// file). Throws `dp::Error` unless both sizes are positive and `dtype` is a tensor type.
  Linear(std::string name, std::int64_t in_features, std::int64_t out_features,
         DataType dtype = DataType::kFloat32);

  /// "linear".
  std::string kind() const override { return "linear"; }
  /// input: (B, in) -> (B, out); keeps a copy of the input for backward.
  Tensor forward(const Tensor& input) override;
  /// grad_output: (B, out) -> (B, in); adds into the weight and bias gradients.
  Tensor backward(const Tensor& grad_output) override;
  /// Drops what the last forward saved (see `Layer::discard_saved`).
  void discard_saved() override;
  /// As backward without dx = dY W: the weight and bias gradients only (an empty result).
  Tensor backward_parameters_only(const Tensor& grad_output) override;
  /// {weight, bias}.
  std::vector<Parameter*> parameters() override { return {&weight_, &bias_}; }
  /// Uniform in (-1/sqrt(in), 1/sqrt(in)) for weight and bias, as PyTorch's default (for
  /// 16-bit parameters the same float32 draws, rounded).
  void initialize(Parameter& parameter, CounterRng& rng) override;
  /// 2 B in out flops for the product, B out for the bias.
  OpCost forward_cost(std::int64_t batch) const override;
  /// Two products (dx, dW) and the bias row sum.
  OpCost backward_cost(std::int64_t batch) const override;
  /// The product dW and the bias row sum (no dx).
  OpCost backward_parameters_only_cost(std::int64_t batch) const override;

  /// Number of input features.
  std::int64_t in_features() const { return in_features_; }
  /// Number of output features.
  std::int64_t out_features() const { return out_features_; }
  /// The weight W, (out, in).
  Parameter& weight() { return weight_; }
  /// The bias b, (out).
  Parameter& bias() { return bias_; }

 private:
  // Throws unless `tensor` (called `what`) holds the parameters' element type.
  void require_input_type(const Tensor& tensor, std::string_view what) const;
  // backward's work: the parameter gradients, then dx when `input_gradient` (else empty).
  Tensor backward_impl(const Tensor& grad_output, bool input_gradient);

  std::int64_t in_features_;
  std::int64_t out_features_;
  Parameter weight_;
  Parameter bias_;
  Tensor saved_input_;  // (B, in), the input of the last forward
};

}  // namespace dp
