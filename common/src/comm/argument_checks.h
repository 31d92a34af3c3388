// buffer_checks.h (internal): the devices a backend accepts for its buffers.
//
// Each backend calls `require_device` for every buffer of every call before it records the
// call, so a buffer on a device it cannot reach fails at once, on the rank that passed it,
// with a message naming the call, the backend and both devices:
//
//   detail::require_device(data.device, Device::kHost, "mpi", "allreduce");
#pragma once

#include <string_view>

#include "dp/comm.h"

namespace dp::detail {

/// Throws `dp::Error` unless `seen` is `accepted`: "`call` on the `backend` backend: expected
/// a buffer in <accepted> memory, got one in <seen> memory", with what to do instead.
void require_device(Device seen, Device accepted, std::string_view backend, std::string_view call);

/// Throws `dp::Error` unless `in` and `out` of one call live on the same device.
void require_same_device(ConstBuffer in, MutableBuffer out, std::string_view call);

}  // namespace dp::detail
