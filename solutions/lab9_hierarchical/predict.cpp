// predict.cpp: lab 9's design questions: the simulated time of the flat ring, of the
// hierarchical all-reduce and of a sharded step's communication on two levels of network.
// Your part: the three bodies.
#include <algorithm>
#include <cstddef>

#include "lab9.h"

namespace dp::lab9 {

namespace {
// BEGIN SOLUTION
// SKELETON: // Helpers of your own, if you want them.
/// One ring step of `chunk` bytes on `link`: alpha + chunk / bandwidth.
double step_on(const LinkModel& link, double chunk) {
  return link.alpha_seconds + chunk / link.bytes_per_second;
}

/// A ring step over all p ranks in rank order: as long as its slowest hop, which crosses
/// nodes once there are two (a NIC per rank: no port carries two hops of a step).
double flat_step(const TwoLevelFabric& fabric, double chunk) {
  const double inside = step_on(fabric.intra, chunk);
  if (fabric.nodes == 1) return inside;
  if (fabric.ranks_per_node == 1) return step_on(fabric.inter, chunk);
  return std::max(inside, step_on(fabric.inter, chunk));
}
// END SOLUTION
}  // namespace

double predicted_flat_allreduce_seconds(std::size_t bytes, const TwoLevelFabric& fabric) {
  // BEGIN SOLUTION
  // SKELETON: (void)bytes;
  // SKELETON: (void)fabric;
  // SKELETON: throw NotImplemented("lab9::predicted_flat_allreduce_seconds");
  const int p = fabric.nodes * fabric.ranks_per_node;
  return 2.0 * (p - 1) * flat_step(fabric, static_cast<double>(bytes) / p);
  // END SOLUTION
}

double predicted_hierarchical_allreduce_seconds(std::size_t bytes, const TwoLevelFabric& fabric) {
  // BEGIN SOLUTION
  // SKELETON: (void)bytes;
  // SKELETON: (void)fabric;
  // SKELETON: throw NotImplemented("lab9::predicted_hierarchical_allreduce_seconds");
  const int k = fabric.ranks_per_node;
  const int n = fabric.nodes;
  const double b = static_cast<double>(bytes);
  // Reduce-scatter and all-gather inside the node: k - 1 steps of b / k each; the all-reduce
  // of the shard b / k across: 2 (N - 1) steps of b / (k N).
  return 2.0 * (k - 1) * step_on(fabric.intra, b / k) +
         2.0 * (n - 1) * step_on(fabric.inter, b / (static_cast<double>(k) * n));
  // END SOLUTION
}

double predicted_sharded_step_seconds(std::size_t num_parameters, const TwoLevelFabric& fabric,
                                      bool hybrid) {
  // BEGIN SOLUTION
  // SKELETON: (void)num_parameters;
  // SKELETON: (void)fabric;
  // SKELETON: (void)hybrid;
  // SKELETON: throw NotImplemented("lab9::predicted_sharded_step_seconds");
  const auto k = static_cast<std::size_t>(fabric.ranks_per_node);
  const auto n = static_cast<std::size_t>(fabric.nodes);
  if (!hybrid) {
    // Reduce-scatter and all-gather over all p ranks: 2 (p - 1) steps of one shard each.
    const std::size_t p = k * n;
    const double shard = 4.0 * static_cast<double>((num_parameters + p - 1) / p);
    return 2.0 * static_cast<double>(p - 1) * flat_step(fabric, shard);
  }
  // Reduce-scatter and all-gather inside the node (k - 1 steps of a shard each), the
  // all-reduce of the shard across (2 (N - 1) steps of shard / N).
  const double shard = 4.0 * static_cast<double>((num_parameters + k - 1) / k);
  return 2.0 * static_cast<double>(k - 1) * step_on(fabric.intra, shard) +
         2.0 * static_cast<double>(n - 1) * step_on(fabric.inter, shard / static_cast<double>(n));
  // END SOLUTION
}

}  // namespace dp::lab9
