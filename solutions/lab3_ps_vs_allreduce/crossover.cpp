// crossover.cpp: lab 3's design question: below which size the latency-optimal all-reduce
// beats the ring, predicted from the alpha-beta cost model. Your part: the body of
// predicted_crossover_bytes.
#include <fmt/format.h>

#include <limits>

#include "dp/error.h"
#include "lab3.h"

namespace dp::lab3 {

double predicted_crossover_bytes(int world_size, const LinkModel& link) {
  if (world_size < 2)
    throw Error(fmt::format(
        "predicted_crossover_bytes: expected world_size >= 2 (one rank sends nothing), got {}",
        world_size));
  // BEGIN SOLUTION
  // SKELETON: (void)link;
  // SKELETON: throw NotImplemented("lab3::predicted_crossover_bytes");
  // Ring: 2(p-1) steps, each a message of n/p bytes that waits for the one before:
  //   T_ring = 2(p-1) alpha + 2 (p-1)/p n beta.
  // Recursive doubling over p' = 2^floor(lg p), plus a fold and an unfold round when p is
  // not a power of two: R rounds, each a whole-buffer exchange that waits for the one
  // before (full duplex: both directions at once). When p - p' is odd, rank p - p' - 1
  // receives a fold while its first partner, which has no fold to wait for, sends at once:
  // the two messages share that rank's receiving link, one transfer after the other, and
  // the path through it carries one more n beta (s = 1 when p - p' is odd, else 0):
  //   T_rd = R alpha + (R + s) n beta.
  // Equal at n* = alpha (2(p-1) - R) / (beta (R + s - 2(p-1)/p)); below it the R
  // latencies beat the ring's 2(p-1), above it the ring's smaller bandwidth term wins.
  const double p = world_size;
  int power = 1;
  int doubling_rounds = 0;
  while (power * 2 <= world_size) {
    power *= 2;
    ++doubling_rounds;
  }
  const double rounds = doubling_rounds + (power == world_size ? 0 : 2);
  const double transfers = rounds + ((world_size - power) % 2 == 1 ? 1 : 0);
  const double ring_bandwidth_factor = 2 * (p - 1) / p;
  if (transfers <= ring_bandwidth_factor) return std::numeric_limits<double>::infinity();  // p = 2
  return link.alpha_seconds * link.bytes_per_second * (2 * (p - 1) - rounds) /
         (transfers - ring_bandwidth_factor);
  // END SOLUTION
}

}  // namespace dp::lab3
