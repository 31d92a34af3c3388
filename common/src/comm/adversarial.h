// adversarial.h (internal): the communicator of `Completion::kAdversarial`.
#pragma once

#include <cstdint>
#include <memory>

#include "dp/comm.h"

namespace dp::detail {

/// Wraps `inner` so that every call's results reach the caller's buffers only when the
/// call's own `Work` is waited on (see `Completion::kAdversarial`). `inner` must outlive
/// the returned communicator.
std::unique_ptr<Communicator> make_adversarial(Communicator& inner, std::uint64_t seed);

}  // namespace dp::detail
