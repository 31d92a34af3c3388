// lab8.h: lab 8, mixed precision and ZeRO: 16-bit parameters and gradients, float32 master
// weights, dynamic loss scaling agreed across ranks, and ZeRO-1 over all of it. The contract
// between your code and the grader: the interfaces you implement, the arithmetic that fixes
// the bits, the budgets, and how each is checked.
//
// Labs 1 to 7 train in float32: 4 bytes of parameters, 4 of gradients and 8 of AdamW state
// per parameter. The ZeRO paper's famous 2 + 2 + 12 is mixed precision: the model computes
// in bfloat16 or float16 (2 bytes of parameters, 2 of gradients), and the optimizer keeps a
// float32 master copy of every parameter beside its float32 moments (4 + 4 + 4 = 12 bytes),
// because a 16-bit parameter cannot absorb an update smaller than half its last bit. float16's
// five exponent bits add a second problem: small gradients flush to zero, so the loss is
// multiplied by a scale S before backward and the gradients divided by S after; when S is too
// large a gradient overflows, the step is skipped and S shrinks. On several ranks every rank
// must skip the same steps, or the replicas diverge. The 12 bytes are the part ZeRO-1 shards.
// How you arrange your buffers, in how many pieces you communicate and which helpers you
// write is your design; README.md beside this file poses the problem.
//
// What every check holds you to:
//   * Exact arithmetic, stated below, so that the grader compares bitwise with an emulation of
//     it in one process. The runtime's conversions round to nearest, ties to even
//     (`dp::convert`, `Tensor::to`, dp/float16.h); a 16-bit sum over ranks is
//     `ReduceOp::kSum` on 16-bit buffers, which rounds after every addition in rank order
//     (dp/comm.h, `ReduceOp`).
//   * Asynchrony done right: every check runs in the adversarial completion mode.
//   * Counters you cannot change: the communicator's `CommCounters` and the rank's
//     `MemoryTracker`.
//   * Arithmetic with the runtime's operations (dp/tensor_ops.h) on `Tensor`s, so that the code
//     runs on a GPU too; no mutable globals (ranks are threads of one process).
//   * Not the runtime's own answers: `dp::MixedPrecisionOptimizer` and `dp::DynamicLossScaler`
//     (dp/optimizer.h, dp/loss_scaler.h) do what this lab asks you to write; the lab audit
//     refuses them.
//
// Example (one data-parallel step, float16):
//
//   dp::Model model = dp::Model::mlp("32-64-10", {.seed = 1, .dtype = dp::DataType::kFloat16});
//   dp::lab8::MixedZeroOne zero(model, comm, [](std::size_t shard) {
//     return std::make_unique<dp::AdamW>(shard, dp::AdamWOptions{.lr = 1e-3f});
//   });
//   model.zero_grad();
//   model.backward(model.forward(batch.inputs), batch.labels, zero.scaler().scale());
//   bool updated = zero.step();   // the same on every rank; false: the step was skipped
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>

#include "dp/comm.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "dp/tensor.h"

namespace dp::lab8 {

/// The settings of `LossScaler`, with the defaults of PyTorch's `torch.amp.GradScaler`.
struct ScalerSettings {
  float initial_scale = 65536.0f;  ///< S at the first step (2^16)
  float growth_factor = 2.0f;      ///< S is multiplied by this after `growth_interval` clean steps
  float backoff_factor = 0.5f;     ///< S is multiplied by this after a step that overflowed
  int growth_interval = 2000;      ///< clean steps in a row before S grows
};

/// Dynamic loss scaling with the overflow decision agreed across ranks.
///
/// The rule is GradScaler's (its `_amp_update_scale_`), for a step that overflowed on some
/// rank or on none:
///   * overflow: S = S x backoff_factor (float), the growth tracker back to 0, one more
///     skipped step;
///   * no overflow: the tracker counts one more clean step; when it reaches growth_interval,
///     S = S x growth_factor (float) unless that product is infinite (then S stays), and the
///     tracker goes back to 0.
/// The inverse scale the gradients are multiplied by is 1/S computed in double and rounded to
/// float: `(float)(1.0 / (double)S)`.
///
/// Checked: the defaults, and the sequence of S, of the tracker and of the skipped steps for
/// drawn settings and drawn overflow schedules, exactly.
class LossScaler {
 public:
  /// A scaler with `settings` (S = initial_scale, tracker 0, nothing skipped). Throws
  /// `dp::Error` unless the initial scale is finite and positive, the growth factor finite and
  /// above 1, the backoff factor in (0, 1) and the growth interval at least 1.
  explicit LossScaler(ScalerSettings settings = {});
  ~LossScaler();
  LossScaler(const LossScaler&) = delete;
  LossScaler& operator=(const LossScaler&) = delete;

  /// The current scale S, by which backward multiplies the gradient of the loss.
  float scale() const;
  /// `(float)(1.0 / (double)scale())`.
  float inverse_scale() const;
  /// Clean steps counted toward the next growth: back to 0 after an overflow and after every
  /// growth_interval-th clean step, whether S grew then or a growth to infinity was refused
  /// (S unchanged); 0 at the start.
  int growth_tracker() const;
  /// Steps skipped so far.
  std::int64_t skipped_steps() const;

