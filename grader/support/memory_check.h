// memory_check.h: the rank's MemoryTracker read category by category, and the sentence a
// check fails with when a contract's per-category rule does not hold. A total hides a
// buffer charged to the wrong category; a per-category comparison names it.
//
// Example (one rank, around the constructor of a student's optimizer):
//
//   const grading::CategoryBytes before = grading::current_bytes(tracker);
//   ZeroOneOptimizer zero(model, comm, factory);
//   grading::CategoryBytes expected;
//   expected[MemoryCategory::kCommunication] = 4 * p.padded_elements;
//   const std::string differs = grading::category_differences(
//       grading::current_bytes(tracker) - before, expected);
//   if (!differs.empty()) verdict.fail("after the constructor: " + differs);
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dp/memory.h"
#include "dp/optimizer.h"

namespace dp::grading {

/// Bytes per `MemoryCategory`, signed: what a rank holds, or what it gained (or released)
/// since a snapshot.
struct CategoryBytes {
  std::array<std::int64_t, kNumMemoryCategories> bytes{};

  /// The bytes of `category`.
  std::int64_t& operator[](MemoryCategory category) {
    return bytes[static_cast<std::size_t>(category)];
  }
  /// The bytes of `category` (read-only).
  std::int64_t operator[](MemoryCategory category) const {
    return bytes[static_cast<std::size_t>(category)];
  }
  /// Category by category: `*this` minus `base`.
  CategoryBytes operator-(const CategoryBytes& base) const {
    CategoryBytes difference;
    for (std::size_t c = 0; c < kNumMemoryCategories; ++c)
      difference.bytes[c] = bytes[c] - base.bytes[c];
    return difference;
  }
  /// The sum over every category.
  std::int64_t total() const {
    std::int64_t sum = 0;
    for (const std::int64_t b : bytes) sum += b;
    return sum;
  }
};

/// Every category's `MemoryTracker::current`.
inline CategoryBytes current_bytes(const MemoryTracker& tracker) {
  CategoryBytes now;
  for (std::size_t c = 0; c < kNumMemoryCategories; ++c)
    now.bytes[c] = static_cast<std::int64_t>(tracker.current(static_cast<MemoryCategory>(c)));
  return now;
}

/// Every category's `MemoryTracker::peak` (since the last `reset_peaks`).
inline CategoryBytes peak_bytes(const MemoryTracker& tracker) {
  CategoryBytes peak;
  for (std::size_t c = 0; c < kNumMemoryCategories; ++c)
    peak.bytes[c] = static_cast<std::int64_t>(tracker.peak(static_cast<MemoryCategory>(c)));
  return peak;
}

/// The categories where `seen` is not `expected`, each with both byte counts, e.g.
/// "communication 0 bytes, expected 4096; activations 4096 bytes, expected 0 (a buffer of
/// 4096 bytes charged to activations instead of communication?)"; "" when every category
/// is as expected.
inline std::string category_differences(const CategoryBytes& seen, const CategoryBytes& expected) {
  std::vector<std::string> differing;
  std::vector<MemoryCategory> over;
  std::vector<MemoryCategory> under;
  for (std::size_t c = 0; c < kNumMemoryCategories; ++c) {
    if (seen.bytes[c] == expected.bytes[c]) continue;
    const auto category = static_cast<MemoryCategory>(c);
    differing.push_back(fmt::format("{} {} bytes, expected {}", to_string(category), seen.bytes[c],
                                    expected.bytes[c]));
    (seen.bytes[c] > expected.bytes[c] ? over : under).push_back(category);
  }
  if (differing.empty()) return "";
  std::string sentence = fmt::format("{}", fmt::join(differing, "; "));
  // One category over by what another is under: the same bytes, charged to the wrong one.
  if (over.size() == 1 && under.size() == 1 &&
      seen[over[0]] - expected[over[0]] == expected[under[0]] - seen[under[0]])
    sentence +=
        fmt::format(" (a buffer of {} bytes charged to {} instead of {}?)",
                    seen[over[0]] - expected[over[0]], to_string(over[0]), to_string(under[0]));
  return sentence;
}

/// The bytes of `optimizer`'s state tensors (`Optimizer::state`): what it holds under
/// `MemoryCategory::kOptimizerState`, read from the optimizer the grader's factory made.
inline std::int64_t state_bytes(Optimizer& optimizer) {
  std::int64_t bytes = 0;
  for (const OptimizerState& state : optimizer.state())
    bytes += static_cast<std::int64_t>(4 * state.tensor->size());
  return bytes;
}

/// The categories with bytes, e.g. "parameters 4096, communication 8192" ("nothing" when
/// none): what a check measured, for its note.
inline std::string describe_bytes(const CategoryBytes& bytes) {
  std::vector<std::string> parts;
  for (std::size_t c = 0; c < kNumMemoryCategories; ++c)
    if (bytes.bytes[c] != 0)
      parts.push_back(
          fmt::format("{} {}", to_string(static_cast<MemoryCategory>(c)), bytes.bytes[c]));
  return parts.empty() ? std::string("nothing") : fmt::format("{}", fmt::join(parts, ", "));
}

}  // namespace dp::grading
