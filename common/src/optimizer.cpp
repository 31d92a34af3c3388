#include "dp/optimizer.h"

#include <algorithm>
#include <cmath>

#include "cuda/device_ops.h"
#include "device_dispatch.h"
#include "dp/clock.h"
#include "dp/error.h"
#include "dp/model.h"
#include "precision.h"

namespace dp {

Optimizer::~Optimizer() = default;

void Optimizer::begin_step() {
  ++step_count_;
}

void Optimizer::step(Model& model) {
  std::size_t elements = 0;
  for (const Parameter* parameter : model.parameters())
    if (!parameter->frozen) elements += parameter->value.size();
  timed_compute("optimizer", name(), update_cost(elements), [&] {
    begin_step();
    for (Parameter* parameter : model.parameters()) {
      if (parameter->frozen) continue;
      update(parameter->offset, parameter->value.view(), parameter->grad.view());
    }
  });
}

OpCost Optimizer::update_cost(std::size_t elements) const {
  const double n = static_cast<double>(elements);
  return {2 * n, 12 * n};
}

OpCost Sgd::update_cost(std::size_t elements) const {
  const double n = static_cast<double>(elements);
  return options_.momentum != 0 ? OpCost{4 * n, 20 * n} : OpCost{2 * n, 12 * n};
}

OpCost AdamW::update_cost(std::size_t elements) const {
  const double n = static_cast<double>(elements);
  return {14 * n, 28 * n};
}

void Optimizer::set_step_count(std::int64_t steps) {
  if (steps < 0) throw Error(fmt::format("step count must be non-negative, got {}", steps));
  step_count_ = steps;
}

void Optimizer::update(std::size_t offset, TensorView params, ConstTensorView grads) {
  if (params.device() != device_ || grads.device() != device_)
    throw Error(fmt::format(
        "{} update of parameters in {} memory with gradients in {} memory: expected both "
        "where the optimizer's state lives ({} memory)",
        name(), to_string(params.device()), to_string(grads.device()), to_string(device_)));
  if (device_ == Device::kHost) return update(offset, params.host_span(), grads.host_span());
  check_update(offset, params.size(), grads.size());
  update_on_device(offset, params.data(), grads.data(), params.size());
}

void Optimizer::update_on_device(std::size_t /*offset*/, float* /*params*/, const float* /*grads*/,
                                 std::size_t /*n*/) {
  throw Error(fmt::format("{} has no update for {} memory", name(), to_string(device_)));
}

void Optimizer::require_host_state() const {
  if (device_ != Device::kHost)
    throw Error(fmt::format(
        "{} update on host spans: the optimizer's state lives in {} memory; expected views "
        "on that device (update(offset, TensorView, ConstTensorView))",
        name(), to_string(device_)));
}

void Optimizer::check_update(std::size_t offset, std::span<float> params,
                             std::span<const float> grads) const {
  check_update(offset, params.size(), grads.size());
}

void Optimizer::check_update(std::size_t offset, std::size_t params, std::size_t grads) const {
  if (params != grads)
    throw Error(fmt::format("{} update got {} parameters but {} gradients", name(), params, grads));
  if (offset > state_size_ || params > state_size_ - offset)
    throw Error(fmt::format("{} update of elements [{}, {}) is outside its state of {} elements",
                            name(), offset, offset + params, state_size_));
  if (step_count_ == 0)
    throw Error(fmt::format("{} update before any step: call begin_step() first", name()));
}

// --- SGD ---------------------------------------------------------------------------------

Sgd::Sgd(std::size_t state_size, SgdOptions options, Device device)
    : Optimizer(state_size, device), options_(options) {
  // Finite and in range: an infinite rate or a momentum of 1 or more only makes NaNs.
  if (!(options.lr >= 0.0f && std::isfinite(options.lr)) ||
      !(options.momentum >= 0.0f && options.momentum < 1.0f) ||
      !(options.weight_decay >= 0.0f && std::isfinite(options.weight_decay)))
    throw Error(fmt::format(
        "sgd needs finite lr >= 0, momentum in [0, 1) and finite weight_decay >= 0, got {}, {}, "
        "{}",
        options.lr, options.momentum, options.weight_decay));
  // A zero buffer makes the first step buf = 0 * momentum + g = g, exactly as PyTorch.
  if (options.momentum != 0.0f)
    momentum_buffer_ =
        Tensor({static_cast<std::int64_t>(state_size)}, MemoryCategory::kOptimizerState, device);
}

void Sgd::update(std::size_t offset, std::span<float> params, std::span<const float> grads) {
  require_host_state();
  check_update(offset, params, grads);
  update_in_host_memory(offset, params.data(), grads.data(), params.size());
}

void Sgd::update_in_host_memory(std::size_t offset, float* p, const float* grad, std::size_t n) {
  const float lr = options_.lr;
  const float momentum = options_.momentum;
  const float weight_decay = options_.weight_decay;
  float* buffer = momentum != 0.0f ? momentum_buffer_.view().data() + offset : nullptr;
  // One branch-free loop per case, so that each vectorizes; the arithmetic per element is
  // exactly that of the general formula.
  if (buffer == nullptr && weight_decay == 0.0f) {
    for (std::size_t i = 0; i < n; ++i) p[i] -= lr * grad[i];
  } else if (buffer == nullptr) {
    for (std::size_t i = 0; i < n; ++i) p[i] -= lr * (grad[i] + weight_decay * p[i]);
  } else {
    for (std::size_t i = 0; i < n; ++i) {
      const float g = weight_decay != 0.0f ? grad[i] + weight_decay * p[i] : grad[i];
      buffer[i] = momentum * buffer[i] + g;
      p[i] -= lr * buffer[i];
    }
  }
}

void Sgd::update_on_device(std::size_t offset, float* params, const float* grads, std::size_t n) {
  // The emulated device keeps its tensors in host memory: the host loop is its kernel.
  if (!detail::on_gpu(device())) return update_in_host_memory(offset, params, grads, n);
  float* buffer = options_.momentum != 0.0f ? momentum_buffer_.view().data() + offset : nullptr;
  cuda::sgd_update(params, grads, buffer, n, options_.lr, options_.momentum, options_.weight_decay);
}

std::vector<OptimizerState> Sgd::state() {
  if (momentum_buffer_.empty()) return {};
  return {{"momentum_buffer", &momentum_buffer_}};
}

// --- AdamW -------------------------------------------------------------------------------

AdamW::AdamW(std::size_t state_size, AdamWOptions options, Device device)
    : Optimizer(state_size, device),
      options_(options),
      exp_avg_({static_cast<std::int64_t>(state_size)}, MemoryCategory::kOptimizerState, device),
      exp_avg_sq_({static_cast<std::int64_t>(state_size)}, MemoryCategory::kOptimizerState,
                  device) {
  const bool betas_ok = options.beta1 >= 0.0f && options.beta1 < 1.0f && options.beta2 >= 0.0f &&
                        options.beta2 < 1.0f;
  if (!betas_ok || !(options.eps > 0.0f && std::isfinite(options.eps)) ||
      !(options.lr >= 0.0f && std::isfinite(options.lr)) ||
      !(options.weight_decay >= 0.0f && std::isfinite(options.weight_decay)))
    throw Error(
        fmt::format("adamw needs betas in [0, 1), finite eps > 0, finite lr >= 0 and finite "
                    "weight_decay >= 0, got beta1 = {}, beta2 = {}, eps = {}, lr = {}, "
                    "weight_decay = {}",
                    options.beta1, options.beta2, options.eps, options.lr, options.weight_decay));
}

AdamW::StepConstants AdamW::step_constants() const {
  const float lr = options_.lr;
  const double t = static_cast<double>(step_count());
  // Bias correction, in PyTorch's arrangement: step_size = lr / (1 - beta1^t) and
  // denominator sqrt(v) / sqrt(1 - beta2^t) + eps.
  return {
      .step_size = static_cast<float>(lr / (1.0 - std::pow(double{options_.beta1}, t))),
      .sqrt_correction2 = static_cast<float>(std::sqrt(1.0 - std::pow(double{options_.beta2}, t))),
      .decay = 1.0f - lr * options_.weight_decay,  // decoupled from the gradient
  };
}

void AdamW::update_on_device(std::size_t offset, float* params, const float* grads, std::size_t n) {
  if (!detail::on_gpu(device())) return update_in_host_memory(offset, params, grads, n);
  const StepConstants constants = step_constants();
  cuda::adamw_update(params, grads, exp_avg_.view().data() + offset,
                     exp_avg_sq_.view().data() + offset, n,
                     {.beta1 = options_.beta1,
                      .beta2 = options_.beta2,
                      .eps = options_.eps,
                      .step_size = constants.step_size,
                      .sqrt_correction2 = constants.sqrt_correction2,
                      .decay = constants.decay});
}

void AdamW::update(std::size_t offset, std::span<float> params, std::span<const float> grads) {
  require_host_state();
  check_update(offset, params, grads);
  update_in_host_memory(offset, params.data(), grads.data(), params.size());
}

void AdamW::update_in_host_memory(std::size_t offset, float* params, const float* grads,
                                  std::size_t n) {
  const float beta1 = options_.beta1;
  const float beta2 = options_.beta2;
  const auto [step_size, sqrt_correction2, decay] = step_constants();
  float* m = exp_avg_.view().data() + offset;
  float* v = exp_avg_sq_.view().data() + offset;
  for (std::size_t i = 0; i < n; ++i) {
    const float g = grads[i];
    params[i] *= decay;
    m[i] = beta1 * m[i] + (1.0f - beta1) * g;
    v[i] = beta2 * v[i] + (1.0f - beta2) * g * g;
    const float denominator = std::sqrt(v[i]) / sqrt_correction2 + options_.eps;
    params[i] -= step_size * m[i] / denominator;
  }
}

std::vector<OptimizerState> AdamW::state() {
  return {{"exp_avg", &exp_avg_}, {"exp_avg_sq", &exp_avg_sq_}};
}

// --- mixed precision ---------------------------------------------------------------------

namespace {
constexpr std::size_t kWorkspaceElements = std::size_t{1} << 16;
}  // namespace

MixedPrecisionOptimizer::MixedPrecisionOptimizer(std::unique_ptr<Optimizer> inner,
                                                 DataType parameter_type)
    : Optimizer(inner != nullptr ? inner->state_size() : 0,
                inner != nullptr ? inner->device() : Device::kHost),
      inner_(std::move(inner)),
      type_(parameter_type) {
  if (inner_ == nullptr) throw Error("MixedPrecisionOptimizer needs an inner optimizer, got none");
  if (type_ != DataType::kBFloat16 && type_ != DataType::kFloat16)
    throw Error(fmt::format(
        "MixedPrecisionOptimizer keeps float32 masters of bfloat16 or float16 parameters, got "
        "{} (a float32 model needs no master weights: use the optimizer itself)",
        to_string(type_)));
  const auto size = static_cast<std::int64_t>(state_size());
  master_ = Tensor({size}, DataType::kFloat32, MemoryCategory::kOptimizerState, device());
  workspace_ = Tensor({std::min<std::int64_t>(size, kWorkspaceElements)}, DataType::kFloat32,
                      MemoryCategory::kOther, device());
}

void MixedPrecisionOptimizer::begin_step() {
  Optimizer::begin_step();
  inner_->begin_step();
}

void MixedPrecisionOptimizer::load_master_weights(std::size_t offset, ConstTensorView params) {
  if (params.dtype() != type_ || params.device() != device())
    throw Error(fmt::format(
        "{} master weights: loading {} parameters in {} memory, expected {} in {} memory", name(),
        to_string(params.dtype()), to_string(params.device()), to_string(type_),
        to_string(device())));
  if (offset > state_size() || params.size() > state_size() - offset)
    throw Error(fmt::format("{} master weights: elements [{}, {}) are outside its {} elements",
                            name(), offset, offset + params.size(), state_size()));
  detail::convert_uncharged(params, master_.view(offset, params.size()));
}

void MixedPrecisionOptimizer::load_master_weights(const Model& model) {
  for (const Parameter* parameter : model.parameters())
    load_master_weights(parameter->offset, parameter->value.view());
}

void MixedPrecisionOptimizer::set_gradient_scale(float factor) {
  if (!(factor > 0.0f && std::isfinite(factor)))
    throw Error(fmt::format("gradient scale must be finite and positive, got {}", factor));
  gradient_scale_ = factor;
}

void MixedPrecisionOptimizer::update(std::size_t /*offset*/, std::span<float> /*params*/,
                                     std::span<const float> /*grads*/) {
  throw Error(fmt::format(
      "mixed-precision {} update on float32 spans: its parameters and gradients are {} views "
      "(update(offset, TensorView, ConstTensorView)); a float32 model needs no master weights",
      name(), to_string(type_)));
}

void MixedPrecisionOptimizer::update(std::size_t offset, TensorView params, ConstTensorView grads) {
  if (params.dtype() != type_ || grads.dtype() != type_)
    throw Error(fmt::format(
        "mixed-precision {} update of {} parameters with {} gradients: expected both {}", name(),
        to_string(params.dtype()), to_string(grads.dtype()), to_string(type_)));
  if (params.device() != device() || grads.device() != device())
    throw Error(fmt::format(
        "mixed-precision {} update of parameters in {} memory with gradients in {} memory: "
        "expected both where the master weights live ({} memory)",
        name(), to_string(params.device()), to_string(grads.device()), to_string(device())));
  check_update(offset, params.size(), grads.size());
  // In chunks through the workspace: widen (and unscale), the inner float32 update of the
  // masters, then round the masters into the parameters.
  for (std::size_t done = 0; done < params.size();) {
    const std::size_t n = std::min(workspace_.size(), params.size() - done);
    const TensorView gradient = workspace_.view(0, n);
    detail::convert_uncharged(grads.slice(done, n), gradient);
    if (gradient_scale_ != 1.0f) detail::scale_uncharged(gradient, gradient_scale_);
    const TensorView master = master_.view(offset + done, n);
    inner_->update(offset + done, master, gradient);
    detail::convert_uncharged(master, params.slice(done, n));
    done += n;
  }
}

std::vector<OptimizerState> MixedPrecisionOptimizer::state() {
  std::vector<OptimizerState> states = {{"master_weights", &master_}};
  for (const OptimizerState& inner_state : inner_->state()) states.push_back(inner_state);
  return states;
}

OpCost MixedPrecisionOptimizer::update_cost(std::size_t elements) const {
  OpCost cost = inner_->update_cost(elements);
  cost += OpCost{2 * static_cast<double>(elements), 6 * static_cast<double>(elements)};
  return cost;
}

std::unique_ptr<Optimizer> make_optimizer(std::string_view name, std::size_t state_size, float lr,
                                          float momentum, float weight_decay, Device device) {
  if (name == "sgd")
    return std::make_unique<Sgd>(
        state_size, SgdOptions{.lr = lr, .momentum = momentum, .weight_decay = weight_decay},
        device);
  if (name == "adamw")
    return std::make_unique<AdamW>(state_size, AdamWOptions{.lr = lr, .weight_decay = weight_decay},
                                   device);
  throw Error(fmt::format("unknown optimizer \"{}\"; expected \"sgd\" or \"adamw\"", name));
}

}  // namespace dp
