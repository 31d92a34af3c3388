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
#include <vector>

#include "compare.h"
#include "dp/data.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "dp/trainer.h"
#include "grading.h"
#include "ground_truth.h"

namespace dp::grading {

/// One drawn training set-up of the sharded labs: the MLP 64-h1-h2-10 with GELU (LayerNorm
/// drawn), 3 to 5 steps, 2 to 6 rows of the global batch per rank, SGD or AdamW with drawn
/// settings, and its data set.
struct ShardedTraining {
  TrainOptions options;                 ///< the global set-up (global_batch: see for_world)
  std::int64_t hidden1 = 0;             ///< h1 as drawn (a lab may change options.model)
  std::int64_t hidden2 = 0;             ///< h2 as drawn
  std::int64_t rows_per_rank = 2;       ///< rows of the global batch per rank
  std::shared_ptr<const Dataset> data;  ///< loaded once, shared by every rank

  /// The options on `world` ranks: the global batch is rows_per_rank x world.
  TrainOptions for_world(int world) const;
  /// A fresh model of `options`, every rank's the same.
  Model model() const { return make_model(options); }
};

/// Draws a `ShardedTraining` with `optimizer` ("sgd" or "adamw"): h1 in [24, 72], h2 in
/// [12, 40], then LayerNorm, samples, seed, steps, the optimizer's settings and the rows
/// per rank, in that order.
ShardedTraining draw_sharded_training(Draws& draws, const std::string& optimizer);

/// The second phase of a check that ran AdamW on `first`: SGD with momentum 0.9, drawn
/// afresh (samples, seed, steps, settings) but on `first`'s model (its hidden sizes, layer
/// norm and spec), the draws overruled to say so. SGD's momentum buffer is optimizer state
/// under another name than AdamW's, so a check that saves or shards state runs both.
ShardedTraining sgd_with_momentum_on_the_same_model(Draws& draws, const ShardedTraining& first);

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
/// names (grading::optimizer_for) over that many elements.
std::function<std::unique_ptr<Optimizer>(std::size_t)> shard_optimizer_factory(
    const TrainOptions& options);

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
