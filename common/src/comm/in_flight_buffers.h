// in_flight_buffers.h (internal): the buffers of the calls in flight, and what frees them.
//
// A call reads and writes its buffers at any moment until its Work is waited on (comm.h);
// memory freed before then is written after it was freed. The caching allocator keeps freed
// blocks, so neither the adversarial mode's checks nor a sanitizer sees it: the next tensor
// of the same size class gets the block, and the call's result lands in that tensor.
//
// `dp::launch` hands every rank's code a guard over its communicator, which registers the
// buffers of each call from its issue until its Work completes (wait(), a test() that is
// true, or the Work's destruction). A tensor whose memory is released while a registered
// buffer overlaps it (Tensor::release) is reported, naming the tensor and the call, and its
// block is held back from the allocator until the call completes, so that no other tensor
// receives the call's late write. The report reaches the lab as a dp::Error from the call's
// wait(), or, when the Work is destroyed instead (a destructor cannot throw), from the
// rank's next call or when its function returns.
//
// Cost: a free checks one atomic counter while no call is in flight anywhere in the process,
// and a short list of the calls in flight otherwise.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "dp/comm.h"

namespace dp::detail {

/// A communicator that registers its calls' buffers while they are in flight (see the top
/// of this file). `dp::launch` wraps every rank's communicator in one.
class InFlightBufferGuard : public Communicator {
 public:
  /// The communicator the calls go to.
  virtual Communicator& inner() = 0;
  /// Throws `dp::Error` with the first report of a buffer freed under a call whose Work was
  /// destroyed without wait() (its destructor could not throw it), if there is one. The
  /// rank's next call throws it too; launch() calls this when the rank's function returns.
  virtual void throw_report_of_freed_buffer() = 0;
};

/// Wraps `inner` (which must outlive the guard) in a guard.
std::unique_ptr<InFlightBufferGuard> make_in_flight_buffer_guard(Communicator& inner);

/// True while any guarded call in the process is in flight; a single atomic load.
bool any_call_in_flight();

/// Called as the memory [first, first + bytes) of a tensor is released; `tensor` describes
/// it for the report ("a tensor of gradients, shape (256) ..."). When a call in flight has a
/// buffer that overlaps the memory, records the report for that call, keeps what
/// `make_free_block` returns to run once the call completes, and returns true; otherwise
/// returns false, and the caller frees the block itself. Both functions are called only when
/// the memory is held. Never throws: a destructor calls it (if the bookkeeping cannot be
/// allocated, the block is left to the caller).
bool hold_block_under_call_in_flight(
    const void* first, std::size_t bytes, const std::function<std::string()>& tensor,
    const std::function<std::function<void()>()>& make_free_block) noexcept;

}  // namespace dp::detail
