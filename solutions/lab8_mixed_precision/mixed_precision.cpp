// mixed_precision.cpp: lab 8, mixed precision and ZeRO. Your part: the members of each
// State, the bodies below and the design question's formulas.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "dp/error.h"
#include "dp/memory.h"
#include "dp/tensor_ops.h"
#include "lab8.h"

namespace dp::lab8 {

// BEGIN SOLUTION
// SKELETON: // Your helpers, if any.
namespace {

/// True for the two 16-bit types mixed precision trains in.
bool is_16_bit(DataType type) {
  return type == DataType::kBFloat16 || type == DataType::kFloat16;
}

/// One step of `inner` on the float32 `masters` from the float32 gradient `gradient`, then the
/// masters rounded into the 16-bit `params`: the part both optimizers of this lab share.
void step_masters(Optimizer& inner, TensorView masters, ConstTensorView gradient,
                  TensorView params) {
  inner.begin_step();
  inner.update(0, masters, gradient);
  convert(ConstTensorView(masters), params);
}

}  // namespace
// END SOLUTION

/// Everything a LossScaler keeps.
struct LossScaler::State {
  // BEGIN SOLUTION
  // SKELETON: // Your members.
  ScalerSettings settings;
  float scale = 0;
  int tracker = 0;
  std::int64_t skipped = 0;
  // END SOLUTION
};

LossScaler::LossScaler(ScalerSettings settings) {
  // BEGIN SOLUTION
  // SKELETON: (void)settings;
  // SKELETON: throw NotImplemented("lab8::LossScaler::LossScaler");
  if (!std::isfinite(settings.initial_scale) || !(settings.initial_scale > 0))
    throw Error(fmt::format("LossScaler: initial scale {} is not finite and positive",
                            settings.initial_scale));
  if (!std::isfinite(settings.growth_factor) || !(settings.growth_factor > 1))
    throw Error(fmt::format("LossScaler: growth factor {} is not finite and above 1",
                            settings.growth_factor));
  if (!(settings.backoff_factor > 0 && settings.backoff_factor < 1))
    throw Error(
        fmt::format("LossScaler: backoff factor {} is not in (0, 1)", settings.backoff_factor));
  if (settings.growth_interval < 1)
    throw Error(fmt::format("LossScaler: growth interval {} is below 1", settings.growth_interval));
  state_ = std::make_unique<State>();
  state_->settings = settings;
  state_->scale = settings.initial_scale;
  // END SOLUTION
}

LossScaler::~LossScaler() = default;

float LossScaler::scale() const {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab8::LossScaler::scale");
  return state_->scale;
  // END SOLUTION
}

float LossScaler::inverse_scale() const {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab8::LossScaler::inverse_scale");
  return static_cast<float>(1.0 / static_cast<double>(state_->scale));
  // END SOLUTION
}

int LossScaler::growth_tracker() const {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab8::LossScaler::growth_tracker");
  return state_->tracker;
  // END SOLUTION
}

std::int64_t LossScaler::skipped_steps() const {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab8::LossScaler::skipped_steps");
  return state_->skipped;
  // END SOLUTION
}

bool LossScaler::overflow_on_any_rank(Communicator& comm,
                                      std::span<const ConstTensorView> gradients, Device device) {
  // BEGIN SOLUTION
  // SKELETON: (void)comm;
  // SKELETON: (void)gradients;
  // SKELETON: (void)device;
  // SKELETON: throw NotImplemented("lab8::LossScaler::overflow_on_any_rank");
  const bool mine =
      std::ranges::any_of(gradients, [](const ConstTensorView& view) { return !all_finite(view); });
  // A rank that holds a shard sees only its part of the overflow: one all-reduce (max) of the
  // flag gives every rank the same answer, so every rank skips the same steps.
  Tensor flag({1}, MemoryCategory::kCommunication, device);
  fill(flag.view(), mine ? 1.0f : 0.0f);
  comm.allreduce(flag.view(), ReduceOp::kMax)->wait();
  std::array<float, 1> agreed{};
  copy(std::as_const(flag).view(), TensorView(std::span<float>(agreed)));
  return agreed[0] != 0.0f;
  // END SOLUTION
}

void LossScaler::update(bool overflow) {
  // BEGIN SOLUTION
  // SKELETON: (void)overflow;
  // SKELETON: throw NotImplemented("lab8::LossScaler::update");
  State& s = *state_;
  if (overflow) {
    s.scale *= s.settings.backoff_factor;
    s.tracker = 0;
    ++s.skipped;
    return;
  }
  if (++s.tracker < s.settings.growth_interval) return;
  const float grown = s.scale * s.settings.growth_factor;
  if (std::isfinite(grown)) s.scale = grown;
  s.tracker = 0;
  // END SOLUTION
}

/// Everything a MasterWeightOptimizer keeps.
struct MasterWeightOptimizer::State {
  // BEGIN SOLUTION
  // SKELETON: // Your members.
  std::unique_ptr<Optimizer> inner;
  DataType type = DataType::kBFloat16;
  Tensor masters;   ///< (n) float32, kOptimizerState
  Tensor gradient;  ///< (n) float32, kGradients: the widened, unscaled gradient
  // END SOLUTION
};

MasterWeightOptimizer::MasterWeightOptimizer(std::unique_ptr<Optimizer> inner,
                                             DataType parameter_type) {
  // BEGIN SOLUTION
  // SKELETON: (void)inner;
  // SKELETON: (void)parameter_type;
  // SKELETON: throw NotImplemented("lab8::MasterWeightOptimizer::MasterWeightOptimizer");
  if (inner == nullptr) throw Error("MasterWeightOptimizer: no inner optimizer");
  if (!is_16_bit(parameter_type))
    throw Error(fmt::format("MasterWeightOptimizer: parameters of {}; expected bfloat16 or float16",
                            to_string(parameter_type)));
  const auto n = static_cast<std::int64_t>(inner->state_size());
  const Device device = inner->device();
  state_ = std::make_unique<State>();
  state_->type = parameter_type;
  state_->masters = Tensor({n}, MemoryCategory::kOptimizerState, device);
  state_->gradient = Tensor({n}, MemoryCategory::kGradients, device);
  state_->inner = std::move(inner);
  // END SOLUTION
}

MasterWeightOptimizer::~MasterWeightOptimizer() = default;

// BEGIN SOLUTION
// SKELETON: // Your helpers, if any.
namespace {

/// Throws unless `view` has `size` elements of one of `types` on `device`.
void check_view(std::string_view what, const ConstTensorView& view, std::size_t size,
                std::initializer_list<DataType> types, Device device) {
  if (view.size() != size)
    throw Error(fmt::format("MasterWeightOptimizer: {} of {} elements; expected {}", what,
                            view.size(), size));
  if (std::ranges::find(types, view.dtype()) == types.end())
    throw Error(fmt::format("MasterWeightOptimizer: {} of {}", what, to_string(view.dtype())));
  if (view.device() != device)
    throw Error(fmt::format("MasterWeightOptimizer: {} in {} memory; expected {} memory", what,
                            to_string(view.device()), to_string(device)));
}

}  // namespace
// END SOLUTION

void MasterWeightOptimizer::load_master_weights(ConstTensorView params) {
  // BEGIN SOLUTION
  // SKELETON: (void)params;
  // SKELETON: throw NotImplemented("lab8::MasterWeightOptimizer::load_master_weights");
  State& s = *state_;
  check_view("parameters", params, s.masters.size(), {s.type}, s.inner->device());
  convert(params, s.masters.view());
  // END SOLUTION
}

void MasterWeightOptimizer::step(TensorView params, ConstTensorView grads, float factor) {
  // BEGIN SOLUTION
  // SKELETON: (void)params;
  // SKELETON: (void)grads;
  // SKELETON: (void)factor;
  // SKELETON: throw NotImplemented("lab8::MasterWeightOptimizer::step");
  State& s = *state_;
  check_view("parameters", ConstTensorView(params), s.masters.size(), {s.type}, s.inner->device());
  check_view("gradients", grads, s.masters.size(), {s.type, DataType::kFloat32}, s.inner->device());
  if (!std::isfinite(factor) || !(factor > 0))
    throw Error(fmt::format("MasterWeightOptimizer: gradient factor {} is not finite and positive",
                            factor));
  // Unscale while widening: the 16-bit gradient is widened exactly, then multiplied once.
  convert(grads, s.gradient.view());
  scale(s.gradient.view(), factor);
  step_masters(*s.inner, s.masters.view(), std::as_const(s.gradient).view(), params);
  // END SOLUTION
}

std::size_t MasterWeightOptimizer::state_size() const {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab8::MasterWeightOptimizer::state_size");
  return state_->masters.size();
  // END SOLUTION
}

const Tensor& MasterWeightOptimizer::master_weights() const {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab8::MasterWeightOptimizer::master_weights");
  return state_->masters;
  // END SOLUTION
}

Optimizer& MasterWeightOptimizer::inner() {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab8::MasterWeightOptimizer::inner");
  return *state_->inner;
  // END SOLUTION
}

/// Everything a MixedZeroOne keeps.
struct MixedZeroOne::State {
  // BEGIN SOLUTION
  // SKELETON: // Your members.
  State(Model& m, Communicator& c, ScalerSettings settings) : model(m), comm(c), scaler(settings) {}

