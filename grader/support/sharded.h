// sharded.h: what the checks of the sharded optimizers (labs 5, 6 and 7) share: the
// inner optimizer's factory, and the comparison of one step with the exact emulation.
//
// Example (one rank, after each step of a student's ZeRO optimizer):
//
//   const std::optional<float> norm = zero.step();
//   verdict.expect_empty(grading::compare_sharded_step(
//                            {.model = model, .world = world, .step = step, .before = before,
//                             .exact = exact, .norm = norm, .max_norm = max_norm,
//                             .expected_norms = norms, .norm_arithmetic = "..."}),
//                        what);
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "compare.h"
#include "dp/data.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "dp/trainer.h"
#include "grading.h"
#include "ground_truth.h"
#include "tiny_gpt.h"

namespace dp::grading {

/// One drawn training set-up of the sharded labs: the MLP 64-h1-h2-10 with GELU (LayerNorm
/// drawn), 3 to 5 steps, 2 to 6 rows of the global batch per rank, SGD or AdamW with drawn
/// settings, and its data set; or a tiny GPT on the grader's text (draw_sharded_gpt_training).
struct ShardedTraining {
  TrainOptions options;                 ///< the global set-up (global_batch: see for_world)
  std::int64_t hidden1 = 0;             ///< h1 as drawn (a lab may change options.model); a
                                        ///< GPT: its dim
  std::int64_t hidden2 = 0;             ///< h2 as drawn; a GPT: its dim
  std::int64_t rows_per_rank = 2;       ///< rows of the global batch per rank (a GPT: windows)
  std::shared_ptr<const Dataset> data;  ///< loaded once, shared by every rank

  /// True for a GPT (options.model a GPT spec, options.vocab the text's vocabulary).
  bool is_gpt() const { return is_gpt_spec(options.model); }
  /// The model in words, for notes and failures: "64-40-20-10" or "gpt:layers=2,dim=24,
  /// heads=2,context=12 (vocab 41)".
  std::string model_name() const;

  /// The options on `world` ranks: the global batch is rows_per_rank x world.
  TrainOptions for_world(int world) const;
  /// A fresh model of `options` on the check device (grading::check_device), every rank's
  /// the same.
  Model model() const;
};

/// A twin of a training's model, without ZeRO, after plain forwards and backwards of this
/// rank's first two batches (as the memory checks train two steps), and the activation bytes
/// those took at their peak: the most the ZeRO memory checks let the lab's model hold in
/// activations. The twin stays alive (its loss
/// keeps a row of logits per sample), so a check counts the lab's activations from the
/// tracker's current bytes after this call.
struct PlainTwin {
  Model model;                       ///< the twin, its forward's saved logits still held
  std::size_t activation_bytes = 0;  ///< its forward and backward's peak activations
};

/// Runs the twin of `training`'s model on `world` ranks' batches 0 and 1 of this rank (the
/// tracker's peaks are reset first: they count from here).
PlainTwin plain_twin(const ShardedTraining& training, int world, const Communicator& comm);

/// Draws a `ShardedTraining` with `optimizer` ("sgd" or "adamw"): h1 in [24, 72], h2 in
/// [12, 40], then LayerNorm, samples, seed, steps, the optimizer's settings and the rows
/// per rank, in that order.
ShardedTraining draw_sharded_training(Draws& draws, const std::string& optimizer);

/// Draws a tiny GPT `ShardedTraining` with `optimizer` ("sgd" or "adamw"): layers in [1, 2],
/// dim 2 x [8, 16] with 2 heads, context in [8, 16], then the text's length (a prefix of
/// `grader_text()` of 900 to all its characters, cut into windows of the context), seed,
/// steps, the optimizer's settings and 2 to 4 windows per rank, in that order. The draws
/// end with a section naming the spec, the vocabulary and the windows (a failure's "drawn:"
/// line says what model it was). options.vocab is the text's vocabulary, so that make_model
/// and the ground truth build the same GPT.
ShardedTraining draw_sharded_gpt_training(Draws& draws, const std::string& optimizer);

/// The second phase of a check that ran AdamW on `first`: SGD with momentum 0.9, drawn
/// afresh (samples, seed, steps, settings) but on `first`'s model (its hidden sizes, layer
/// norm and spec), the draws overruled to say so. SGD's momentum buffer is optimizer state
/// under another name than AdamW's, so a check that saves or shards state runs both.
ShardedTraining sgd_with_momentum_on_the_same_model(Draws& draws, const ShardedTraining& first);

/// The training the design questions of labs 6 and 7 measure: the MLP `spec` with ReLU and
/// `layer_norm`, weights of seed 3, AdamW (lr 0.01, no weight decay), one step on `world`
/// ranks of 4 rows each of design_data(). Their checks compare every rank's parameters
/// after that step with emulate_data_parallel's on it: they read the tracker's peaks, and
/// a design could otherwise give up the arithmetic on the models only they build.
TrainOptions design_training(const std::string& spec, bool layer_norm, int world);

/// The design questions' data set: synthetic:128 (lab 6's accumulation design question
/// takes 4 rows per rank in each of up to 4 micro-batches on up to 6 ranks), seed 5, loaded
/// once and shared by every rank (read-only).
const Dataset& design_data();

/// The contract's clipping arithmetic of the sharded labs, applied to the averaged flat
/// gradient `g`: rank r's partial squared norm is dp::dot's (double, in index order) over
/// the elements `real_by_rank[r]` lists (flat indices of its shard's real elements, in
/// shard order), rounded to float; the partials are summed in float in rank order; the
/// norm is their float sqrt; when max_norm / (norm + 1e-6) is below 1, `g` is scaled by it.
/// Returns the norm.
float clip_by_sharded_norm(std::vector<float>& g,
                           const std::vector<std::vector<std::size_t>>& real_by_rank,
                           float max_norm);

/// Lab 2's arithmetic on `world` ranks with the contract's clipping before each step
/// (clip_by_sharded_norm over `real_by_rank`): what a sharded optimizer with clipping must
/// produce bitwise, and how far its norms are from the double-precision norm.
struct ClippedTrajectory {
  Trajectory exact;           ///< parameters (and gradients) after every step
  std::vector<float> norms;   ///< the norm of every step, as step() must return it
  int clipped_steps = 0;      ///< steps whose coefficient was below 1
  double worst_relative = 0;  ///< largest |norm - double-precision norm| / that norm
};

/// Emulates `options` on `world` ranks with clipping at `max_norm` (see ClippedTrajectory).
ClippedTrajectory emulate_clipped(const TrainOptions& options, const Dataset& data, int world,
                                  const std::vector<std::vector<std::size_t>>& real_by_rank,
                                  float max_norm);

/// The factory a ZeRO optimizer calls once with its shard's size: the optimizer `options`
/// names (with grading::optimizer_for's settings) over that many elements, its state on the
/// check device, where the lab code's shards live.
std::function<std::unique_ptr<Optimizer>(std::size_t)> shard_optimizer_factory(
    const TrainOptions& options);

/// Checks that a ZeRO optimizer's constructor refuses an inner optimizer whose state lives on
/// another device than the model's (labs 5, 6 and 7 promise it; a student trial left the
/// test out and kept full marks). `construct` builds the lab's optimizer with the factory
/// it is given, which makes plain SGD on the device the model (on `model_device`) is not
/// on: plain SGD keeps no state tensor, so it can be made for a CUDA device on a machine
/// without one. The constructor must throw dp::Error whose message names both devices
/// ("host" and "cuda", in any case); anything else fails `verdict`. A NotImplemented of the
/// skeleton passes through.
void expect_inner_optimizer_elsewhere_refused(
    Verdict& verdict, Device model_device,
    const std::function<void(const std::function<std::unique_ptr<Optimizer>(std::size_t)>&)>&
        construct);

/// An optimizer that passes every update on to `inner`, on inner's device, and records the
/// (offset, elements) of each: how labs 6 and 7 see that a step is one update over the whole
/// shard. (grading::RecordingOptimizer also records the gradients, on the host only.)
class UpdateRecorder final : public Optimizer {
 public:
  /// Steps `inner`; its state stays where it lives.
  explicit UpdateRecorder(std::unique_ptr<Optimizer> inner);
  std::string_view name() const override { return inner_->name(); }
  void begin_step() override;
  using Optimizer::update;  // the update on views
  void update(std::size_t offset, std::span<float> params, std::span<const float> grads) override;
  OpCost update_cost(std::size_t elements) const override { return inner_->update_cost(elements); }
  std::vector<OptimizerState> state() override { return inner_->state(); }

