#include "dp/layer.h"

#include <string>
#include <utility>
#include <vector>

#include "dp/error.h"
#include "dp/rng.h"

namespace dp {

Parameter Parameter::zeros(std::string name, const std::vector<std::int64_t>& shape,
                           DataType dtype) {
  Parameter parameter;
  parameter.name = std::move(name);
  parameter.value = Tensor(shape, dtype, MemoryCategory::kParameters);
  parameter.grad = Tensor(shape, dtype, MemoryCategory::kGradients);
  return parameter;
}

Layer::~Layer() = default;

std::vector<Parameter*> Layer::parameters() {
  return {};
}

Tensor Layer::backward_parameters_only(const Tensor& grad_output) {
  (void)backward(grad_output);
  return Tensor();
}

void Layer::discard_saved() {}

OpCost Layer::backward_parameters_only_cost(std::int64_t batch) const {
  return backward_cost(batch);
}

void Layer::initialize(Parameter& parameter, CounterRng& /*rng*/) {
  throw Error(fmt::format("layer {} ({}) has no initialisation for parameter {}", name(), kind(),
                          parameter.name));
}

void Layer::require_input(const Tensor& input, std::int64_t features) const {
  if (input.rank() != 2 || input.dim(1) != features)
    throw Error(fmt::format("{} expects input of shape (B, {}), got {}", name(), features,
                            input.shape_string()));
}

void Layer::require_grad_output(const Tensor& grad_output, std::int64_t batch,
                                std::int64_t features) const {
  if (grad_output.rank() != 2 || grad_output.dim(0) != batch || grad_output.dim(1) != features)
    throw Error(
        fmt::format("{} backward expects a gradient of shape ({}, {}) like its last "
                    "output, got {}",
                    name(), batch, features, grad_output.shape_string()));
}

void Layer::require_same_device(const Tensor& tensor, std::string_view what,
                                const Tensor& reference, std::string_view reference_what) const {
  if (tensor.device() != reference.device())
    throw Error(fmt::format(
        "{}: {} lives on {} but {} lives on {}; a layer's input, parameters and gradients "
        "must live on one device (move the model with Model::to, a tensor with Tensor::to)",
        name(), what, to_string(tensor.device()), reference_what, to_string(reference.device())));
}

void Layer::require_value(const Parameter& parameter, const std::vector<std::int64_t>& shape) {
  if (parameter.value.shape() != shape)
    throw Error(
        fmt::format("parameter {} holds a value of shape {}, expected {} (a hook that "
                    "frees it must gather it again before the layer runs)",
                    parameter.name, parameter.value.shape_string(), shape_to_string(shape)));
}

Tensor& Layer::grad_for_accumulation(Parameter& parameter) {
  if (parameter.grad.empty() && !parameter.value.empty())
    parameter.grad = Tensor(parameter.value.shape(), parameter.value.dtype(),
                            MemoryCategory::kGradients, parameter.value.device());
  if (parameter.grad.device() != parameter.value.device())
    throw Error(fmt::format(
        "the gradient of {} lives on {} but its value on {}; move both "
        "(Model::to moves every parameter's value and gradient)",
        parameter.name, to_string(parameter.grad.device()), to_string(parameter.value.device())));
  DP_CHECK(parameter.grad.shape() == parameter.value.shape(),
           "gradient of {} has shape {} but its value {}", parameter.name,
           parameter.grad.shape_string(), parameter.value.shape_string());
  return parameter.grad;
}

}  // namespace dp
