// host_collectives.h: collectives of values the runtime keeps on the host (a step's loss
// and accuracy, a grader's scratch buffer, a copy of the parameters to compare), on every
// backend.
//
// The nccl backend takes device buffers only (NCCL reads and writes GPU memory) and refuses
// a host buffer, as lab code must see it refused. So a caller with host values does not pass
// them to the communicator itself: these functions stage them through a tensor on the device
// the backend takes (`Device::kCuda` on nccl, a real GPU's or the emulated one), copy in,
// run the collective, wait, and copy the result back; on the local and mpi backends they
// pass the host buffer as it is. The backend stays strict, and the copy is visible here,
// where it costs: a host round trip per call, fine for a few numbers per step, not for
// gradients (keep those on the device).
//
// Example (the trainer's metrics):
//
//   std::array<float, 2> metrics = {loss_sum, correct};
//   dp::allreduce_host_values(std::span<float>(metrics), dp::ReduceOp::kSum, comm);
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "dp/comm.h"

namespace dp {

/// Where `comm` takes the buffers of host values: `Device::kCuda` on the nccl backend (device
/// buffers only), the host on the others.
Device device_for_host_values(const Communicator& comm);

/// All-reduces `values` (host memory) over every rank of `comm` in place with `op` and waits
/// for the result; through a device copy where the backend takes device buffers only. Every
/// rank calls it, as any collective.
void allreduce_host_values(std::span<float> values, ReduceOp op, Communicator& comm);
/// All-reduces int32 `values` (host memory), as the float32 overload.
void allreduce_host_values(std::span<std::int32_t> values, ReduceOp op, Communicator& comm);
/// Copies rank `root`'s `values` (host memory) into every rank's `values` and waits; through
/// a device copy where the backend takes device buffers only.
void broadcast_host_values(std::span<float> values, int root, Communicator& comm);
/// Copies rank `root`'s `bytes` (host memory) into every rank's `bytes`, as the float32
/// overload (e.g. a path rank 0 made, for the others to open).
void broadcast_host_values(std::span<std::uint8_t> bytes, int root, Communicator& comm);

}  // namespace dp
