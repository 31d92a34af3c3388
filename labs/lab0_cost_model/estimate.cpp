// Lab skeleton, generated from the reference by tools/make-skeletons: your code goes where
// dp::NotImplemented is thrown.
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

// Your helpers, if any, go here.

LinkEstimate estimate_link(Communicator& comm, Device device) {
  if (comm.size() < 2)
    throw Error(fmt::format("estimate_link: needs 2 ranks or more, got {}", comm.size()));
  (void)device;
  throw NotImplemented("lab0::estimate_link");
}

LinkEstimate estimate_link_from_allreduce(Communicator& comm, Device device) {
  if (comm.size() < 2)
    throw Error(
        fmt::format("estimate_link_from_allreduce: needs 2 ranks or more, got {}", comm.size()));
  (void)device;
  throw NotImplemented("lab0::estimate_link_from_allreduce");
}

}  // namespace dp::lab0
