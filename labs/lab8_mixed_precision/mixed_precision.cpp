// Lab skeleton, generated from the reference by tools/make-skeletons: your code goes where
// dp::NotImplemented is thrown.
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

// Your helpers, if any.

/// Everything a LossScaler keeps.
struct LossScaler::State {
  // Your members.
};

LossScaler::LossScaler(ScalerSettings settings) {
  (void)settings;
  throw NotImplemented("lab8::LossScaler::LossScaler");
}

LossScaler::~LossScaler() = default;

float LossScaler::scale() const {
  throw NotImplemented("lab8::LossScaler::scale");
}

float LossScaler::inverse_scale() const {
  throw NotImplemented("lab8::LossScaler::inverse_scale");
}

int LossScaler::growth_tracker() const {
  throw NotImplemented("lab8::LossScaler::growth_tracker");
}

std::int64_t LossScaler::skipped_steps() const {
  throw NotImplemented("lab8::LossScaler::skipped_steps");
}

bool LossScaler::overflow_on_any_rank(Communicator& comm,
                                      std::span<const ConstTensorView> gradients, Device device) {
  (void)comm;
  (void)gradients;
  (void)device;
  throw NotImplemented("lab8::LossScaler::overflow_on_any_rank");
}

void LossScaler::update(bool overflow) {
  (void)overflow;
  throw NotImplemented("lab8::LossScaler::update");
}

/// Everything a MasterWeightOptimizer keeps.
struct MasterWeightOptimizer::State {
  // Your members.
};

MasterWeightOptimizer::MasterWeightOptimizer(std::unique_ptr<Optimizer> inner,
                                             DataType parameter_type) {
  (void)inner;
  (void)parameter_type;
  throw NotImplemented("lab8::MasterWeightOptimizer::MasterWeightOptimizer");
}

MasterWeightOptimizer::~MasterWeightOptimizer() = default;

// Your helpers, if any.

void MasterWeightOptimizer::load_master_weights(ConstTensorView params) {
  (void)params;
  throw NotImplemented("lab8::MasterWeightOptimizer::load_master_weights");
}

void MasterWeightOptimizer::step(TensorView params, ConstTensorView grads, float factor) {
  (void)params;
  (void)grads;
  (void)factor;
  throw NotImplemented("lab8::MasterWeightOptimizer::step");
}

std::size_t MasterWeightOptimizer::state_size() const {
  throw NotImplemented("lab8::MasterWeightOptimizer::state_size");
}

const Tensor& MasterWeightOptimizer::master_weights() const {
  throw NotImplemented("lab8::MasterWeightOptimizer::master_weights");
}

Optimizer& MasterWeightOptimizer::inner() {
  throw NotImplemented("lab8::MasterWeightOptimizer::inner");
}

/// Everything a MixedZeroOne keeps.
struct MixedZeroOne::State {
  // Your members.
};

MixedZeroOne::MixedZeroOne(Model& model, Communicator& comm, OptimizerFactory make_inner,
                           ScalerSettings scaler) {
  (void)model;
  (void)comm;
  (void)make_inner;
  (void)scaler;
  throw NotImplemented("lab8::MixedZeroOne::MixedZeroOne");
}

MixedZeroOne::~MixedZeroOne() = default;

bool MixedZeroOne::step() {
  throw NotImplemented("lab8::MixedZeroOne::step");
}

const LossScaler& MixedZeroOne::scaler() const {
  throw NotImplemented("lab8::MixedZeroOne::scaler");
}

const Tensor& MixedZeroOne::shard_master_weights() const {
  throw NotImplemented("lab8::MixedZeroOne::shard_master_weights");
}

Optimizer& MixedZeroOne::inner() {
  throw NotImplemented("lab8::MixedZeroOne::inner");
}

std::size_t model_state_bytes_per_rank(Strategy strategy, std::size_t num_parameters,
                                       int world_size) {
  (void)strategy;
  (void)num_parameters;
  (void)world_size;
  throw NotImplemented("lab8::model_state_bytes_per_rank");
}

double bytes_per_parameter(Strategy strategy, int world_size) {
  (void)strategy;
  (void)world_size;
  throw NotImplemented("lab8::bytes_per_parameter");
}

std::size_t largest_model_that_fits(Strategy strategy, int world_size, std::size_t budget_bytes) {
  (void)strategy;
  (void)world_size;
  (void)budget_bytes;
  throw NotImplemented("lab8::largest_model_that_fits");
}

}  // namespace dp::lab8
