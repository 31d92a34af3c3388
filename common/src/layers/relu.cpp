#include "dp/layers/relu.h"

#include "cuda/device_ops.h"
#include "device_dispatch.h"
#include "dp/error.h"

namespace dp {

ReLU::ReLU(std::string name, std::int64_t features) : Layer(std::move(name)), features_(features) {
  if (features <= 0)
    throw Error(
        fmt::format("relu layer {} needs a positive width, got {}", this->name(), features));
}

Tensor ReLU::forward(const Tensor& input) {
  require_input(input, features_);
  // (B, features), where the input lives
  Tensor output =
      Tensor::uninitialized(input.shape(), MemoryCategory::kActivations, input.device());
  if (detail::on_gpu(input.device())) {
    cuda::relu_forward(input.view().data(), output.view().data(), input.size());
  } else {
    const float* x = input.view().data();
    float* y = output.view().data();
    for (std::size_t i = 0; i < input.size(); ++i) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
  }
  saved_input_ = input.clone(MemoryCategory::kActivations);
  return output;
}

Tensor ReLU::backward(const Tensor& grad_output) {
  if (saved_input_.rank() == 0)
    throw Error(
        fmt::format("{}: backward called without a forward before it (each forward "
                    "allows one backward)",
                    name()));
  require_grad_output(grad_output, saved_input_.dim(0), features_);
  require_same_device(grad_output, "the output gradient", saved_input_, "the saved input");
  // (B, features)
  Tensor grad_input = Tensor::uninitialized(grad_output.shape(), MemoryCategory::kActivations,
                                            grad_output.device());
  if (detail::on_gpu(grad_output.device())) {
    cuda::relu_backward(saved_input_.view().data(), grad_output.view().data(),
                        grad_input.view().data(), grad_output.size());
    saved_input_ = Tensor();
    return grad_input;
  }
  const float* x = saved_input_.view().data();
  const float* dy = grad_output.view().data();
  float* dx = grad_input.view().data();
  // Both loads come first, so the select needs no branch and the loop vectorizes; with the
  // load inside the condition it was a branch per element, mispredicted half the time
  // (a fifth of a training step of the default model).
  for (std::size_t i = 0; i < grad_output.size(); ++i) {
    const float input = x[i];
    const float upstream = dy[i];
    dx[i] = input > 0.0f ? upstream : 0.0f;
  }
  saved_input_ = Tensor();
  return grad_input;
}

void ReLU::discard_saved() {
  saved_input_ = Tensor();
}

OpCost ReLU::forward_cost(std::int64_t batch) const {
  const double elements = static_cast<double>(batch) * static_cast<double>(features_);
  return {.flops = elements, .bytes = sizeof(float) * 2 * elements};
}

OpCost ReLU::backward_cost(std::int64_t batch) const {
  const double elements = static_cast<double>(batch) * static_cast<double>(features_);
  return {.flops = elements, .bytes = sizeof(float) * 3 * elements};
}

}  // namespace dp