  /// The updates of the latest step: (offset, elements) of each call, in call order.
  const std::vector<std::pair<std::size_t, std::size_t>>& last_updates() const {
    return last_updates_;
  }

 protected:
  /// A device update: recorded, then inner's update on the same device memory.
  void update_on_device(std::size_t offset, float* params, const float* grads,
                        std::size_t n) override;

 private:
  std::unique_ptr<Optimizer> inner_;
  std::vector<std::pair<std::size_t, std::size_t>> last_updates_;
};

/// `batch` with its inputs moved to the check device (the host copy released, so that a
/// rank holds the same activation bytes on either device); the labels stay on the host,
/// where backward takes them.
Batch on_check_device(Batch batch);

/// `model.forward` of `batch`'s inputs, copied first to the check device when that is not
/// the host (forward takes its input where the parameters live; the labels stay on the host).
Tensor forward(Model& model, const Batch& batch);

/// The elements of `tensor` on the host, a copy wherever it lives (charged to no
/// MemoryTracker account): how the checks read what lab code leaves on the check device.
std::vector<float> host_values(const Tensor& tensor);
/// The same for a view, e.g. a communication buffer's elements.
std::vector<float> host_values(ConstTensorView elements);

/// The scale mistakes of the averaging on `world` ranks: no division by N, or two.
std::vector<Suspect> division_suspects(int world);

/// One step of a sharded optimizer on one rank, as `compare_sharded_step` judges it.
struct ShardedStep {
  const Model& model;                     ///< the rank's model after the step
  int world = 1;                          ///< N
  int step = 1;                           ///< 1 for the first step
  std::span<const float> before;          ///< the flat parameters before the step
  const Trajectory& exact;                ///< the emulation: parameters after every step
  std::optional<float> norm;              ///< what step() returned
  float max_norm = 0;                     ///< 0: clipping off
  std::span<const float> expected_norms;  ///< by step, with clipping on
  /// How the contract computes the norm, for the message ("over the averaged shards").
  std::string_view norm_arithmetic;
};

/// "" when the step is exact, else the first finding: a norm returned with clipping off
/// or missing with it on, a norm that is not bitwise the expected one (with a hint when it
/// is N times it), then parameters that are not bitwise the emulation's (with the
/// differing parameters and a hint when the change is a multiple of the expected one).
std::string compare_sharded_step(const ShardedStep& step);

}  // namespace dp::grading