  /// Collective: whether any element of `gradients` is not finite (infinite or NaN) on any
  /// rank of `comm`. Every rank must call it, once per step, and every rank returns the same
  /// answer. Exactly one collective: an all-reduce of one float32 element (the flag, or a
  /// count, of this rank's overflow) in a buffer on `device`, the device of the gradients;
  /// no other call. The views may be of any element type, on the host or on `device`.
  bool overflow_on_any_rank(Communicator& comm, std::span<const ConstTensorView> gradients,
                            Device device);
  /// After a step: the rule above, with `overflow` the answer of `overflow_on_any_rank`.
  void update(bool overflow);

 private:
  struct State;  // yours: defined in your .cpp
  std::unique_ptr<State> state_;
};

/// An optimizer for 16-bit parameters with float32 master weights: it wraps an inner float32
/// optimizer (`Sgd`, `AdamW`) whose state covers `inner->state_size()` elements.
///
/// Arithmetic of `step(params, grads, factor)`, element by element, for element i:
///   g_i = widen(grads_i) x factor            (float32: the widening is exact, one rounding)
///   the inner optimizer begins one step and updates master_i from g_i (its own arithmetic)
///   params_i = round(master_i)               (to the 16-bit type, nearest even)
/// The masters are what the optimizer steps; the 16-bit parameters are only ever rounded from
/// them (never widened back after `load_master_weights`).
///
/// Memory (`MemoryTracker`): the masters, 4 bytes per element, and the inner optimizer's
/// state, both `kOptimizerState`; nothing else held between calls except at most 4 bytes per
/// element charged to `kGradients` (a float32 gradient buffer, if your design needs one).
class MasterWeightOptimizer {
 public:
  /// Wraps `inner` for parameters of `parameter_type` (bfloat16 or float16); the masters live
  /// on `inner->device()`, zero until `load_master_weights`. Throws `dp::Error` on a null
  /// `inner` or a `parameter_type` that is not 16-bit.
  MasterWeightOptimizer(std::unique_ptr<Optimizer> inner, DataType parameter_type);
  ~MasterWeightOptimizer();
  MasterWeightOptimizer(const MasterWeightOptimizer&) = delete;
  MasterWeightOptimizer& operator=(const MasterWeightOptimizer&) = delete;

  /// masters = `params` widened exactly. `params`: `state_size()` elements of the parameter
  /// type on the optimizer's device. Throws `dp::Error` on another size, type or device.
  void load_master_weights(ConstTensorView params);
  /// One step (the arithmetic above) of `state_size()` elements. `params` is of the
  /// parameter type, `grads` of the parameter type or float32, both on the optimizer's
  /// device; `factor` is finite and positive (1/S under loss scaling, or 1). Throws
  /// `dp::Error` on another size, type or device, or a factor that is not.
  void step(TensorView params, ConstTensorView grads, float factor);

  /// Elements stepped: the inner optimizer's `state_size()`.
  std::size_t state_size() const;
  /// The float32 master weights, (state_size()).
  const Tensor& master_weights() const;
  /// The inner optimizer.
  Optimizer& inner();

