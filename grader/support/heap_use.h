// heap_use.h: how much memory the calling thread has taken from operator new.
//
// Check programs replace the global operator new (heap_use.cpp, linked into every check
// program through its main()) with one that counts, per thread, the allocations and bytes
// it hands out. A check reads the count before and after a piece of lab code that must
// reuse its buffers, on that code's own thread, and subtracts: a fresh std::vector or any
// other heap buffer shows up, whoever else allocates on other threads meanwhile. Tensors
// come from the rank's caching allocator instead, which `MemoryTracker::allocations`
// counts.
//
// Example:
//
//   const dp::grading::HeapUse before = dp::grading::heap_use_of_this_thread();
//   averager.average(model, comm);
//   const dp::grading::HeapUse used = dp::grading::heap_use_of_this_thread().since(before);
#pragma once

#include <cstdint>

namespace dp::grading {

/// Allocations from this size up count as large: a copy of a gradient or a bucket is one,
/// while the runtime's own bookkeeping per call (a call record, a handle, a rendezvous
/// slot) stays below it. How much bookkeeping a call takes can depend on which rank
/// arrives first; large allocations do not, so checks can demand none at all.
inline constexpr std::uint64_t kLargeAllocationBytes = 1024;

/// Allocations and bytes operator new handed out on one thread.
struct HeapUse {
  std::uint64_t allocations = 0;  ///< calls of operator new (every form)
  std::uint64_t bytes = 0;        ///< bytes requested
  std::uint64_t large_bytes =
      0;  ///< bytes requested by allocations of kLargeAllocationBytes or more

  /// What was handed out after `earlier`, a reading of the same thread.
  HeapUse since(const HeapUse& earlier) const {
    return {allocations - earlier.allocations, bytes - earlier.bytes,
            large_bytes - earlier.large_bytes};
  }
};

/// What operator new has handed out on the calling thread since the thread started; zeros
/// in a program without the counting operator new.
HeapUse heap_use_of_this_thread();

}  // namespace dp::grading
