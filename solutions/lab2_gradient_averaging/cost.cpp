// cost.cpp: lab 2's design questions: what the flat buffer saves, and the size above which
// its copies cost more than that, predicted from the cost model of the simulated clock.
// Your part: the bodies of predicted_flat_saving_seconds and flat_buffer_break_even_bytes.
#include <fmt/format.h>

#include <algorithm>

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

double flat_buffer_break_even_bytes(std::size_t parameters, int world_size, const LinkModel& link,
                                    const DeviceModel& device) {
  if (world_size < 1)
    throw Error(
        fmt::format("flat_buffer_break_even_bytes: expected world_size >= 1, got {}", world_size));
  // BEGIN SOLUTION
  // SKELETON: (void)parameters;
  // SKELETON: (void)link;
  // SKELETON: (void)device;
  // SKELETON: throw NotImplemented("lab2::flat_buffer_break_even_bytes");
  // The flat buffer saves 2 (p-1) (P-1) alpha of latency, whatever S (question 1). It pays
  // 2P copies, P each way. A copy of n floats is one op of n flops and 8n bytes (a read and
  // a write of each): device.time_of charges max(n / rate, 8n / bandwidth) + launch, and
  // since the max is linear in n, the P copies of one way cost P launches plus
  // max(1 / rate, 8 / bandwidth) per float of the S / 4 in all, whatever the sizes.
  // Flat minus per-gradient time is therefore affine in S:
  //   2 P launch - saved  +  2 max(1/rate, 8/bandwidth) S / 4,
  // and crosses 0 at S* when the launches cost less than the latency saved; else the flat
  // buffer is slower at every size.
  if (parameters == 0) return 0.0;
  const double saved = 2.0 * static_cast<double>(world_size - 1) *
                       static_cast<double>(parameters - 1) * link.alpha_seconds;
  const double launches = 2.0 * static_cast<double>(parameters) * device.launch_seconds;
  const double seconds_per_float =
      std::max(1.0 / device.flops_per_second, 8.0 / device.bytes_per_second);
  const double seconds_per_byte = 2.0 * seconds_per_float / 4.0;  // both ways, 4 bytes a float
  return std::max(0.0, (saved - launches) / seconds_per_byte);
  // END SOLUTION
}

}  // namespace dp::lab2