 private:
  struct State;  // yours
  std::unique_ptr<State> state_;
};

/// Builds the inner float32 optimizer of one rank over its shard: called once, by the
/// constructor of `MixedZeroOne`, with the shard's size S (see below); its state lives on the
/// model's device.
using OptimizerFactory = std::function<std::unique_ptr<Optimizer>(std::size_t shard_elements)>;

/// ZeRO stage 1 over mixed precision, with dynamic loss scaling.
///
/// `model` is 16-bit (`Model::dtype()`: bfloat16 or float16, the same model on every rank).
/// The flat index space of Psi = `model.num_parameters()` elements (`Parameter::offset`) is
/// cut as lab 5 cuts it: S = ceil(Psi / N) elements per rank, rank r's shard [r S, (r+1) S),
/// the padding [Psi, N S) zero. Rank r keeps the float32 masters and the inner optimizer's
/// state of its shard only: 12 S bytes with AdamW.
///
/// A step is one `Model::backward` on the rank's batch with `loss_scale = scaler().scale()`,
/// then one `step()`, whose arithmetic is, element by element (i in rank r's shard):
///   1. s_i = the sum over ranks of the 16-bit local gradients, in their type: ReduceOp::kSum
///      of the padded flat 16-bit gradients, rank r receiving its shard (reduce-scatter);
///   2. found_inf on rank r: some s_i of its shard is not finite; the ranks agree with
///      `LossScaler::overflow_on_any_rank`'s one collective; on an overflow anywhere the step
///      is skipped on every rank: nothing of the model, the masters or the inner optimizer
///      changes (its step count neither), and `step()` returns false;
///   3. otherwise g_i = (widen(s_i) / N) x inverse_scale (float32: a division by N, then the
///      product with `scaler().inverse_scale()` as S stood during this step);
///   4. the masters of the shard take one step of the inner optimizer from g (one
///      `begin_step`, on every rank), and the 16-bit shard is rounded from them;
///   5. every rank gets every rounded shard (all-gather) and writes every parameter's value;
///   6. the scaler is updated (`LossScaler::update`) with the agreed answer, on every step.
/// Before the first step the masters are the model's initial 16-bit values widened.
///
/// Budgets, per step and rank, each checked:
///   * Communication: 1 to 4 reduce-scatters and 1 to 4 all-gathers of the 16-bit type, the
///     pieces covering the shard once each way (none on a skipped step's all-gather side),
///     and exactly one all-reduce of one float32 element for the overflow decision; nothing
///     else.
///   * Memory (`MemoryTracker`), beyond the model's own 2 Psi bytes of parameters and 2 Psi of
///     gradients, after the constructor and at every step's peak:
///       - `kOptimizerState`: exactly the masters (4 S) and the inner optimizer's state for S
///         elements (AdamW: 8 S): 12 S, the lesson;
///       - `kCommunication`: at most 2 N S + 4 (one padded 16-bit flat buffer and the flag);
///       - `kGradients`: at most 6 S (a 16-bit and a float32 shard of the gradient);
///       - `kParameters`: at most 2 S (a 16-bit shard of the parameters);
///       - `kActivations` and `kOther`: nothing.
///   * Heap: step() allocates every buffer it uses in the constructor, as Tensors; on the
///     rank's thread it takes no heap block of 1 KiB or more (a std::vector, new) and in all
///     at most what its calls and their waits take and 2 KiB to spare (lab 5's rule). Skipped
///     steps, and the constructor, are measured as the others.
///   * Parameters must be trainable: the constructor rejects a frozen one.
///
/// MixedZeroOne need not use `MasterWeightOptimizer`, and cannot reuse its buffers: they are
/// private to it, and a wrapper over the shard (4 S bytes of float32 gradient in kGradients)
/// beside a float32 gradient shard of your own would exceed the 6 S above. Write the shard's
/// step with the same arithmetic, or wrap one and keep no float32 gradient of your own.
class MixedZeroOne {
 public:
  /// Sets up ZeRO-1 for the 16-bit `model` on `comm` with a loss scaler of `scaler`. Makes
  /// the inner optimizer with `make_inner(S)`, once. Throws `dp::Error` when the model is not
  /// 16-bit, a parameter is frozen, `make_inner` is empty or returns nullptr, or its optimizer
  /// keeps state for other than S elements or on another device than the model's, or the
  /// settings are invalid (`LossScaler`). `model` and `comm` must outlive the object.
  MixedZeroOne(Model& model, Communicator& comm, OptimizerFactory make_inner,
               ScalerSettings scaler = {});
  ~MixedZeroOne();
  MixedZeroOne(const MixedZeroOne&) = delete;
  MixedZeroOne& operator=(const MixedZeroOne&) = delete;

  /// One step from the local gradients in `Parameter::grad` (left unchanged), the arithmetic
  /// above. Returns true when the parameters were updated, false when the step was skipped
  /// (the same on every rank). Every call it makes is complete on return.
  bool step();

  /// The loss scaler (its scale is the one the next backward must use).
  const LossScaler& scaler() const;
  /// This rank's float32 masters, (S): elements [r S, (r+1) S) of the flat space, padding 0.
  const Tensor& shard_master_weights() const;
  /// The optimizer `make_inner` made.
  Optimizer& inner();

 private:
  struct State;  // yours
  std::unique_ptr<State> state_;
};

/// The four data-parallel strategies of the design question.
enum class Strategy {
  kDdp,    ///< everything replicated (labs 2 and 4)
  kZero1,  ///< the optimizer state sharded (masters and moments)
  kZero2,  ///< the optimizer state and the gradients sharded
  kZero3,  ///< the optimizer state, the gradients and the parameters sharded
};

/// Design question: the bytes of model state one rank holds in mixed precision with AdamW
/// (16-bit parameters and gradients; float32 masters, first and second moments), for a model
/// of `num_parameters` elements on `world_size` ranks with `strategy`. What is sharded counts
/// S = ceil(Psi / N) elements per rank (lab 5's padding); what is replicated counts Psi. Model
/// state only: no activations, no communication buffers. Checked exactly on drawn Psi and N.
std::size_t model_state_bytes_per_rank(Strategy strategy, std::size_t num_parameters,
                                       int world_size);

/// Design question: the bytes per parameter per rank that `model_state_bytes_per_rank`
/// tends to as Psi grows, on `world_size` ranks (for DDP 16). Checked within 1e-12 relative
/// on drawn N.
double bytes_per_parameter(Strategy strategy, int world_size);

/// Design question: the largest Psi whose `model_state_bytes_per_rank` is at most
/// `budget_bytes` on `world_size` ranks (0 when not even one parameter fits). Checked exactly
/// on drawn budgets and N, budgets near the points where a formula without the padding, or
/// with float32's 4 + 4 + 8 accounting, answers otherwise.
std::size_t largest_model_that_fits(Strategy strategy, int world_size, std::size_t budget_bytes);

}  // namespace dp::lab8
