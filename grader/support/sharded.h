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
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "compare.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "dp/trainer.h"
#include "ground_truth.h"

namespace dp::grading {

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
