// optimizer.h: SGD with momentum and AdamW, updating any slice of a flat index space.
//
// An optimizer keeps its state (momentum, or Adam's two moments) for a flat index space
// of `state_size()` elements, and `update(offset, params, grads)` updates the elements
// [offset, offset + params.size()) of that space. For a whole model the space is the
// model's flat parameter space (`Parameter::offset`), and `step(model)` updates every
// non-frozen parameter. A ZeRO rank instead makes an optimizer for its shard only and
// updates just that slice: the state bytes then shrink by the number of ranks.
//
// State tensors are charged under `MemoryCategory::kOptimizerState`. They live on the
// device given at construction (the host by default): an optimizer on a CUDA device updates
// device views with a kernel whose results equal the host loop's bit for bit.
//
// Example:
//
//   dp::AdamW adam(model.num_parameters(), {.lr = 1e-3f});
//   adam.step(model);                    // begin_step(), then update() of every parameter
//
//   dp::Sgd shard_sgd(shard_size, {.lr = 0.1f, .momentum = 0.9f});   // ZeRO-1 style
//   shard_sgd.begin_step();
//   shard_sgd.update(0, my_params, my_grads);   // spans or views of shard_size elements
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dp/layer.h"
#include "dp/tensor.h"

namespace dp {

class Model;

/// Settings of `Sgd`, with PyTorch's meaning.
struct SgdOptions {
  float lr = 0.1f;            ///< learning rate
  float momentum = 0.0f;      ///< momentum factor; 0 keeps no buffer
  float weight_decay = 0.0f;  ///< L2 penalty added to the gradient
};

/// Settings of `AdamW`, with PyTorch's meaning and defaults.
struct AdamWOptions {
  float lr = 1e-3f;            ///< learning rate
  float beta1 = 0.9f;          ///< decay of the first moment
  float beta2 = 0.999f;        ///< decay of the second moment
  float eps = 1e-8f;           ///< added to the denominator
  float weight_decay = 0.01f;  ///< decoupled weight decay
};

/// One named state tensor of an optimizer, e.g. "exp_avg" (for checkpoints).
struct OptimizerState {
  std::string name;  ///< "momentum_buffer", "exp_avg" or "exp_avg_sq", as in PyTorch
  Tensor* tensor;    ///< (state_size), owned by the optimizer
};

/// The base of the optimizers: state for a flat index space and a step counter.
class Optimizer {
 public:
  virtual ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  /// "sgd" or "adamw".
  virtual std::string_view name() const = 0;
  /// Starts a step: advances the step counter (AdamW's bias correction uses it).
  virtual void begin_step();
  /// Updates elements [offset, offset + params.size()) of the flat index space in place,
  /// given their gradients. Throws `dp::Error` if the range passes `state_size()`, the
  /// sizes of `params` and `grads` differ, or `begin_step()` was never called.
  virtual void update(std::size_t offset, std::span<float> params,
                      std::span<const float> grads) = 0;
  /// The same on views, on the device the optimizer's state lives on (`device()`): host
  /// views go to the update above, device views to the optimizer's kernel. Throws
  /// `dp::Error` when the views and the state live on different devices. Virtual for
  /// `MixedPrecisionOptimizer`, whose parameters and gradients are 16-bit views.
  virtual void update(std::size_t offset, TensorView params, ConstTensorView grads);
  /// begin_step(), then update() of every non-frozen parameter of `model` at its
  /// `Parameter::offset`; charged to the thread's clock (dp/clock.h) as one compute op.
  void step(Model& model);
  /// Flops and bytes of updating `elements` elements, for the simulated clock.
  virtual OpCost update_cost(std::size_t elements) const;

  /// Elements of the index space this optimizer keeps state for.
  std::size_t state_size() const { return state_size_; }
  /// Where the state lives, and the parameters and gradients it updates must.
  Device device() const { return device_; }
  /// Number of `begin_step()` calls so far.
  std::int64_t step_count() const { return step_count_; }
  /// Sets the step counter, to resume from a checkpoint.
  void set_step_count(std::int64_t steps);
  /// The state tensors (empty for plain SGD), to save or restore them.
  virtual std::vector<OptimizerState> state() = 0;

