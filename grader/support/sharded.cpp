// sharded.cpp: see sharded.h.
#include "sharded.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>

namespace dp::grading {

std::function<std::unique_ptr<Optimizer>(std::size_t)> shard_optimizer_factory(
    const TrainOptions& options) {
  return [options](std::size_t shard) { return optimizer_for(options, shard); };
}

std::vector<Suspect> division_suspects(int world) {
  const double n = world;
  return {{n, fmt::format("a missing division by N = {}", world)},
          {1.0 / n, fmt::format("the division by N = {} applied twice", world)}};
}

std::string compare_sharded_step(const ShardedStep& s) {
  if (s.max_norm == 0 && s.norm.has_value())
    return fmt::format("step {} returned a norm ({}) with clipping off; expected std::nullopt",
                       s.step, *s.norm);
  if (s.max_norm > 0) {
    const float expected = s.expected_norms[static_cast<std::size_t>(s.step - 1)];
    if (!s.norm.has_value())
      return fmt::format("step {} returned no norm with clipping on (max_norm {})", s.step,
                         s.max_norm);
    // Bitwise: the contract fixes the norm's arithmetic.
    if (std::memcmp(&*s.norm, &expected, sizeof(float)) != 0)
      return fmt::format(
          "step {} returned the norm {:.9g}; expected {:.9g}, the contract's arithmetic {} "
          "(ratio {:.6g}{})",
          s.step, *s.norm, expected, s.norm_arithmetic, *s.norm / expected,
          s.world > 1 && std::abs(*s.norm / expected - static_cast<float>(s.world)) < 1e-3f
              ? ": the norm of the sum, before the division by N?"
              : "");
  }
  const std::vector<float>& expected =
      s.exact.parameters_after_step[static_cast<std::size_t>(s.step - 1)];
  const std::string finding = compare_parameters(s.model, expected, 0.0f);
  if (finding.empty()) return "";
  const std::vector<float> seen = s.model.flat_parameters();
  const std::string hint = scale_hint(difference(seen, s.before), difference(expected, s.before),
                                      division_suspects(s.world));
  return fmt::format("first differing step {}: {}; {}{}", s.step, finding,
                     per_parameter_summary(s.model, seen, expected),
                     hint.empty() ? "" : "; " + hint);
}

}  // namespace dp::grading
