// design_formulas.h: the reference design's answers to lab 7's two design questions
// (predicted_parameter_peak_bytes, predicted_keep_gathered_extra_bytes) and their plausible
// wrong answers, for grader/lab7_zero3/checks.cpp (instructors only: the student release
// leaves this folder out, since each answer is the reference's and each wrong one is that
// answer with one buffer, one padding or one term changed).
//
// The checks compare a prediction with the student's own optimizer's peaks; these name the
// mistake when a prediction that misses equals one of them (named_near_miss), and the checks
// fail as a grader bug when their draws never tell one of them from the reference's answer
// (FormulaSeparation; the selftests' planted bugs design_* and predicts_* are these formulas).
// Included by checks.cpp after WrongFormula and the contract's unit helpers, in its anonymous
// namespace.
#pragma once

/// The reference design (solutions/): one gather buffer and min(2, U) gradient buffers.
inline constexpr std::size_t kReferenceGatherBuffers = 1;
inline constexpr std::size_t kReferenceGradientBuffers = 2;

/// Bytes of the reference design's buffers: one gather buffer and min(2, U) gradient
/// buffers of 4 max_u N C_u bytes each.
inline std::size_t reference_buffer_bytes(const std::vector<Unit>& units, int world) {
  return (kReferenceGatherBuffers + std::min(kReferenceGradientBuffers, units.size())) * 4 *
         largest_padded_unit(units, world);
}

/// The design question's answer for the reference design (one gather buffer, min(2, U)
/// gradient buffers), 4 S + 4 max_u E_u + (1 + min(2, U)) x 4 max_u(N C_u), and the
/// plausible wrong formulas for it, for `model` on `world` ranks. The check compares each
/// prediction with the student's own optimizer's peaks; these tell whether the draws can
/// catch a wrong formula, and name the one a wrong prediction matches.
inline std::pair<std::size_t, std::vector<WrongFormula>> design_formulas(Model& model, int world) {
  const std::vector<Unit> units = contract_units(model, world);
  const auto n = static_cast<std::size_t>(world);
  const std::size_t shard = 4 * contract_shard(units);
  const std::size_t values = 4 * largest_unit(units);
  const std::size_t buffers = reference_buffer_bytes(units, world);
  const std::size_t count =
      kReferenceGatherBuffers + std::min(kReferenceGradientBuffers, units.size());
  const std::size_t buffer = buffers / count;  // 4 max_u N C_u
  const std::size_t psi = model.num_parameters();
  return {
      shard + values + buffers,
      {
          {"two gradient buffers whatever the number of units (one unit needs one)",
           shard + values + (kReferenceGatherBuffers + kReferenceGradientBuffers) * buffer},
          {"no gradient buffers", shard + values + kReferenceGatherBuffers * buffer},
          {"two gather buffers", shard + values + (count + 1) * buffer},
          {"lab 5's shard, ceil(Psi / N), instead of the sum of the units' chunks",
           4 * ((psi + n - 1) / n) + values + buffers},
          {"buffers of max_u E_u elements, without the padding to N C_u",
           shard + values + count * values},
          {"two units' values at once (the prefetched unit's too)", shard + 2 * values + buffers},
          {"without the shard", values + buffers},
      }};
}

/// The reshard design question's answer for the reference design (values kept, the same
/// buffers in both modes), 4 (Psi - max_u E_u), and the plausible wrong formulas for it.
inline std::pair<std::size_t, std::vector<WrongFormula>> keep_formulas(Model& model, int world) {
  const std::vector<Unit> units = contract_units(model, world);
  const std::size_t psi = model.num_parameters();
  const std::size_t largest = largest_unit(units);
  return {4 * (psi - largest),
          {
              {"the whole model's values, 4 Psi (the unit the resharding peak holds counted again)",
               4 * psi},
              {"every unit padded, 4 (sum_u N C_u - max_u N C_u) (values are the parameters' own "
               "tensors, without the padding)",
               4 * (padded_units(units, world) - largest_padded_unit(units, world))},
              {"two units' values at the resharding peak, 4 (Psi - E_(1) - E_(2))",
               4 * (psi - two_largest_units(units))},
          }};
}
