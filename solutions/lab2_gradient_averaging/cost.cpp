// cost.cpp: lab 2's design question: what the flat buffer saves, predicted from the
// alpha-beta cost model. Your part: the body of predicted_flat_saving_seconds.
#include <fmt/format.h>

#include "dp/error.h"
#include "lab2.h"

namespace dp::lab2 {

double predicted_flat_saving_seconds(std::span<const std::size_t> parameter_bytes, int world_size,
                                     const LinkModel& link) {
  if (world_size < 1)
    throw Error(
        fmt::format("predicted_flat_saving_seconds: expected world_size >= 1, got {}", world_size));
  // BEGIN SOLUTION
  // SKELETON: (void)parameter_bytes;
  // SKELETON: (void)link;
  // SKELETON: throw NotImplemented("lab2::predicted_flat_saving_seconds");
  // A ring all-reduce of n bytes on p ranks costs 2 (p-1) (alpha + n/p / bandwidth), and the
  // simulated network runs collectives one after another. P calls cost
  // 2 (p-1) P alpha + 2 (p-1)/p (sum of n_i) / bandwidth; one call on the concatenation
  // costs 2 (p-1) alpha + 2 (p-1)/p (sum of n_i) / bandwidth. The bandwidth terms are
  // equal: the flat buffer saves latencies only, 2 (p-1) (P-1) alpha, whatever the sizes.
  if (parameter_bytes.empty()) return 0.0;
  const auto calls_saved = static_cast<double>(parameter_bytes.size() - 1);
  return 2.0 * static_cast<double>(world_size - 1) * calls_saved * link.alpha_seconds;
  // END SOLUTION
}

}  // namespace dp::lab2
