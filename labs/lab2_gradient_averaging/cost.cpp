// Lab skeleton, generated from the reference by tools/make-skeletons: your code goes where
// dp::NotImplemented is thrown.
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
  (void)parameter_bytes;
  (void)link;
  throw NotImplemented("lab2::predicted_flat_saving_seconds");
}

double flat_buffer_break_even_bytes(std::size_t parameters, int world_size, const LinkModel& link,
                                    const DeviceModel& device) {
  if (world_size < 1)
    throw Error(
        fmt::format("flat_buffer_break_even_bytes: expected world_size >= 1, got {}", world_size));
  (void)parameters;
  (void)link;
  (void)device;
  throw NotImplemented("lab2::flat_buffer_break_even_bytes");
}

}  // namespace dp::lab2
