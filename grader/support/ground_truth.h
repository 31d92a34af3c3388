// ground_truth.h: what a data-parallel run must produce, computed in one process.
//
// Two references, for two kinds of check:
//
//   single_process_trajectory   one process trained on the whole global batch: the
//                               lesson of data parallelism. N ranks match it only up to
//                               float32 rounding, because they add the same terms in
//                               another order, so checks compare with a tolerance.
//   emulate_data_parallel       exactly the arithmetic lab 2's contract fixes, done in one
//                               process: each rank's local gradient (its rows of the global
//                               batch, optionally in k micro-batches with loss scale 1/k),
//                               summed over ranks in rank order ((g0 + g1) + g2) + ... as
//                               ReduceOp::kSum adds, divided by N, then the optimizer step.
//                               A correct lab reproduces it bit for bit, so checks compare
//                               bitwise: any lost precision, reordering or wrong scale fails.
//
// The references compute on the check device (grading::check_device), as the lab code
// they are compared with does, and return host vectors: on a GPU the same arithmetic on
// the same device gives the same bits, so the bitwise checks hold there too.
//
// Example:
//
//   const Trajectory exact = emulate_data_parallel(options, data, /*world_size=*/3);
//   ... after step s of the student's run on 3 ranks:
//   verdict.expect_empty(compare_parameters(model, exact.parameters_after_step[s - 1], 0),
//                        "after step s");
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dp/data.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "dp/trainer.h"
#include "grading.h"

namespace dp::grading {

/// A reference run: the parameters after every step and the gradients each step applied.
struct Trajectory {
  /// `Model::flat_parameters()` after step 1, 2, ..., steps.
  std::vector<std::vector<float>> parameters_after_step;
  /// The gradient the optimizer applied at step 1, 2, ... (flat, frozen parameters 0).
  std::vector<std::vector<float>> gradients_of_step;
  /// The largest |gradient| applied.
  float max_abs_gradient = 0;
  /// Emulated runs: per step, per rank, the mean of the rank's micro-batch losses (their
  /// sum in order, divided by k in float).
  std::vector<std::vector<float>> rank_losses;
};

/// Trains `make_model(options)` in one process for `options.steps` steps, each on the
/// global batch `global_batch_indices(..., step, options.seed)`, with `frozen` parameters
/// frozen.
Trajectory single_process_trajectory(const TrainOptions& options, const Dataset& data,
                                     std::span<const std::string> frozen = {});

/// The same training as `world_size` data-parallel ranks compute it (see the top of this
/// file): rank r's rows [r B/N, (r+1) B/N) of each global batch, cut into `micro_batches`
/// equal micro-batches whose losses are scaled by 1/k, gradients summed in rank order and
/// divided by N. `options.global_batch` must be a multiple of world_size * micro_batches.
Trajectory emulate_data_parallel(const TrainOptions& options, const Dataset& data, int world_size,
                                 std::span<const std::string> frozen = {}, int micro_batches = 1);

/// Adds the ranks' local gradients (flat, one per rank, in rank order) into the sum that a
/// data-parallel step divides by N, in the order of additions some algorithm fixes.
using GradientSum = std::function<std::vector<float>(const std::vector<std::vector<float>>&)>;

/// ((g_0 + g_1) + g_2) + ...: the order `ReduceOp::kSum` adds in, and lab 2's.
std::vector<float> sum_in_rank_order(const std::vector<std::vector<float>>& local);

/// What varies between the data-parallel arithmetics the labs fix.
struct Emulation {
  std::span<const std::string> frozen = {};  ///< parameters frozen throughout
  int micro_batches = 1;                     ///< k micro-batches per rank, losses scaled by 1/k
  GradientSum sum = sum_in_rank_order;       ///< how the N local gradients are added
  /// s: the local gradients of step t (0-based) are computed at the parameters after
  /// max(0, t - s) steps (a parameter server with bounded staleness); 0 is synchronous.
  int staleness = 0;
  /// Called with the step (0-based) and the averaged flat gradient of the step, after the
  /// division by N and before the optimizer step, which applies the gradient as this leaves
  /// it (lab 5's clipping). Empty: the gradient is applied as it is.
  std::function<void(int step, std::vector<float>& averaged)> before_step = nullptr;
  /// Called with the step (0-based) and the optimizer (over the whole flat space) after the
  /// step's update: to read its state tensors at that step (a checkpoint's contents).
  std::function<void(int step, Optimizer& optimizer)> after_step = nullptr;
  /// A run resumed from a checkpoint on another world size: from step `resume_step`
  /// (0-based) on, the steps run on `resume_world` ranks with a global batch of
  /// `resume_global_batch` rows. The optimizer's update is element-wise, so the state a
  /// resharded load restores continues exactly as this one optimizer over the whole flat
  /// space does. Negative: the whole run on `world_size` ranks.
  int resume_step = -1;
  int resume_world = 0;                  ///< M: the ranks after the resume
  std::int64_t resume_global_batch = 0;  ///< the global batch after the resume
};

/// `emulate_data_parallel` with the sum's order and the staleness of `how`.
Trajectory emulate_data_parallel(const TrainOptions& options, const Dataset& data, int world_size,
                                 const Emulation& how);

/// The gradient one process computes on the whole global batch of `step` at `parameters`
/// (flat, frozen parameters 0): what the averaged gradient of a data-parallel step taken
/// from the same parameters must equal up to float32 rounding.
std::vector<float> global_batch_gradient(const TrainOptions& options, const Dataset& data, int step,
                                         std::span<const float> parameters,
                                         std::span<const std::string> frozen = {});

/// Rank `rank`'s slice of the global batch of `step`: rows [rank B/N, (rank+1) B/N) of
/// `global_batch_indices` (B = options.global_batch, N = world_size), as a batch.
Batch local_batch(const Dataset& data, const TrainOptions& options, int step, int rank,
                  int world_size);

/// Rank `rank`'s slice of the global batch of `step`, cut in order into `count` equal
/// micro-batches.
std::vector<Batch> micro_batches(const Dataset& data, const TrainOptions& options, int step,
                                 int rank, int world_size, int count);

/// Lab 2's flat gradient averaging, the grader's own copy, for the labs measured against
/// it: copies every gradient into `flat` (model.num_parameters() elements) at its
/// `Parameter::offset`, all-reduces `flat` with one call, divides by N and copies back.
/// Frozen parameters ride along (their gradients are 0), as in lab 2's reference. `flat`
/// lives on the model's device.
void average_gradients_flat(Model& model, Communicator& comm, Tensor& flat);

/// An optimizer that records what it is given and passes it on: the gradients of every
/// parameter it updates (in the model's flat index space) and how many steps it took. The
/// checks hand it to lab code that steps the optimizer itself, to see the gradients the
/// step really used. It lives on `inner`'s device and records device gradients too.
class RecordingOptimizer final : public Optimizer {
 public:
  /// Records for a model of `num_parameters` elements and steps `inner`.
  RecordingOptimizer(std::unique_ptr<Optimizer> inner, std::size_t num_parameters);
  std::string_view name() const override { return inner_->name(); }
  void begin_step() override;
  void update(std::size_t offset, std::span<float> params, std::span<const float> grads) override;
  using Optimizer::update;  // the update on views
  OpCost update_cost(std::size_t elements) const override { return inner_->update_cost(elements); }
  std::vector<OptimizerState> state() override { return inner_->state(); }

