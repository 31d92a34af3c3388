#include "dp/layers/linear.h"

#include <algorithm>
#include <cmath>

#include "cuda/device_ops.h"
#include "device_dispatch.h"
#include "dp/error.h"
#include "dp/ops.h"

namespace dp {

Linear::Linear(std::string name, std::int64_t in_features, std::int64_t out_features)
    : Layer(std::move(name)), in_features_(in_features), out_features_(out_features) {
  if (in_features <= 0 || out_features <= 0)
    throw Error(fmt::format("linear layer {} needs positive sizes, got in = {}, out = {}",
                            this->name(), in_features, out_features));
  weight_ = Parameter::zeros(this->name() + ".weight", {out_features, in_features});
  bias_ = Parameter::zeros(this->name() + ".bias", {out_features});
}

Tensor Linear::forward(const Tensor& input) {
  require_input(input, in_features_);
  require_value(weight_, {out_features_, in_features_});
  require_value(bias_, {out_features_});
  require_same_device(input, "the input", weight_.value, weight_.name);
  require_same_device(bias_.value, bias_.name, weight_.value, weight_.name);
  const std::int64_t batch = input.dim(0);

  // out: (B, out). Start every row at the bias, so one gemm with beta = 1 adds x W^T.
  Tensor output =
      Tensor::uninitialized({batch, out_features_}, MemoryCategory::kActivations, input.device());
  if (!detail::on_gpu(input.device())) {
    const float* bias = bias_.value.view().data();
    for (std::int64_t row = 0; row < batch; ++row)
      std::copy(bias, bias + out_features_, output.view().data() + row * out_features_);
  } else {
    cuda::broadcast_rows(bias_.value.view().data(), output.view().data(), batch, out_features_);
  }
  // (B, out) += (B, in) (out, in)^T
  matmul_into(input, Transpose::kNo, weight_.value, Transpose::kYes, output, 1.0f, 1.0f);

  saved_input_ = input.clone(MemoryCategory::kActivations);
  return output;
}

Tensor Linear::backward(const Tensor& grad_output) {
  return backward_impl(grad_output, true);
}

Tensor Linear::backward_parameters_only(const Tensor& grad_output) {
  return backward_impl(grad_output, false);
}

Tensor Linear::backward_impl(const Tensor& grad_output, bool input_gradient) {
  if (saved_input_.rank() == 0)
    throw Error(
        fmt::format("{}: backward called without a forward before it (each forward "
                    "allows one backward)",
                    name()));
  const std::int64_t batch = saved_input_.dim(0);
  require_grad_output(grad_output, batch, out_features_);
  require_value(weight_, {out_features_, in_features_});
  require_same_device(grad_output, "the output gradient", weight_.value, weight_.name);

  if (!weight_.frozen) {
    // dW: (out, in) += (B, out)^T (B, in)
    matmul_into(grad_output, Transpose::kYes, saved_input_, Transpose::kNo,
                grad_for_accumulation(weight_), 1.0f, 1.0f);
  }
  if (!bias_.frozen && detail::on_gpu(grad_output.device())) {
    // The same sums, the rows added in groups in parallel (cuda/layer_kernels.cu states the
    // order): reproducible, within the float sum bound of the loop below.
    cuda::add_column_sums(grad_output.view().data(), batch, out_features_,
                          grad_for_accumulation(bias_).view().data());
  } else if (!bias_.frozen) {
    // db: (out) += sum over rows of dY. Sum the batch first, then add once, so the grad
    // receives exactly one addition per backward (as `grad += batch_grad` would).
    std::vector<float> row_sum(static_cast<std::size_t>(out_features_), 0.0f);
    for (std::int64_t row = 0; row < batch; ++row) {
      const float* dy_row = grad_output.view().data() + row * out_features_;
      for (std::int64_t j = 0; j < out_features_; ++j) row_sum[j] += dy_row[j];
    }
    float* db = grad_for_accumulation(bias_).view().data();
    for (std::int64_t j = 0; j < out_features_; ++j) db[j] += row_sum[j];
  }
  // dX: (B, in) = (B, out) (out, in), unless nobody reads it (the model's input).
  Tensor grad_input = input_gradient
                          ? matmul(grad_output, Transpose::kNo, weight_.value, Transpose::kNo)
                          : Tensor();
  saved_input_ = Tensor();  // the activation is no longer needed
  return grad_input;
}

void Linear::initialize(Parameter& parameter, CounterRng& rng) {
  DP_CHECK(&parameter == &weight_ || &parameter == &bias_, "{} is not a parameter of {}",
           parameter.name, name());
  // PyTorch's nn.Linear.reset_parameters: both drawn from U(-1/sqrt(in), 1/sqrt(in)).
  const float bound = 1.0f / std::sqrt(static_cast<float>(in_features_));
  for (float& value : parameter.value.span()) value = rng.uniform(-bound, bound);
}

void Linear::discard_saved() {
  saved_input_ = Tensor();
}

OpCost Linear::forward_cost(std::int64_t batch) const {
  const double b = static_cast<double>(batch);
  const double in = static_cast<double>(in_features_);
  const double out = static_cast<double>(out_features_);
  return {.flops = 2 * b * in * out + b * out,
          .bytes = sizeof(float) * (b * in + out * in + out + b * out)};
}

OpCost Linear::backward_cost(std::int64_t batch) const {
  const double b = static_cast<double>(batch);
  const double in = static_cast<double>(in_features_);
  const double out = static_cast<double>(out_features_);
  // dW and dX are each a (B, out, in) product; db is one addition per dY element.
  const double flops = 4 * b * in * out + b * out;
  // Read dY, X and W; read and write dW and db; write dX.
  const double bytes =
      sizeof(float) * (b * out + b * in + out * in + 2 * (out * in + out) + b * in);
  return {.flops = flops, .bytes = bytes};
}

OpCost Linear::backward_parameters_only_cost(std::int64_t batch) const {
  const double b = static_cast<double>(batch);
  const double in = static_cast<double>(in_features_);
  const double out = static_cast<double>(out_features_);
  // dW, a (B, out, in) product, and db, one addition per dY element.
  const double flops = 2 * b * in * out + b * out;
  // Read dY and X; read and write dW and db (W is not read: it only serves dX).
  const double bytes = sizeof(float) * (b * out + b * in + 2 * (out * in + out));
  return {.flops = flops, .bytes = bytes};
}

}  // namespace dp
