// heap_use.h: how much memory the calling thread has taken from the heap.
//
// Check programs replace the global operator new and the C library's malloc family
// (heap_use.cpp, linked into every check program through its main()) with ones that count,
// per thread, the allocations and bytes they hand out; the runtime leaves its own blocks out
// of the count (dp::detail::UncountedHeapAllocations). A check reads the count before and after a piece of lab code that must
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

/// Allocations and bytes operator new and the malloc family handed out on one thread.
struct HeapUse {
  std::uint64_t allocations = 0;  ///< calls of operator new (every form) and of malloc & co.
  std::uint64_t bytes = 0;        ///< bytes requested
  std::uint64_t large_bytes =
      0;  ///< bytes requested by allocations of kLargeAllocationBytes or more

  /// What was handed out after `earlier`, a reading of the same thread.
  HeapUse since(const HeapUse& earlier) const {
    return {allocations - earlier.allocations, bytes - earlier.bytes,
            large_bytes - earlier.large_bytes};
  }
};

/// What operator new and the malloc family have handed out on the calling thread since the
/// thread started; zeros in a program without the counting functions.
HeapUse heap_use_of_this_thread();

}  // namespace dp::grading
