// argument_checks.h (internal): the checks every backend makes of a call's arguments.
//
// A backend calls these before it records a call, so a bad argument fails at once, on the
// rank that passed it, with the same message on every backend: a student who moves from
// `local` to `mpi` or `nccl` reads the same sentence for the same mistake.
//
//   detail::require_device(data.device, Device::kHost, "mpi", "allreduce");
//   detail::require_reducible(in, "reduce_scatter");
//   detail::require_reduce_scatter_sizes(in, out, size());
//
// What only one backend can check (MPI's tag bound, the GPU a buffer lives on) stays in that
// backend.
#pragma once

#include <span>
#include <string_view>
#include <vector>

#include "dp/comm.h"

namespace dp::detail {

/// Throws `dp::Error` unless `seen` is `accepted`: "`call` on the `backend` backend: expected
/// a buffer in <accepted> memory, got one in <seen> memory", with what to do instead.
void require_device(Device seen, Device accepted, std::string_view backend, std::string_view call);

/// Throws `dp::Error` for a buffer labelled `Device::kCuda` on the emulated device that does
/// not lie inside device memory (a device tensor, a view or slice of one): a GPU refuses a
/// host address given as a device one, and so must its emulation (device_dispatch.h).
void require_device_memory(ConstBuffer buffer, std::string_view call);

/// Throws `dp::Error` unless `in` and `out` of one call live on the same device.
void require_same_device(ConstBuffer in, MutableBuffer out, std::string_view call);

/// Throws `dp::Error` unless `0 <= peer < world_size`; `call` names the argument too, as in
/// "broadcast root".
void require_peer_in_range(int peer, int world_size, std::string_view call);

/// Throws `dp::Error` unless `buffer`'s elements can be summed: float32 or int32, not uint8.
void require_reducible(ConstBuffer buffer, std::string_view call);

/// Throws `dp::Error` unless a reduce-scatter's input holds `world_size` times its output's
/// elements, of the output's type.
void require_reduce_scatter_sizes(ConstBuffer in, MutableBuffer out, int world_size);

/// Throws `dp::Error` unless an all-gather's output holds `world_size` times its input's
/// elements, of the input's type.
void require_allgather_sizes(ConstBuffer in, MutableBuffer out, int world_size);

/// Throws `dp::Error` unless `color` is >= 0 or `Communicator::kNoColor`: "split: expected a
/// color >= 0 or Communicator::kNoColor (-1), got <color>".
void require_split_color(int color);

/// The communicators a split makes, from every rank's color and key (by rank of the
/// communicator split): for each color other than `Communicator::kNoColor`, in increasing
/// order, its ranks ordered by key and ties by rank.
std::vector<std::vector<int>> split_groups(std::span<const int> colors, std::span<const int> keys);

}  // namespace dp::detail
