// lab0.h: lab 0, measuring the network. The contract between your code and the grader: two
// measurement routines that recover the latency alpha and the time per byte beta of the
// network a communicator runs on. How they measure (which sizes, how many messages, which
// fit) is your design: the grader checks the numbers you return and the time you spend.
//
// A message of n bytes costs alpha + n beta (README.md beside this file poses the problem;
// its Hints section, at the end, helps if you are stuck). Do not change this header: the
// grader is compiled against it.
//
// What every check holds you to:
//   * The outcome. On simulated fabrics drawn as `dplab bench-comm --mystery` draws them
//     (alpha 1 to 50 us, bandwidth 1 to 400 GB/s, so the size alpha / beta where the two
//     terms are equal lies anywhere from about 1 KB to 20 MB), the alpha and the beta you
//     return are each within 5% of the fabric's.
//   * The clock. Time is what `comm.clock().now()` says (dp/clock.h): on the simulated
//     network it charges every message exactly alpha + n beta, on the receiving rank once
//     the message has arrived. Lab 0 is the one lab that may read the clock; nothing may
//     read the network's parameters from the runtime (the clock's `trace()`, which
//     describes the network, is refused by the lab audit like every other lab's).
//   * A budget. Each call may spend at most 100 ms of simulated time (the latest rank's
//     clock when it returns, minus the clock when it was called): an exhaustive sweep, as
//     `dplab bench-comm` makes, costs seconds on a slow fabric.
//   * The same code on a device. The checks run on the host and on an emulated device:
//     put the buffers you send on `device` (a `dp::Tensor` made there, charged to
//     `dp::MemoryCategory::kCommunication`), and read no device memory on the host.
//
// Example:
//
//   dp::lab0::LinkEstimate link = dp::lab0::estimate_link(comm, dp::Device::kHost);
//   fmt::print("alpha {} us, bandwidth {} GB/s\n", link.alpha_seconds * 1e6,
//              1e-9 / link.beta_seconds_per_byte);
#pragma once

#include "dp/comm.h"

namespace dp::lab0 {

/// The two numbers of the alpha-beta model of one link: a message of n bytes costs
/// alpha_seconds + n beta_seconds_per_byte.
struct LinkEstimate {
  double alpha_seconds = 0;          ///< latency of one message, in seconds
  double beta_seconds_per_byte = 0;  ///< time per byte, in seconds (1 / bandwidth)
};

/// Measures alpha and beta of the link between ranks 0 and 1 of `comm` with point-to-point
/// messages (`isend` and `irecv`) of sizes you choose, on buffers on `device`, and fits them.
/// Called on every rank of `comm` (2 to 8 ranks; ranks above 1 may do nothing). Rank 0's
/// return value is graded: alpha and beta each within 5% of the fabric's. Issue no
/// collective; spend at most 100 ms of simulated time.
LinkEstimate estimate_link(Communicator& comm, Device device);

/// Recovers alpha and beta from all-reduce times alone: a ring all-reduce of n bytes on N
/// ranks costs 2 (N-1) alpha + 2 (N-1)/N n beta on the simulated network. Called on every
/// rank of `comm` (2 to 8 ranks), with buffers on `device`; issue only all-reduces (no
/// point-to-point message). Rank 0's return value is graded: alpha and beta each within 5%
/// of the fabric's; spend at most 100 ms of simulated time.
LinkEstimate estimate_link_from_allreduce(Communicator& comm, Device device);

}  // namespace dp::lab0