 protected:
  /// An optimizer for an index space of `state_size` elements, its state on `device`.
  explicit Optimizer(std::size_t state_size, Device device = Device::kHost)
      : state_size_(state_size), device_(device) {}
  /// Throws `dp::Error` unless `update(offset, params, grads)` is valid now.
  void check_update(std::size_t offset, std::span<float> params,
                    std::span<const float> grads) const;
  /// The same on the numbers of parameters and gradients (for device views).
  void check_update(std::size_t offset, std::size_t params, std::size_t grads) const;
  /// The update of `n` elements of device memory at `offset` (checked already). The
  /// default throws: an optimizer without a kernel runs on the host only.
  virtual void update_on_device(std::size_t offset, float* params, const float* grads,
                                std::size_t n);
  /// Throws `dp::Error` unless the state lives on the host: an update on host spans cannot
  /// reach state in device memory.
  void require_host_state() const;

 private:
  std::size_t state_size_;
  Device device_;
  std::int64_t step_count_ = 0;
};

/// Stochastic gradient descent with PyTorch's semantics:
/// g += weight_decay * p; buf = momentum * buf + g (buf = g on the first step); p -= lr * buf
/// (with momentum 0: p -= lr * g).
class Sgd final : public Optimizer {
 public:
  /// SGD over `state_size` elements; the momentum buffer exists only when momentum != 0.
  /// Throws `dp::Error` unless lr and weight decay are finite and >= 0 and momentum is in
  /// [0, 1).
  Sgd(std::size_t state_size, SgdOptions options, Device device = Device::kHost);
  /// "sgd".
  std::string_view name() const override { return "sgd"; }
  using Optimizer::update;  // the update on views
  /// See `Optimizer::update`.
  void update(std::size_t offset, std::span<float> params, std::span<const float> grads) override;
  /// {"momentum_buffer"} with momentum, else empty.
  std::vector<OptimizerState> state() override;
  /// 2 flops and 12 bytes per element (read p and g, write p); with momentum 4 and 20.
  OpCost update_cost(std::size_t elements) const override;
  /// The settings.
  const SgdOptions& options() const { return options_; }

 protected:
  /// The kernel of cuda/kernels.cu, bitwise the host loop (the host loop itself on the
  /// emulated device).
  void update_on_device(std::size_t offset, float* params, const float* grads,
                        std::size_t n) override;

 private:
  /// The update of `n` elements in host memory at `offset` (checked already).
  void update_in_host_memory(std::size_t offset, float* params, const float* grads, std::size_t n);

  SgdOptions options_;
  Tensor momentum_buffer_;  // (state_size), empty without momentum
};

/// AdamW (Loshchilov and Hutter, 2019) with PyTorch's semantics:
/// p *= 1 - lr * weight_decay; m = beta1 m + (1 - beta1) g; v = beta2 v + (1 - beta2) g^2;
/// p -= lr * mhat / (sqrt(vhat) + eps) with mhat = m / (1 - beta1^t), vhat = v / (1 - beta2^t).
class AdamW final : public Optimizer {
 public:
  /// AdamW over `state_size` elements: m and v take 2 * 4 * state_size bytes.
  /// Throws `dp::Error` on settings out of range (betas in [0, 1), finite eps > 0, finite
  /// lr >= 0 and weight decay >= 0).
  AdamW(std::size_t state_size, AdamWOptions options, Device device = Device::kHost);
  /// "adamw".
  std::string_view name() const override { return "adamw"; }
  using Optimizer::update;  // the update on views
  /// See `Optimizer::update`.
  void update(std::size_t offset, std::span<float> params, std::span<const float> grads) override;
  /// {"exp_avg", "exp_avg_sq"}.
  std::vector<OptimizerState> state() override;
  /// About 14 flops and 28 bytes per element (read and write p, m, v; read g).
  OpCost update_cost(std::size_t elements) const override;
  /// The settings.
  const AdamWOptions& options() const { return options_; }

 protected:
  /// The kernel of cuda/kernels.cu, bitwise the host loop (the host loop itself on the
  /// emulated device).
  void update_on_device(std::size_t offset, float* params, const float* grads,
                        std::size_t n) override;

 private:
  /// The update of `n` elements in host memory at `offset` (checked already).
  void update_in_host_memory(std::size_t offset, float* params, const float* grads, std::size_t n);
  /// The per-step constants of the update, shared by the host loop and the kernel.
  struct StepConstants {
    float step_size, sqrt_correction2, decay;
  };
  StepConstants step_constants() const;

