#include "dp/layers/gelu.h"

#include <cmath>
#include <numbers>

#include "cuda/device_ops.h"
#include "device_dispatch.h"
#include "dp/error.h"
#include "precision.h"

namespace dp {
namespace {

// sqrt(2 / pi) and the cubic coefficient of the tanh approximation.
constexpr float kSqrtTwoOverPi = std::numbers::sqrt2_v<float> * std::numbers::inv_sqrtpi_v<float>;
constexpr float kCubic = 0.044715f;

// exp(-2u) for the GELU's u(x): s = sigmoid(2u) = (1 + tanh(u)) / 2 = 1 / (1 + exp(-2u)).
inline float exp_of_minus_two_u(float x) {
  return std::exp(-2.0f * kSqrtTwoOverPi * (x + kCubic * x * x * x));
}

}  // namespace

GELU::GELU(std::string name, std::int64_t features) : Layer(std::move(name)), features_(features) {
  if (features <= 0)
    throw Error(
        fmt::format("gelu layer {} needs a positive width, got {}", this->name(), features));
}

Tensor GELU::forward(const Tensor& input) {
  require_input(input, features_);
  // 16-bit: x widened to float32 exactly, the float32 formulas below, y rounded once (gelu.h).
  const DataType type = input.dtype();
  const bool narrow = type != DataType::kFloat32;
  if (narrow) detail::require_16bit_off_gpu(name(), input);
  const Tensor wide_input = narrow ? detail::widened(input) : Tensor();
  // (B, features), where the input lives
  Tensor output =
      Tensor::uninitialized(input.shape(), MemoryCategory::kActivations, input.device());
  if (detail::on_gpu(input.device())) {
    cuda::gelu_forward(input.view().data(), output.view().data(), input.size());
  } else {
    const float* x = (narrow ? wide_input : input).view().data();
    float* y = output.view().data();
    // Two passes: the exps (calls into libm), then the rest, which the compiler vectorises
    // (a division per element, the slow part, four or eight at a time).
    for (std::size_t i = 0; i < input.size(); ++i) y[i] = exp_of_minus_two_u(x[i]);
    for (std::size_t i = 0; i < input.size(); ++i) y[i] = x[i] * (1.0f / (1.0f + y[i]));
  }
  saved_input_ = input.clone(MemoryCategory::kActivations);  // in the input's type
  return narrow ? detail::rounded(output, type) : std::move(output);
}

Tensor GELU::backward(const Tensor& grad_output) {
  if (saved_input_.rank() == 0)
    throw Error(
        fmt::format("{}: backward called without a forward before it (each forward "
                    "allows one backward)",
                    name()));
  require_grad_output(grad_output, saved_input_.dim(0), features_);
  require_same_device(grad_output, "the output gradient", saved_input_, "the saved input");
  if (grad_output.dtype() != saved_input_.dtype())
    throw Error(fmt::format("{}: the output gradient holds {} elements, its input held {}", name(),
                            to_string(grad_output.dtype()), to_string(saved_input_.dtype())));
  // 16-bit: x and dy widened to float32 exactly, the float32 formulas below, dx rounded once.
  const DataType type = grad_output.dtype();
  const bool narrow = type != DataType::kFloat32;
  if (narrow) detail::require_16bit_off_gpu(name(), grad_output);
  const Tensor wide_input = narrow ? detail::widened(saved_input_) : Tensor();
  const Tensor wide_grad_output = narrow ? detail::widened(grad_output) : Tensor();
  // (B, features)
  Tensor grad_input = Tensor::uninitialized(grad_output.shape(), MemoryCategory::kActivations,
                                            grad_output.device());
  if (detail::on_gpu(grad_output.device())) {
    cuda::gelu_backward(saved_input_.view().data(), grad_output.view().data(),
                        grad_input.view().data(), grad_output.size());
    saved_input_ = Tensor();
    return grad_input;
  }
  const float* x = (narrow ? wide_input : saved_input_).view().data();
  const float* dy = (narrow ? wide_grad_output : grad_output).view().data();
  float* dx = grad_input.view().data();
  // Two passes, as in forward: the exps, then the vectorised rest.
  for (std::size_t i = 0; i < grad_output.size(); ++i) dx[i] = exp_of_minus_two_u(x[i]);
  for (std::size_t i = 0; i < grad_output.size(); ++i) {
    const float s = 1.0f / (1.0f + dx[i]);
    const float du_dx = kSqrtTwoOverPi * (1.0f + 3.0f * kCubic * x[i] * x[i]);
    const float dy_dx = s + 2.0f * x[i] * s * (1.0f - s) * du_dx;
    dx[i] = dy[i] * dy_dx;
  }
  saved_input_ = Tensor();
  return narrow ? detail::rounded(grad_input, type) : std::move(grad_input);
}

void GELU::discard_saved() {
  saved_input_ = Tensor();
}

OpCost GELU::forward_cost(std::int64_t batch) const {
  const double elements = static_cast<double>(batch) * static_cast<double>(features_);
  return {.flops = 10 * elements, .bytes = sizeof(float) * 2 * elements};
}

OpCost GELU::backward_cost(std::int64_t batch) const {
  const double elements = static_cast<double>(batch) * static_cast<double>(features_);
  return {.flops = 15 * elements, .bytes = sizeof(float) * 3 * elements};
}

}  // namespace dp
