// loss_scaler.h: dynamic loss scaling for float16 training, the same decisions on every rank.
//
// float16 has five exponent bits: gradients below about 6e-8 flush to zero, and many small
// gradients of a deep network lie there. Loss scaling multiplies the loss by a large factor S
// before backward, so every gradient is S times larger and stays representable, and divides
// the gradients by S before the optimizer uses them. If S is too large a gradient overflows
// to infinity (or becomes NaN): the step is then skipped and S halved. After
// `growth_interval` steps without an overflow S doubles, so it tracks the largest safe value.
// The defaults and the rule are PyTorch's `torch.amp.GradScaler` (initial scale 2^16, growth
// factor 2, backoff factor 0.5, growth interval 2000; its `_amp_update_scale_`: a growth
// that would make S infinite is not taken).
//
// Data-parallel training must skip the same steps on every rank, or the replicas diverge.
// After an all-reduce every rank holds the same gradients and finds the same overflow, but
// a rank that holds only its shard (ZeRO-2 and -3, FSDP) sees only its part: one all-reduce
// (max) of the overflow flag decides for all, as PyTorch's ShardedGradScaler does.
// `unscale_and_check` does both: it unscales this rank's gradients, then agrees on the
// answer with one collective of one float.
//
// bfloat16 has float32's exponent range and needs no scaling; float32 neither.
//
// Example:
//
//   dp::DynamicLossScaler scaler;                    // S = 65536
//   float loss = model.backward(logits, labels, scaler.scale());
//   ... all-reduce (or reduce-scatter) the gradients ...
//   bool overflow = scaler.unscale_and_check(comm, my_gradients);   // same on every rank
//   if (!overflow) optimizer.step(model);
//   scaler.update(overflow);                         // halves S, or counts toward doubling it
//
// With 16-bit gradients and float32 master weights (dp::MixedPrecisionOptimizer) the
// gradients stay as they are: `check_overflow` agrees on the overflow, and the optimizer
// multiplies each widened gradient by `inverse_scale()`:
//
//   bool overflow = scaler.check_overflow(comm, my_16bit_gradients);
//   if (!overflow) { optimizer.set_gradient_scale(scaler.inverse_scale()); optimizer.step(model); }
//   scaler.update(overflow);
#pragma once

#include <cstdint>
#include <span>

#include "dp/comm.h"
#include "dp/tensor.h"

namespace dp {

/// Settings of `DynamicLossScaler`, with the defaults of PyTorch's GradScaler.
struct LossScalerOptions {
  float initial_scale = 65536.0f;  ///< S at the first step (2^16)
  float growth_factor = 2.0f;      ///< S is multiplied by this after `growth_interval` clean steps
  float backoff_factor = 0.5f;     ///< S is multiplied by this after an overflow
  int growth_interval = 2000;      ///< clean steps in a row before S grows
};

/// A dynamic loss scale: the factor the loss is multiplied by, the unscaling of the
/// gradients with the overflow test agreed across ranks, and the update of the factor.
class DynamicLossScaler {
 public:
  /// A scaler with `options`. Throws `dp::Error` unless the initial scale is finite and
  /// positive, the growth factor is finite and above 1, the backoff factor is in (0, 1) and
  /// the growth interval is at least 1.
  explicit DynamicLossScaler(LossScalerOptions options = {});

  /// The current scale S, by which backward multiplies the loss's gradient.
  float scale() const { return scale_; }
  /// Clean steps in a row since the last change of S (PyTorch's `_growth_tracker`).
  int growth_tracker() const { return growth_tracker_; }
  /// Steps skipped so far because some rank found an overflow.
  std::int64_t skipped_steps() const { return skipped_steps_; }
  /// The settings.
  const LossScalerOptions& options() const { return options_; }

  /// Multiplies every element of `gradients` by 1 / S (the reciprocal of S rounded to
  /// float, as PyTorch's unscale computes it) and returns whether any of them was not
  /// finite before: this rank's view only. The views may live on the host or a device and
  /// must hold float32 (the gradients the optimizer reads: in mixed precision, their float32
  /// copies); `dp::scale` refuses 16-bit views.
  bool unscale(std::span<const TensorView> gradients) const;
  /// `unscale`, then one all-reduce (max) of the answer over `comm`, so that every rank
  /// returns the same: true when any rank found an overflow. The flag travels in a
  /// one-element tensor on `device` (the device of the gradients: the backends take their
  /// buffers there). Every rank must call it, once per step.
  bool unscale_and_check(Communicator& comm, std::span<const TensorView> gradients,
                         Device device = Device::kHost) const;
  /// The factor that unscales a gradient: 1 / S rounded to float, as `unscale` multiplies
  /// by (`MixedPrecisionOptimizer::set_gradient_scale` takes it).
  float inverse_scale() const { return static_cast<float>(1.0 / static_cast<double>(scale_)); }
  /// True when some element of `gradients` (of any type) is not finite: this rank's view,
  /// the gradients left as they are. For 16-bit gradients, which the master-weight
  /// optimizer unscales as it widens them (`MixedPrecisionOptimizer`), the test reads the
  /// scaled values, as `unscale` does.
  static bool found_overflow(std::span<const ConstTensorView> gradients);
  /// `found_overflow`, then one all-reduce (max) of the answer over `comm`, as
  /// `unscale_and_check` agrees: every rank returns true when any rank found an overflow.
  /// Every rank must call it, once per step.
  bool check_overflow(Communicator& comm, std::span<const ConstTensorView> gradients,
                      Device device = Device::kHost) const;
  /// After the step: on an overflow S is multiplied by the backoff factor, the tracker is
  /// reset and the step counted as skipped (throws `dp::Error` once S falls below the
  /// smallest normal float: then no scale makes the gradients finite); otherwise the tracker counts
  /// one more clean step and at `growth_interval` S grows (unless it would become infinite) and the
  /// tracker restarts.
  void update(bool overflow);

  /// Restores the state of a checkpoint: S and the growth tracker. Throws `dp::Error` on a
  /// scale that is not finite and positive or a tracker outside [0, growth_interval).
  void restore(float scale, int growth_tracker, std::int64_t skipped_steps);

 private:
  LossScalerOptions options_;
  float scale_;
  int growth_tracker_ = 0;
  std::int64_t skipped_steps_ = 0;
};

}  // namespace dp
