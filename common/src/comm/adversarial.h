// adversarial.h (internal): the communicator of `Completion::kAdversarial`.
#pragma once

#include <cstdint>
#include <memory>

#include "dp/comm.h"

namespace dp::detail {

/// A communicator whose calls deliver their results to the caller's buffers only when the
/// call's own `Work` is waited on (see `Completion::kAdversarial` and adversarial.cpp).
class AdversarialCommunicator : public Communicator {
 public:
  /// Throws `dp::Error` with the first report that a `Work`'s destructor found but could not
  /// throw (a buffer touched while its call was in flight, the `Work` destroyed without
  /// `wait()`), if there is one. The rank's next call throws it too; launch() calls this
  /// when the rank's function returns, so that a report found last is not lost.
  virtual void throw_report_of_destroyed_work() = 0;
  /// The rank's own clock, which charges and marks steps (`clock()` only reads).
  virtual Clock& charging_clock() = 0;
};

/// Wraps `inner` so that every call's results reach the caller's buffers only when the
/// call's own `Work` is waited on. `inner` must outlive the returned communicator; `seed`
/// draws the poison of the outputs and the answers of `test()`; `in_groups` holds and
/// launches point-to-point calls in groups (`CommOptions::point_to_point_in_groups`).
std::unique_ptr<AdversarialCommunicator> make_adversarial(Communicator& inner, std::uint64_t seed,
                                                          bool in_groups = false);

}  // namespace dp::detail
