// estimate.cpp: lab 0, alpha and beta measured on the communicator's clock, from messages
// between two ranks and from all-reduces.
// Your part: the bodies of estimate_link and estimate_link_from_allreduce.
#include <fmt/format.h>

#include <cstddef>
#include <cstdint>

#include "dp/clock.h"
#include "dp/error.h"
#include "dp/tensor.h"
#include "lab0.h"

namespace dp::lab0 {

// BEGIN SOLUTION
// SKELETON: // Your helpers, if any, go here.
namespace {

constexpr int kPingPongTag = 0;

/// The two sizes of the fit, in float32 elements: the small one pins alpha, the large one
/// beta. On the simulated clock any two distinct sizes give the exact line; these keep
/// both terms visible (4 KiB and 4 MiB) and cost 8 ms of round trips at 1 GB/s.
constexpr std::size_t kSmallElements = 1024;
constexpr std::size_t kLargeElements = 1024 * 1024;

/// The seconds of one message of `elements` floats from rank 0 to rank 1, on rank 0: a
/// round trip (rank 0 sends, rank 1 sends the same bytes back) halved, so that only rank
/// 0's clock is read and no two clocks are compared. Ranks above 1 return 0 at once.
double one_way_seconds(Communicator& comm, Tensor& buffer, std::size_t elements) {
  const TensorView message = buffer.view().slice(0, elements);
  const double start = comm.clock().now();
  if (comm.rank() == 0) {
    comm.isend(message, 1, kPingPongTag)->wait();
    comm.irecv(message, 1, kPingPongTag)->wait();
  } else if (comm.rank() == 1) {
    comm.irecv(message, 0, kPingPongTag)->wait();
    comm.isend(message, 0, kPingPongTag)->wait();
  }
  const double round_trip = comm.clock().now() - start;
  return round_trip / 2;
}

/// The seconds one all-reduce of `elements` floats takes on this rank's clock.
double allreduce_seconds(Communicator& comm, Tensor& buffer, std::size_t elements) {
  const double start = comm.clock().now();
  comm.allreduce(buffer.view().slice(0, elements), ReduceOp::kSum)->wait();
  return comm.clock().now() - start;
}

}  // namespace
// END SOLUTION

LinkEstimate estimate_link(Communicator& comm, Device device) {
  if (comm.size() < 2)
    throw Error(fmt::format("estimate_link: needs 2 ranks or more, got {}", comm.size()));
  // BEGIN SOLUTION
  // SKELETON: (void)device;
  // SKELETON: throw NotImplemented("lab0::estimate_link");
  // Two points of the line t(n) = alpha + n beta: beta is the slope between them, alpha
  // what is left of the small message's time once its n beta is taken off.
  Tensor buffer({static_cast<std::int64_t>(kLargeElements)}, MemoryCategory::kCommunication,
                device);
  const double small_bytes = static_cast<double>(kSmallElements * sizeof(float));
  const double large_bytes = static_cast<double>(kLargeElements * sizeof(float));
  const double t_small = one_way_seconds(comm, buffer, kSmallElements);
  const double t_large = one_way_seconds(comm, buffer, kLargeElements);
  LinkEstimate link;
  link.beta_seconds_per_byte = (t_large - t_small) / (large_bytes - small_bytes);
  link.alpha_seconds = t_small - small_bytes * link.beta_seconds_per_byte;
  return link;
  // END SOLUTION
}

LinkEstimate estimate_link_from_allreduce(Communicator& comm, Device device) {
  if (comm.size() < 2)
    throw Error(
        fmt::format("estimate_link_from_allreduce: needs 2 ranks or more, got {}", comm.size()));
  // BEGIN SOLUTION
  // SKELETON: (void)device;
  // SKELETON: throw NotImplemented("lab0::estimate_link_from_allreduce");
  // The ring's time is a line in n too: intercept 2 (N-1) alpha, slope 2 (N-1)/N beta.
  // Sizes that are multiples of N give every rank the same chunk.
  const auto n = static_cast<std::size_t>(comm.size());
  const std::size_t small = kSmallElements * n;
  const std::size_t large = kLargeElements / n * n;
  Tensor buffer({static_cast<std::int64_t>(large)}, MemoryCategory::kCommunication, device);
  const double small_bytes = static_cast<double>(small * sizeof(float));
  const double large_bytes = static_cast<double>(large * sizeof(float));
  const double t_small = allreduce_seconds(comm, buffer, small);
  const double t_large = allreduce_seconds(comm, buffer, large);
  const double slope = (t_large - t_small) / (large_bytes - small_bytes);
  const double intercept = t_small - small_bytes * slope;
  const double ranks = static_cast<double>(n);
  LinkEstimate link;
  link.alpha_seconds = intercept / (2 * (ranks - 1));
  link.beta_seconds_per_byte = slope * ranks / (2 * (ranks - 1));
  return link;
  // END SOLUTION
}

}  // namespace dp::lab0
