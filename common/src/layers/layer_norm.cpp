#include "dp/layers/layer_norm.h"

#include <cmath>

#include "cuda/device_ops.h"
#include "device_dispatch.h"
#include "dp/error.h"
#include "precision.h"

namespace dp {

LayerNorm::LayerNorm(std::string name, std::int64_t features, float eps, DataType dtype)
    : Layer(std::move(name)), features_(features), eps_(eps) {
  if (features <= 0)
    throw Error(
        fmt::format("layer norm {} needs a positive width, got {}", this->name(), features));
  if (!(eps > 0.0f))
    throw Error(fmt::format("layer norm {} needs a positive eps, got {}", this->name(), eps));
  detail::check_tensor_type("LayerNorm", dtype);
  weight_ = Parameter::zeros(this->name() + ".weight", {features}, dtype);
  bias_ = Parameter::zeros(this->name() + ".bias", {features}, dtype);
}

Tensor LayerNorm::forward(const Tensor& input) {
  require_input(input, features_);
  require_value(weight_, {features_});
  require_value(bias_, {features_});
  require_same_device(input, "the input", weight_.value, weight_.name);
  require_same_device(bias_.value, bias_.name, weight_.value, weight_.name);
  require_type(input, "the input");
  const std::int64_t batch = input.dim(0);
  const std::int64_t width = features_;
  const Device device = input.device();
  constexpr MemoryCategory kActivations = MemoryCategory::kActivations;
  // 16-bit: x, gamma and beta widened to float32 exactly, the float32 arithmetic below, the
  // output rounded once (layer_norm.h).
  const DataType type = weight_.value.dtype();
  const bool narrow = type != DataType::kFloat32;
  if (narrow) detail::require_16bit_off_gpu(name(), input);
  const Tensor wide_input = narrow ? detail::widened(input) : Tensor();
  const Tensor wide_weight = narrow ? detail::widened(weight_.value) : Tensor();
  const Tensor wide_bias = narrow ? detail::widened(bias_.value) : Tensor();
  const Tensor& x_all = narrow ? wide_input : input;

  Tensor output = Tensor::uninitialized({batch, width}, kActivations, device);      // (B, D)
  saved_normalized_ = Tensor::uninitialized({batch, width}, kActivations, device);  // xhat
  saved_inv_std_ = Tensor::uninitialized({batch}, kActivations, device);            // (B)
  if (detail::on_gpu(device)) {
    cuda::layer_norm_forward(input.view().data(), weight_.value.view().data(),
                             bias_.value.view().data(), batch, width, eps_, output.view().data(),
                             saved_normalized_.view().data(), saved_inv_std_.view().data());
    return output;
  }
  const float* gamma = (narrow ? wide_weight : weight_.value).view().data();
  const float* beta = (narrow ? wide_bias : bias_.value).view().data();
  for (std::int64_t row = 0; row < batch; ++row) {
    const float* x = x_all.view().data() + row * width;
    float* xhat = saved_normalized_.view().data() + row * width;
    float* y = output.view().data() + row * width;
    // Row statistics in double: float sums of many similar values lose digits.
    double sum = 0.0;
    for (std::int64_t j = 0; j < width; ++j) sum += x[j];
    const double mean = sum / static_cast<double>(width);
    double squares = 0.0;
    for (std::int64_t j = 0; j < width; ++j) squares += (x[j] - mean) * (x[j] - mean);
    const double variance = squares / static_cast<double>(width);  // biased, as PyTorch
    const float inv_std = static_cast<float>(1.0 / std::sqrt(variance + eps_));
    saved_inv_std_.view().data()[row] = inv_std;
    for (std::int64_t j = 0; j < width; ++j) {
      xhat[j] = static_cast<float>(x[j] - mean) * inv_std;
      y[j] = gamma[j] * xhat[j] + beta[j];
    }
  }
  return narrow ? detail::rounded(output, type) : std::move(output);
}

void LayerNorm::require_type(const Tensor& tensor, std::string_view what) const {
  if (tensor.dtype() != weight_.value.dtype())
    throw Error(fmt::format("{}: {} holds {} elements but the layer's parameters are {}", name(),
                            what, to_string(tensor.dtype()), to_string(weight_.value.dtype())));
}

Tensor LayerNorm::backward(const Tensor& grad_output) {
  if (saved_normalized_.rank() == 0)
    throw Error(
        fmt::format("{}: backward called without a forward before it (each forward "
                    "allows one backward)",
                    name()));
  const std::int64_t batch = saved_normalized_.dim(0);
  const std::int64_t width = features_;
  require_grad_output(grad_output, batch, width);
  require_value(weight_, {width});
  require_same_device(grad_output, "the output gradient", weight_.value, weight_.name);
  require_type(grad_output, "the output gradient");
  // 16-bit: dy and gamma widened to float32, the float32 arithmetic below on the saved
  // float32 xhat, dx rounded once and each parameter gradient added as
  // grad = round(widen(grad) + sum) (layer_norm.h).
  const DataType type = weight_.value.dtype();
  const bool narrow = type != DataType::kFloat32;
  if (narrow) detail::require_16bit_off_gpu(name(), grad_output);
  const Tensor wide_grad_output = narrow ? detail::widened(grad_output) : Tensor();
  const Tensor wide_weight = narrow ? detail::widened(weight_.value) : Tensor();
  const Tensor& dy_all = narrow ? wide_grad_output : grad_output;

  // (B, D)
  Tensor grad_input =
      Tensor::uninitialized({batch, width}, MemoryCategory::kActivations, grad_output.device());
  if (detail::on_gpu(grad_output.device())) {
    // dgamma and dbeta go straight into the gradients: one addition per element, as below.
    float* dgamma = weight_.frozen ? nullptr : grad_for_accumulation(weight_).view().data();
    float* dbeta = bias_.frozen ? nullptr : grad_for_accumulation(bias_).view().data();
    cuda::layer_norm_backward(grad_output.view().data(), saved_normalized_.view().data(),
                              saved_inv_std_.view().data(), weight_.value.view().data(), batch,
                              width, grad_input.view().data(), dgamma, dbeta);
    saved_normalized_ = Tensor();
    saved_inv_std_ = Tensor();
    return grad_input;
  }
  std::vector<float> dgamma(static_cast<std::size_t>(width), 0.0f);  // this batch's sums
  std::vector<float> dbeta(static_cast<std::size_t>(width), 0.0f);
  const float* gamma = (narrow ? wide_weight : weight_.value).view().data();
  for (std::int64_t row = 0; row < batch; ++row) {
    const float* dy = dy_all.view().data() + row * width;
    const float* xhat = saved_normalized_.view().data() + row * width;
    float* dx = grad_input.view().data() + row * width;
    // With g = dy * gamma: dx = inv_std * (g - mean(g) - xhat * mean(g * xhat)).
    double sum_g = 0.0;
    double sum_g_xhat = 0.0;
    for (std::int64_t j = 0; j < width; ++j) {
      const double g = static_cast<double>(dy[j]) * gamma[j];
      sum_g += g;
      sum_g_xhat += g * xhat[j];
      dgamma[j] += dy[j] * xhat[j];
      dbeta[j] += dy[j];
    }
    const double mean_g = sum_g / static_cast<double>(width);
    const double mean_g_xhat = sum_g_xhat / static_cast<double>(width);
    const double inv_std = saved_inv_std_.view().data()[row];
    for (std::int64_t j = 0; j < width; ++j) {
      const double g = static_cast<double>(dy[j]) * gamma[j];
      dx[j] = static_cast<float>(inv_std * (g - mean_g - xhat[j] * mean_g_xhat));
    }
  }
  // The emulated device's memory is the host's: accumulate_rounded's loop reads it.
  if (!weight_.frozen) {
    const TensorView grad = grad_for_accumulation(weight_).view();
    detail::accumulate_rounded(ConstTensorView(dgamma.data(), dgamma.size(), grad.device()), grad);
  }
  if (!bias_.frozen) {
    const TensorView grad = grad_for_accumulation(bias_).view();
    detail::accumulate_rounded(ConstTensorView(dbeta.data(), dbeta.size(), grad.device()), grad);
  }
  saved_normalized_ = Tensor();
  saved_inv_std_ = Tensor();
  return narrow ? detail::rounded(grad_input, type) : std::move(grad_input);
}

void LayerNorm::initialize(Parameter& parameter, CounterRng& /*rng*/) {
  DP_CHECK(&parameter == &weight_ || &parameter == &bias_, "{} is not a parameter of {}",
           parameter.name, name());
  // The identity transform at the start, as PyTorch: gamma = 1, beta = 0.
  parameter.value.fill(&parameter == &weight_ ? 1.0f : 0.0f);
}

void LayerNorm::discard_saved() {
  saved_normalized_ = Tensor();
  saved_inv_std_ = Tensor();
}

OpCost LayerNorm::forward_cost(std::int64_t batch) const {
  const double elements = static_cast<double>(batch) * static_cast<double>(features_);
  // Read x; write y and xhat; gamma and beta are small.
  return {.flops = 8 * elements,
          .bytes = sizeof(float) * (3 * elements + 2 * static_cast<double>(features_))};
}

OpCost LayerNorm::backward_cost(std::int64_t batch) const {
  const double elements = static_cast<double>(batch) * static_cast<double>(features_);
  // Read dy and xhat; write dx; read and write dgamma and dbeta.
  return {.flops = 10 * elements,
          .bytes = sizeof(float) * (3 * elements + 5 * static_cast<double>(features_))};
}

}  // namespace dp