  AdamWOptions options_;
  Tensor exp_avg_;     // (state_size), m
  Tensor exp_avg_sq_;  // (state_size), v
};

/// Mixed-precision training's optimizer: float32 master weights for 16-bit parameters.
///
/// The model's parameters and gradients are bfloat16 or float16 (2 + 2 bytes per parameter);
/// this wrapper keeps a float32 copy of every parameter, the master weights, and an inner
/// optimizer (SGD or AdamW, its state in float32) that updates the masters. With AdamW that
/// is 4 + 8 bytes of optimizer state per parameter, ZeRO's 12 Psi, charged under
/// `MemoryCategory::kOptimizerState` (the masters with the inner optimizer's state): 16 bytes
/// per parameter in all. The update of element i, in this order:
///
///   g = widen(grad[i]) * gradient_scale    the 16-bit gradient widened exactly, then
///                                          multiplied by 1/S under fp16 loss scaling
///                                          (`set_gradient_scale`; skipped when it is 1)
///   inner update of master[i] with g       SGD's or AdamW's float32 arithmetic, unchanged
///   param[i] = round(master[i])            to nearest even (dp/float16.h)
///
/// Small updates accumulate in the masters, where a 16-bit weight would lose them (a bf16
/// weight near 1 ignores any step below 2^-8). The gradients are widened in chunks through
/// a float32 workspace of at most 65536 elements, charged under `MemoryCategory::kOther`.
///
/// Example:
///
///   dp::Model model = dp::Model::mlp("64-256-10", {.dtype = dp::DataType::kBFloat16});
///   dp::MixedPrecisionOptimizer optimizer(
///       std::make_unique<dp::AdamW>(model.num_parameters(), dp::AdamWOptions{}),
///       dp::DataType::kBFloat16);
///   optimizer.load_master_weights(model);   // after the parameters are final (broadcast)
///   ... forward, backward, all-reduce ...
///   optimizer.step(model);                  // masters updated, parameters rounded from them
class MixedPrecisionOptimizer final : public Optimizer {
 public:
  /// Wraps `inner`, whose state covers the whole index space (`state_size()` is its), for
  /// parameters of `parameter_type` (bfloat16 or float16), its masters on `inner`'s device,
  /// zero until `load_master_weights`. Throws `dp::Error` on a null `inner` or another type.
  MixedPrecisionOptimizer(std::unique_ptr<Optimizer> inner, DataType parameter_type);
  /// The inner optimizer's name ("sgd" or "adamw").
  std::string_view name() const override { return inner_->name(); }
  /// Starts a step of this wrapper and of the inner optimizer (AdamW's bias correction).
  void begin_step() override;
  /// masters[offset, offset + params.size()) = the 16-bit `params` widened exactly (on the
  /// optimizer's device). Throws `dp::Error` on a range past the state, another type or
  /// another device.
  void load_master_weights(std::size_t offset, ConstTensorView params);
  /// The same for every parameter of `model` at its `Parameter::offset`.
  void load_master_weights(const Model& model);
  /// The factor each widened gradient is multiplied by before the inner update: 1 / S under
  /// fp16 loss scaling (`DynamicLossScaler::inverse_scale`), else 1 (the default). Throws
  /// `dp::Error` unless it is finite and positive.
  void set_gradient_scale(float factor);
  /// The factor of `set_gradient_scale`.
  float gradient_scale() const { return gradient_scale_; }
  /// Refuses float32 spans (throws `dp::Error`): the parameters of mixed precision are
  /// 16-bit views, the update below.
  void update(std::size_t offset, std::span<float> params, std::span<const float> grads) override;
  /// The mixed-precision update (see the class) of elements [offset, offset + params.size()):
  /// `params` and `grads` are views of `parameter_type` on the optimizer's device. Throws
  /// `dp::Error` on another type or device, a range past the state or before `begin_step`.
  void update(std::size_t offset, TensorView params, ConstTensorView grads) override;
  /// {"master_weights"}, then the inner optimizer's state.
  std::vector<OptimizerState> state() override;
  /// The inner update's, plus reading 2 + 2 bytes and writing 2 per element (widen, round).
  OpCost update_cost(std::size_t elements) const override;
  /// The inner optimizer, which updates the masters.
  Optimizer& inner() { return *inner_; }
  /// The float32 master weights, (state_size).
  const Tensor& master_weights() const { return master_; }
  /// The 16-bit type of the parameters.
  DataType parameter_type() const { return type_; }

 private:
  std::unique_ptr<Optimizer> inner_;
  DataType type_;
  Tensor master_;     // (state_size) float32, kOptimizerState
  Tensor workspace_;  // (min(state_size, 65536)) float32 widened gradients, kOther
  float gradient_scale_ = 1.0f;
};

/// Makes "sgd" (with `momentum`) or "adamw" (`momentum` unused: PyTorch's default betas)
/// over `state_size` elements, its state on `device`. Throws `dp::Error` listing the valid
/// names otherwise.
std::unique_ptr<Optimizer> make_optimizer(std::string_view name, std::size_t state_size, float lr,
                                          float momentum, float weight_decay,
                                          Device device = Device::kHost);

}  // namespace dp
