// loss_scaler.cpp: PyTorch GradScaler's rule (torch/amp/grad_scaler.py and the kernels
// _amp_foreach_non_finite_check_and_unscale_ and _amp_update_scale_), on dplab's tensors.
#include "dp/loss_scaler.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>

#include "dp/error.h"
#include "dp/tensor_ops.h"

namespace dp {

namespace {

void check_scale(float scale) {
  if (!std::isfinite(scale) || scale <= 0.0f) {
    throw Error(fmt::format("loss scale must be finite and positive, got {}", scale));
  }
}

}  // namespace

DynamicLossScaler::DynamicLossScaler(LossScalerOptions options)
    : options_(options), scale_(options.initial_scale) {
  check_scale(options.initial_scale);
  if (!std::isfinite(options.growth_factor) || options.growth_factor <= 1.0f) {
    throw Error(fmt::format("loss scaler growth factor must be finite and above 1, got {}",
                            options.growth_factor));
  }
  if (!(options.backoff_factor > 0.0f && options.backoff_factor < 1.0f)) {
    throw Error(fmt::format("loss scaler backoff factor must be in (0, 1), got {}",
                            options.backoff_factor));
  }
  if (options.growth_interval < 1) {
    throw Error(fmt::format("loss scaler growth interval must be at least 1 step, got {}",
                            options.growth_interval));
  }
}

bool DynamicLossScaler::unscale(std::span<const TensorView> gradients) const {
  // PyTorch: inv_scale = scale.double().reciprocal().float(); the test reads the scaled
  // values, then each is multiplied by inv_scale (a power of two while S is one: exact).
  const auto inverse = static_cast<float>(1.0 / static_cast<double>(scale_));
  bool overflow = false;
  for (const TensorView& gradient : gradients) {
    overflow = overflow || !all_finite(gradient);
    dp::scale(gradient, inverse);  // the free function, not the member
  }
  return overflow;
}

bool DynamicLossScaler::found_overflow(std::span<const ConstTensorView> gradients) {
  bool overflow = false;
  for (const ConstTensorView& gradient : gradients) overflow = overflow || !all_finite(gradient);
  return overflow;
}

bool DynamicLossScaler::check_overflow(Communicator& comm,
                                       std::span<const ConstTensorView> gradients,
                                       Device device) const {
  const bool overflow_here = found_overflow(gradients);
  Tensor flag({1}, MemoryCategory::kCommunication, device);
  fill(flag.view(), overflow_here ? 1.0f : 0.0f);
  comm.allreduce(flag.view(), ReduceOp::kMax)->wait();
  return flag.to(Device::kHost)[0] != 0.0f;
}

bool DynamicLossScaler::unscale_and_check(Communicator& comm, std::span<const TensorView> gradients,
                                          Device device) const {
  const bool overflow_here = unscale(gradients);
  // One float, 1 where this rank overflowed: the maximum over the ranks is every rank's
  // answer. Read back on the host, as PyTorch's `found_inf.item()` synchronizes.
  Tensor flag({1}, MemoryCategory::kCommunication, device);
  fill(flag.view(), overflow_here ? 1.0f : 0.0f);
  comm.allreduce(flag.view(), ReduceOp::kMax)->wait();
  return flag.to(Device::kHost)[0] != 0.0f;
}

void DynamicLossScaler::update(bool overflow) {
  if (overflow) {
    scale_ *= options_.backoff_factor;
    growth_tracker_ = 0;
    ++skipped_steps_;
    // PyTorch would go on skipping; a scale that no longer is a normal float means some
    // gradient is not finite at any scale (a NaN from the model or the data), which no
    // number of skipped steps will cure.
    if (scale_ < std::numeric_limits<float>::min()) {
      throw Error(fmt::format(
          "loss scale fell to {} after {} skipped steps: the gradients are not finite at any "
          "scale (a NaN or infinity from the model, the data or the learning rate)",
          scale_, skipped_steps_));
    }
    return;
  }
  if (++growth_tracker_ == options_.growth_interval) {
    const float grown = scale_ * options_.growth_factor;
    if (std::isfinite(grown)) scale_ = grown;
    growth_tracker_ = 0;
  }
}

void DynamicLossScaler::restore(float scale, int growth_tracker, std::int64_t skipped_steps) {
  check_scale(scale);
  if (growth_tracker < 0 || growth_tracker >= options_.growth_interval) {
    throw Error(fmt::format("loss scaler growth tracker must be in [0, {}), got {}",
                            options_.growth_interval, growth_tracker));
  }
  if (skipped_steps < 0) {
    throw Error(fmt::format("skipped steps must be non-negative, got {}", skipped_steps));
  }
  scale_ = scale;
  growth_tracker_ = growth_tracker;
  skipped_steps_ = skipped_steps;
}

}  // namespace dp
