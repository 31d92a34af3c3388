#include "dp/layers/linear.h"

#include <algorithm>
#include <cmath>

#include "cuda/device_ops.h"
#include "device_dispatch.h"
#include "dp/error.h"
#include "dp/ops.h"
#include "precision.h"

namespace dp {

Linear::Linear(std::string name, std::int64_t in_features, std::int64_t out_features,
               DataType dtype)
    : Layer(std::move(name)), in_features_(in_features), out_features_(out_features) {
  if (in_features <= 0 || out_features <= 0)
    throw Error(fmt::format("linear layer {} needs positive sizes, got in = {}, out = {}",
                            this->name(), in_features, out_features));
  detail::check_tensor_type("Linear", dtype);
  weight_ = Parameter::zeros(this->name() + ".weight", {out_features, in_features}, dtype);
  bias_ = Parameter::zeros(this->name() + ".bias", {out_features}, dtype);
}

void Linear::require_input_type(const Tensor& tensor, std::string_view what) const {
  if (tensor.dtype() != weight_.value.dtype())
    throw Error(fmt::format(
        "{}: {} holds {} elements but the layer's parameters are {}; expected the same type "
        "(a 16-bit model's forward converts its input: Model::forward)",
        name(), what, to_string(tensor.dtype()), to_string(weight_.value.dtype())));
}

Tensor Linear::forward(const Tensor& input) {
  require_input(input, in_features_);
  require_value(weight_, {out_features_, in_features_});
  require_value(bias_, {out_features_});
  require_same_device(input, "the input", weight_.value, weight_.name);
  require_same_device(bias_.value, bias_.name, weight_.value, weight_.name);
  require_input_type(input, "the input");
  const std::int64_t batch = input.dim(0);
  // 16-bit: the operands widened to float32 exactly, the float32 arithmetic below, the
  // output rounded once (linear.h).
  const DataType type = weight_.value.dtype();
  const bool narrow = type != DataType::kFloat32;
  const Tensor wide_input = narrow ? detail::widened(input) : Tensor();
  const Tensor wide_weight = narrow ? detail::widened(weight_.value) : Tensor();
  const Tensor wide_bias = narrow ? detail::widened(bias_.value) : Tensor();
  const Tensor& x = narrow ? wide_input : input;
  const Tensor& w = narrow ? wide_weight : weight_.value;
  const Tensor& b = narrow ? wide_bias : bias_.value;

  // out: (B, out). Start every row at the bias, so one gemm with beta = 1 adds x W^T.
  Tensor output =
      Tensor::uninitialized({batch, out_features_}, MemoryCategory::kActivations, input.device());
  if (!detail::on_gpu(input.device())) {
    const float* bias = b.view().data();
    for (std::int64_t row = 0; row < batch; ++row)
      std::copy(bias, bias + out_features_, output.view().data() + row * out_features_);
  } else {
    cuda::broadcast_rows(b.view().data(), output.view().data(), batch, out_features_);
  }
  // (B, out) += (B, in) (out, in)^T
  matmul_into(x, Transpose::kNo, w, Transpose::kYes, output, 1.0f, 1.0f);

  saved_input_ = input.clone(MemoryCategory::kActivations);  // in the input's type
  return narrow ? detail::rounded(output, type) : std::move(output);
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
  require_input_type(grad_output, "the output gradient");
  // 16-bit: dY, X and W widened to float32, the float32 products, each gradient added as
  // grad = round(widen(grad) + contribution) and dX rounded once (linear.h).
  const DataType type = weight_.value.dtype();
  const bool narrow = type != DataType::kFloat32;
  const Tensor wide_grad_output = narrow ? detail::widened(grad_output) : Tensor();
  const Tensor& dy = narrow ? wide_grad_output : grad_output;

  if (!weight_.frozen && !narrow) {
    // dW: (out, in) += (B, out)^T (B, in)
    matmul_into(dy, Transpose::kYes, saved_input_, Transpose::kNo, grad_for_accumulation(weight_),
                1.0f, 1.0f);
  } else if (!weight_.frozen) {
    const Tensor x = detail::widened(saved_input_);
    Tensor contribution = Tensor::uninitialized({out_features_, in_features_},
                                                MemoryCategory::kActivations, dy.device());
    matmul_into(dy, Transpose::kYes, x, Transpose::kNo, contribution, 1.0f, 0.0f);
    detail::accumulate_rounded(contribution.view(), grad_for_accumulation(weight_).view());
  }
  if (!bias_.frozen && detail::on_gpu(dy.device())) {
    // The same sums, the rows added in groups in parallel (cuda/layer_kernels.cu states the
    // order): reproducible, within the float sum bound of the loop below.
    if (!narrow) {
      cuda::add_column_sums(dy.view().data(), batch, out_features_,
                            grad_for_accumulation(bias_).view().data());
    } else {
      Tensor sums({out_features_}, MemoryCategory::kActivations, dy.device());
      cuda::add_column_sums(dy.view().data(), batch, out_features_, sums.view().data());
      detail::accumulate_rounded(sums.view(), grad_for_accumulation(bias_).view());
    }
  } else if (!bias_.frozen) {
    // db: (out) += sum over rows of dY. Sum the batch first, then add once, so the grad
    // receives exactly one addition per backward (as `grad += batch_grad` would).
    std::vector<float> row_sum(static_cast<std::size_t>(out_features_), 0.0f);
    for (std::int64_t row = 0; row < batch; ++row) {
      const float* dy_row = dy.view().data() + row * out_features_;
      for (std::int64_t j = 0; j < out_features_; ++j) row_sum[j] += dy_row[j];
    }
    if (!narrow) {
      float* db = grad_for_accumulation(bias_).view().data();
      for (std::int64_t j = 0; j < out_features_; ++j) db[j] += row_sum[j];
    } else {
      // The emulated device's memory is the host's: the loop of accumulate_rounded reads it.
      const TensorView db = grad_for_accumulation(bias_).view();
      detail::accumulate_rounded(ConstTensorView(row_sum.data(), row_sum.size(), db.device()), db);
    }
  }
  // dX: (B, in) = (B, out) (out, in), unless nobody reads it (the model's input).
  Tensor grad_input;
  if (input_gradient && !narrow) {
    grad_input = matmul(dy, Transpose::kNo, weight_.value, Transpose::kNo);
  } else if (input_gradient) {
    grad_input = detail::rounded(
        matmul(dy, Transpose::kNo, detail::widened(weight_.value), Transpose::kNo), type);
  }
  saved_input_ = Tensor();  // the activation is no longer needed
  return grad_input;
}

void Linear::initialize(Parameter& parameter, CounterRng& rng) {
  DP_CHECK(&parameter == &weight_ || &parameter == &bias_, "{} is not a parameter of {}",
           parameter.name, name());
  // PyTorch's nn.Linear.reset_parameters: both drawn from U(-1/sqrt(in), 1/sqrt(in)).
  const float bound = 1.0f / std::sqrt(static_cast<float>(in_features_));
  if (parameter.value.dtype() == DataType::kFloat32) {
    for (float& value : parameter.value.span()) value = rng.uniform(-bound, bound);
    return;
  }
  // 16-bit: the float32 draws rounded, so a 16-bit model starts from its float32 twin rounded.
  Tensor drawn(parameter.value.shape(), MemoryCategory::kOther);
  for (float& value : drawn.span()) value = rng.uniform(-bound, bound);
  detail::convert_uncharged(drawn.view(), parameter.value.view());
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
