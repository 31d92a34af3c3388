#include "compare.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "dp/host_collectives.h"

namespace dp::grading {
namespace {

/// |a - b| with a NaN (or an infinite difference) counted as infinite.
double abs_difference(float a, float b) {
  const double diff = std::abs(static_cast<double>(a) - static_cast<double>(b));
  return std::isnan(diff) ? std::numeric_limits<double>::infinity() : diff;
}

bool bitwise_equal(float a, float b) {
  return std::memcmp(&a, &b, sizeof(float)) == 0;
}

}  // namespace

std::string position_in(const std::vector<std::int64_t>& shape, std::size_t index) {
  std::vector<std::int64_t> position(shape.size());
  auto remaining = static_cast<std::int64_t>(index);
  for (std::size_t d = shape.size(); d-- > 0;) {
    position[d] = shape[d] > 0 ? remaining % shape[d] : 0;
    remaining = shape[d] > 0 ? remaining / shape[d] : 0;
  }
  return fmt::format("[{}]", fmt::join(position, ", "));
}

double max_abs_difference(std::span<const float> seen, std::span<const float> expected) {
  double largest = 0;
  for (std::size_t i = 0; i < std::min(seen.size(), expected.size()); ++i)
    largest = std::max(largest, abs_difference(seen[i], expected[i]));
  return largest;
}

std::string compare_flat(const Model& layout, std::span<const float> seen,
                         std::span<const float> expected, float tolerance, std::string_view what,
                         std::span<const std::size_t> parameters) {
  if (seen.size() != layout.num_parameters() || expected.size() != layout.num_parameters())
    return fmt::format("{} arrays of {} and {} elements; expected the model's {}", what,
                       seen.size(), expected.size(), layout.num_parameters());
  // The parameter whose largest difference is largest: that is where to look first.
  const Parameter* worst = nullptr;
  std::size_t worst_index = 0;
  double worst_diff = -1;
  const auto all = layout.parameters();
  for (std::size_t p = 0; p < all.size(); ++p) {
    if (!parameters.empty() &&
        std::find(parameters.begin(), parameters.end(), p) == parameters.end())
      continue;
    const Parameter* parameter = all[p];
    for (std::size_t i = 0; i < parameter->value.size(); ++i) {
      const std::size_t flat = parameter->offset + i;
      const double diff = abs_difference(seen[flat], expected[flat]);
      const bool differs =
          tolerance == 0 ? !bitwise_equal(seen[flat], expected[flat]) : diff > tolerance;
      if (differs && diff > worst_diff) {
        worst = parameter;
        worst_index = i;
        worst_diff = diff;
      }
    }
  }
  if (worst == nullptr) return "";
  const std::size_t flat = worst->offset + worst_index;
  return fmt::format(
      "{} {} differs: max abs diff {:.2e} at {} (seen {:.9g}, expected {:.9g}); expected {}", what,
      worst->name, worst_diff, position_in(worst->value.shape(), worst_index), seen[flat],
      expected[flat],
      tolerance == 0 ? std::string("bitwise equality") : fmt::format("<= {:.2e}", tolerance));
}

std::string compare_parameters(const Model& model, std::span<const float> expected_flat,
                               float tolerance) {
  const std::vector<float> seen = model.flat_parameters();
  return compare_flat(model, seen, expected_flat, tolerance, "parameter");
}

std::string scale_hint(std::span<const float> seen_change, std::span<const float> expected_change,
                       const std::vector<Suspect>& suspects) {
  if (seen_change.size() != expected_change.size()) return "";
  double seen_dot_expected = 0;
  double expected_norm2 = 0;
  double seen_norm2 = 0;
  for (std::size_t i = 0; i < seen_change.size(); ++i) {
    const double s = seen_change[i];
    const double e = expected_change[i];
    if (!std::isfinite(s)) return "";  // garbage, not a scale: the values say more
    seen_dot_expected += s * e;
    expected_norm2 += e * e;
    seen_norm2 += s * s;
  }
  if (expected_norm2 == 0 || seen_norm2 == 0) return "";
  const double cosine = seen_dot_expected / std::sqrt(expected_norm2 * seen_norm2);
  if (cosine < 0.999) return "";
  const double ratio = seen_dot_expected / expected_norm2;
  if (std::abs(ratio - 1.0) < 1e-3)
    return "it is the expected change to within 0.1%: the same arithmetic in another form or "
           "order (x * (1/N) instead of x / N, another order of the sum, a constant changed), "
           "or, with AdamW, gradients off by a factor (its update hardly depends on their "
           "scale: a division before the last wait, or none, looks like this)";
  for (const Suspect& suspect : suspects)
    if (std::abs(ratio / suspect.factor - 1.0) < 0.01)
      return fmt::format("it is {:.2f}x the expected change ({}?)", ratio, suspect.diagnosis);
  return fmt::format("it is {:.3g}x the expected change", ratio);
}

std::string per_parameter_summary(const Model& layout, std::span<const float> seen,
                                  std::span<const float> expected) {
  if (seen.size() != layout.num_parameters() || expected.size() != layout.num_parameters())
    return "";
  std::vector<std::string> parts;
  for (const Parameter* parameter : layout.parameters()) {
    if (parameter->frozen) continue;
    const std::span<const float> mine = seen.subspan(parameter->offset, parameter->value.size());
    const std::span<const float> theirs =
        expected.subspan(parameter->offset, parameter->value.size());
    if (std::memcmp(mine.data(), theirs.data(), mine.size_bytes()) == 0) {
      parts.push_back(parameter->name + " exact");
      continue;
    }
    double dot = 0;
    double norm_mine = 0;
    double norm_theirs = 0;
    for (std::size_t i = 0; i < mine.size(); ++i) {
      dot += static_cast<double>(mine[i]) * theirs[i];
      norm_mine += static_cast<double>(mine[i]) * mine[i];
      norm_theirs += static_cast<double>(theirs[i]) * theirs[i];
    }
    const bool scaled = norm_theirs > 0 && norm_mine > 0 && std::isfinite(norm_mine) &&
                        dot / std::sqrt(norm_mine * norm_theirs) > 0.999;
    const double ratio = scaled ? dot / norm_theirs : 0;
    parts.push_back(scaled && std::abs(ratio - 1) > 1e-3
                        ? fmt::format("{} {:.2f}x", parameter->name, ratio)
                        : parameter->name + " differs");
  }
  return fmt::format("per parameter: {}", fmt::join(parts, ", "));
}

std::vector<float> difference(std::span<const float> after, std::span<const float> before) {
  std::vector<float> change(std::min(after.size(), before.size()));
  for (std::size_t i = 0; i < change.size(); ++i) change[i] = after[i] - before[i];
  return change;
}

std::string compare_with_rank0(const Model& model, Communicator& comm) {
  std::vector<float> mine = model.flat_parameters();
  std::vector<float> rank0 = mine;
  broadcast_host_values(std::span<float>(rank0), 0, comm);
  for (const Parameter* parameter : model.parameters()) {
    for (std::size_t i = 0; i < parameter->value.size(); ++i) {
      const std::size_t flat = parameter->offset + i;
      // Bitwise: two NaNs with equal bits are equal replicas, 0.0 and -0.0 are not.
      if (!bitwise_equal(mine[flat], rank0[flat]))
        return fmt::format(
            "parameter {} at {} is {:.9g} here but {:.9g} on rank 0; expected the replicas to be "
            "bitwise identical",
            parameter->name, position_in(parameter->value.shape(), i), mine[flat], rank0[flat]);
    }
  }
  return "";
}

}  // namespace dp::grading
