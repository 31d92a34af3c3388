// compare.h: comparisons that say where a result differs, and by how much.
//
// A check that finds a difference reports the one element that matters most (the
// parameter with the largest difference, its position, both values and the tolerance)
// and, when the whole difference is a constant factor, the factor and what usually causes
// it ("4.00x the expected: a missing 1/N?"), never a dump of vectors.
//
// Example:
//
//   const std::string finding = dp::grading::compare_parameters(model, expected, 0.0f);
//   if (!finding.empty()) verdict.fail("after step 3: " + finding);
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dp/comm.h"
#include "dp/model.h"

namespace dp::grading {

/// The position of flat element `index` of a tensor of `shape`, e.g. "[17, 3]".
std::string position_in(const std::vector<std::int64_t>& shape, std::size_t index);

/// The largest |seen[i] - expected[i]| over all i (a NaN counts as infinite).
double max_abs_difference(std::span<const float> seen, std::span<const float> expected);

/// Compares `seen` with `expected`, two arrays in `layout`'s flat parameter index space
/// (parameters, or gradients), `what` naming them ("parameter", "gradient"). Returns ""
/// when every element differs by at most `tolerance` (0: bitwise equality, where 0.0 and
/// -0.0 differ), else the element of the largest difference: "parameter fc1.weight differs:
/// max abs diff 4.1e-02 at [17, 3] (seen 0.1234, expected 0.0834); expected <= 2e-06".
/// Only elements of `parameters` (indices into layout.parameters()) are compared when it
/// is given.
std::string compare_flat(const Model& layout, std::span<const float> seen,
                         std::span<const float> expected, float tolerance, std::string_view what,
                         std::span<const std::size_t> parameters = {});

/// `compare_flat` of `model`'s parameters with `expected_flat`.
std::string compare_parameters(const Model& model, std::span<const float> expected_flat,
                               float tolerance);

/// A likely cause for a result that is `factor` times the expected one.
struct Suspect {
  double factor;          ///< e.g. 4.0 for N = 4
  std::string diagnosis;  ///< e.g. "a missing division by N = 4"
};

/// When `seen_change` is, as a whole, a multiple r != 1 of `expected_change` (the cosine
/// between them is above 0.999), a sentence giving r and the diagnosis of a suspect whose
/// factor is within 1% of it: "it is 4.00x the expected change (a missing division by N =
/// 4?)"; when r is within 0.1% of 1, a sentence suspecting a reordered or rewritten
/// arithmetic; else "". For updates, pass parameters after minus before; for gradients, the
/// gradients themselves.
std::string scale_hint(std::span<const float> seen_change, std::span<const float> expected_change,
                       const std::vector<Suspect>& suspects);

/// Each parameter's status in one sentence, "per parameter: fc1.weight 3.00x, fc1.bias
/// exact, fc2.weight differs, ...": exact (bitwise), a constant factor (cosine above 0.999),
/// or just different; frozen parameters are left out. Says at a glance whether a mistake
/// touches every parameter (a missing division) or some (a missing wait).
std::string per_parameter_summary(const Model& layout, std::span<const float> seen,
                                  std::span<const float> expected);

/// Element-wise `after - before`.
std::vector<float> difference(std::span<const float> after, std::span<const float> before);

/// Compares this rank's parameters bitwise with rank 0's (received with the runtime's
/// broadcast, so call it on every rank). Returns "" when they are identical, else the first
/// parameter and element that differ.
std::string compare_with_rank0(const Model& model, Communicator& comm);

}  // namespace dp::grading
