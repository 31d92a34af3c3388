// exposure_formulas.h: the answer to lab 5's second design question
// (predicted_exposed_communication_seconds) and its plausible wrong answers, for
// grader/lab5_zero1/checks.cpp (instructors only: the student release leaves this folder out,
// since the right formula is the answer and each wrong one is the right one with one term
// changed).
//
// The check compares a prediction with the seconds the simulated clock blocks; the right
// formula verifies that clock (a grader bug where they differ), and the wrong ones name the
// mistake when a prediction that misses equals one of them; the check fails as a grader bug
// when its draws never put one of them far enough from the right one (the selftests' planted
// bugs design_exposes_* are these formulas). Included by checks.cpp after ExposureCase and
// ExposureFormulas, in its anonymous namespace.
#pragma once

/// The seconds a reduce-scatter after backward and an all-gather after the update block for
/// `c` by dp/clock.h's ring, 2 (N-1) (alpha + 4 S / bandwidth), and the plausible wrong
/// formulas for it.
inline std::optional<ExposureFormulas> exposure_formulas(const ExposureCase& c) {
  const double n = c.world;
  const double s = static_cast<double>(contract_partition(c.psi, c.world).shard_elements);
  const double alpha = c.link.alpha_seconds;
  const double bandwidth = c.link.bytes_per_second;
  const double shard_time = 4 * s / bandwidth;
  const double tree_rounds = std::ceil(std::log2(n));
  ExposureFormulas formulas;
  formulas.right_seconds = 2 * (n - 1) * (alpha + shard_time);
  formulas.wrong = {
      {"lab 4's: the collectives hidden behind backward (nothing exposed)", 0.0},
      {"latency left out: 2 (N-1) 4 S / bandwidth", 2 * (n - 1) * shard_time},
      {"N rounds instead of N - 1", 2 * n * (alpha + shard_time)},
      {"one collective: the reduce-scatter (or the all-gather) alone",
       (n - 1) * (alpha + shard_time)},
      {"DDP's all-reduce and the all-gather: 1.5 times the bytes",
       3 * (n - 1) * (alpha + shard_time)},
      {"a tree's latency, 2 ceil(lg N) alpha", 2 * (tree_rounds * alpha + (n - 1) * shard_time)},
      {"the whole flat buffer in every round", 2 * (n - 1) * (alpha + n * shard_time)},
  };
  return formulas;
}