  Model& model;
  Communicator& comm;
  LossScaler scaler;
  std::size_t psi = 0;    ///< Psi
  std::size_t shard = 0;  ///< S = ceil(Psi / N)
  std::unique_ptr<Optimizer> inner;
  Tensor flat;            ///< (N S) 16-bit, kCommunication: gradients in, parameters out
  Tensor shard_sum;       ///< (S) 16-bit, kGradients: the summed gradient of the shard
  Tensor shard_gradient;  ///< (S) float32, kGradients: averaged and unscaled
  Tensor masters;         ///< (S) float32, kOptimizerState
  Tensor shard_params;    ///< (S) 16-bit, kParameters: rounded from the masters
  // END SOLUTION
};

MixedZeroOne::MixedZeroOne(Model& model, Communicator& comm, OptimizerFactory make_inner,
                           ScalerSettings scaler) {
  // BEGIN SOLUTION
  // SKELETON: (void)model;
  // SKELETON: (void)comm;
  // SKELETON: (void)make_inner;
  // SKELETON: (void)scaler;
  // SKELETON: throw NotImplemented("lab8::MixedZeroOne::MixedZeroOne");
  const DataType type = model.dtype();
  if (!is_16_bit(type))
    throw Error(fmt::format("MixedZeroOne: the model is {}; expected bfloat16 or float16",
                            to_string(type)));
  for (const Parameter* parameter : model.parameters())
    if (parameter->frozen)
      throw Error(fmt::format("MixedZeroOne: parameter {} is frozen", parameter->name));
  if (!make_inner) throw Error("MixedZeroOne: no optimizer factory");
  auto state = std::make_unique<State>(model, comm, scaler);
  const auto n = static_cast<std::size_t>(comm.size());
  state->psi = model.num_parameters();
  state->shard = (state->psi + n - 1) / n;
  state->inner = make_inner(state->shard);
  if (state->inner == nullptr) throw Error("MixedZeroOne: the factory returned no optimizer");
  if (state->inner->state_size() != state->shard)
    throw Error(
        fmt::format("MixedZeroOne: the inner optimizer keeps state for {} elements; "
                    "expected the shard's {}",
                    state->inner->state_size(), state->shard));
  const Device device = model.device();
  if (state->inner->device() != device)
    throw Error(fmt::format("MixedZeroOne: the inner optimizer lives in {} memory, the model in {}",
                            to_string(state->inner->device()), to_string(device)));
  const auto s = static_cast<std::int64_t>(state->shard);
  state->flat = Tensor({s * comm.size()}, type, MemoryCategory::kCommunication, device);
  state->shard_sum = Tensor({s}, type, MemoryCategory::kGradients, device);
  state->shard_gradient = Tensor({s}, MemoryCategory::kGradients, device);
  state->masters = Tensor({s}, MemoryCategory::kOptimizerState, device);
  state->shard_params = Tensor({s}, type, MemoryCategory::kParameters, device);
  // The masters of this rank's shard: the initial 16-bit values widened exactly.
  const std::size_t begin = static_cast<std::size_t>(comm.rank()) * state->shard;
  for (const Parameter* parameter : model.parameters()) {
    const std::size_t first = std::max(begin, parameter->offset);
    const std::size_t last =
        std::min(begin + state->shard, parameter->offset + parameter->value.size());
    if (first >= last) continue;
    convert(parameter->value.view(first - parameter->offset, last - first),
            state->masters.view(first - begin, last - first));
  }
  state_ = std::move(state);
  // END SOLUTION
}

MixedZeroOne::~MixedZeroOne() = default;

bool MixedZeroOne::step() {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab8::MixedZeroOne::step");
  State& s = *state_;
  const std::size_t padded = s.flat.size();
  for (const Parameter* parameter : s.model.parameters())
    copy(parameter->grad.view(), s.flat.view(parameter->offset, parameter->grad.size()));
  if (padded > s.psi) fill(s.flat.view(s.psi, padded - s.psi), 0.0f);
  s.comm.reduce_scatter(std::as_const(s.flat).view(), s.shard_sum.view(), ReduceOp::kSum)->wait();

  const std::array<ConstTensorView, 1> mine = {std::as_const(s.shard_sum).view()};
  const bool overflow = s.scaler.overflow_on_any_rank(s.comm, mine, s.model.device());
  if (overflow) {
    s.scaler.update(true);
    return false;
  }
  convert(std::as_const(s.shard_sum).view(), s.shard_gradient.view());
  divide(s.shard_gradient.view(), static_cast<float>(s.comm.size()));
  scale(s.shard_gradient.view(), s.scaler.inverse_scale());
  step_masters(*s.inner, s.masters.view(), std::as_const(s.shard_gradient).view(),
               s.shard_params.view());

  s.comm.allgather(std::as_const(s.shard_params).view(), s.flat.view())->wait();
  for (Parameter* parameter : s.model.parameters())
    copy(std::as_const(s.flat).view(parameter->offset, parameter->value.size()),
         parameter->value.view());
  s.scaler.update(false);
  return true;
  // END SOLUTION
}

const LossScaler& MixedZeroOne::scaler() const {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab8::MixedZeroOne::scaler");
  return state_->scaler;
  // END SOLUTION
}

const Tensor& MixedZeroOne::shard_master_weights() const {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab8::MixedZeroOne::shard_master_weights");
  return state_->masters;
  // END SOLUTION
}

Optimizer& MixedZeroOne::inner() {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab8::MixedZeroOne::inner");
  return *state_->inner;
  // END SOLUTION
}

std::size_t model_state_bytes_per_rank(Strategy strategy, std::size_t num_parameters,
                                       int world_size) {
  // BEGIN SOLUTION
  // SKELETON: (void)strategy;
  // SKELETON: (void)num_parameters;
  // SKELETON: (void)world_size;
  // SKELETON: throw NotImplemented("lab8::model_state_bytes_per_rank");
  if (world_size < 1) throw Error(fmt::format("world size {} < 1", world_size));
  const std::size_t psi = num_parameters;
  const auto n = static_cast<std::size_t>(world_size);
  const std::size_t s = (psi + n - 1) / n;
  // 2 bytes of 16-bit parameters, 2 of 16-bit gradients, 12 of float32 masters and moments.
  switch (strategy) {
    case Strategy::kDdp: return 16 * psi;
    case Strategy::kZero1: return 4 * psi + 12 * s;
    case Strategy::kZero2: return 2 * psi + 14 * s;
    case Strategy::kZero3: return 16 * s;
  }
  throw Error("unknown strategy");
  // END SOLUTION
}

double bytes_per_parameter(Strategy strategy, int world_size) {
  // BEGIN SOLUTION
  // SKELETON: (void)strategy;
  // SKELETON: (void)world_size;
  // SKELETON: throw NotImplemented("lab8::bytes_per_parameter");
  if (world_size < 1) throw Error(fmt::format("world size {} < 1", world_size));
  const auto n = static_cast<double>(world_size);
  switch (strategy) {
    case Strategy::kDdp: return 16.0;
    case Strategy::kZero1: return 4.0 + 12.0 / n;
    case Strategy::kZero2: return 2.0 + 14.0 / n;
    case Strategy::kZero3: return 16.0 / n;
  }
  throw Error("unknown strategy");
  // END SOLUTION
}

std::size_t largest_model_that_fits(Strategy strategy, int world_size, std::size_t budget_bytes) {
  // BEGIN SOLUTION
  // SKELETON: (void)strategy;
  // SKELETON: (void)world_size;
  // SKELETON: (void)budget_bytes;
  // SKELETON: throw NotImplemented("lab8::largest_model_that_fits");
  // The bytes never fall as Psi grows, and are at least 16 S >= 16 Psi / N: the answer lies
  // in [0, (budget + 1) N), found by bisection.
  if (world_size < 1) throw Error(fmt::format("world size {} < 1", world_size));
  std::size_t low = 0;                                                           // fits
  std::size_t high = (budget_bytes + 1) * static_cast<std::size_t>(world_size);  // does not
  while (high - low > 1) {
    const std::size_t middle = low + (high - low) / 2;
    if (model_state_bytes_per_rank(strategy, middle, world_size) <= budget_bytes)
      low = middle;
    else
      high = middle;
  }
  return low;
  // END SOLUTION
}

}  // namespace dp::lab8
