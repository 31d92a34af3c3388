#include "dp/layers/relu.h"

#include "cuda/device_ops.h"
#include "device_dispatch.h"
#include "dp/error.h"
#include "dp/float16.h"

namespace dp {
namespace {

// The 16-bit loops: y = x where widen(x) > 0, else +0, and dx = dy where widen(x) > 0, else
// +0: the float32 rule rounded, which is exact (a value or a zero, never a new number).
// Host memory or the emulated device's (host memory too).
template <typename T>
void relu_forward_16(const Tensor& input, Tensor& output) {
  const T* x = static_cast<const T*>(input.view().raw_data());
  T* y = static_cast<T*>(output.view().raw_data());
  for (std::size_t i = 0; i < input.size(); ++i) y[i] = to_float(x[i]) > 0.0f ? x[i] : T{};
}
template <typename T>
void relu_backward_16(const Tensor& input, const Tensor& grad_output, Tensor& grad_input) {
  const T* x = static_cast<const T*>(input.view().raw_data());
  const T* dy = static_cast<const T*>(grad_output.view().raw_data());
  T* dx = static_cast<T*>(grad_input.view().raw_data());
  for (std::size_t i = 0; i < grad_output.size(); ++i) dx[i] = to_float(x[i]) > 0.0f ? dy[i] : T{};
}

// Throws unless a 16-bit tensor lives where the host can read it (the GPU has no 16-bit
// ReLU kernel yet).
void require_16bit_on_host(const ReLU& layer, const Tensor& tensor) {
  if (detail::on_gpu(tensor.device()))
    throw Error(fmt::format(
        "{}: {} activations on a GPU: the 16-bit ReLU runs on the host and the emulated "
        "device only (train a 16-bit model with --device host or emulated)",
        layer.name(), to_string(tensor.dtype())));
}

}  // namespace

ReLU::ReLU(std::string name, std::int64_t features) : Layer(std::move(name)), features_(features) {
  if (features <= 0)
    throw Error(
        fmt::format("relu layer {} needs a positive width, got {}", this->name(), features));
}

Tensor ReLU::forward(const Tensor& input) {
  require_input(input, features_);
  // (B, features), where the input lives
  Tensor output = Tensor::uninitialized(input.shape(), input.dtype(), MemoryCategory::kActivations,
                                        input.device());
  if (input.dtype() != DataType::kFloat32) {
    require_16bit_on_host(*this, input);
    if (input.dtype() == DataType::kBFloat16) {
      relu_forward_16<BFloat16>(input, output);
    } else {
      relu_forward_16<Float16>(input, output);
    }
  } else if (detail::on_gpu(input.device())) {
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
  Tensor grad_input = Tensor::uninitialized(grad_output.shape(), grad_output.dtype(),
                                            MemoryCategory::kActivations, grad_output.device());
  if (grad_output.dtype() != saved_input_.dtype())
    throw Error(fmt::format("{}: the output gradient holds {} elements, its input held {}", name(),
                            to_string(grad_output.dtype()), to_string(saved_input_.dtype())));
  if (grad_output.dtype() != DataType::kFloat32) {
    require_16bit_on_host(*this, grad_output);
    if (grad_output.dtype() == DataType::kBFloat16) {
      relu_backward_16<BFloat16>(saved_input_, grad_output, grad_input);
    } else {
      relu_backward_16<Float16>(saved_input_, grad_output, grad_input);
    }
    saved_input_ = Tensor();
    return grad_input;
  }
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