  /// The gradients of the latest step (flat; parameters it did not update: 0).
  const std::vector<float>& last_gradients() const { return last_gradients_; }
  /// The updates of the latest step: (offset, elements) of each call, in call order.
  const std::vector<std::pair<std::size_t, std::size_t>>& last_updates() const {
    return last_updates_;
  }
  /// Steps begun so far.
  std::int64_t steps() const { return step_count(); }

 protected:
  /// Records device gradients through a copy to the host, then updates with `inner`.
  void update_on_device(std::size_t offset, float* params, const float* grads,
                        std::size_t n) override;

 private:
  std::unique_ptr<Optimizer> inner_;
  std::vector<float> last_gradients_;
  std::vector<std::pair<std::size_t, std::size_t>> last_updates_;
};

/// Sets `options`' optimizer to "sgd" or "adamw" with drawn settings: SGD lr in [0.02, 0.1)
/// and momentum 0 or 0.9; AdamW lr in [5e-4, 3e-3) and weight decay 0.01.
void draw_optimizer(Draws& draws, const std::string& optimizer, TrainOptions& options);

/// `make_optimizer` with the settings of `options`, for a model of `num_parameters`, its
/// state on the check device (grading::check_device), where the checks' models live.
std::unique_ptr<Optimizer> optimizer_for(const TrainOptions& options, std::size_t num_parameters);

/// `make_model(options)` with its parameters on the check device (grading::check_device):
/// the models the checks hand to lab code.
Model make_check_model(TrainOptions options);

}  // namespace dp::grading
