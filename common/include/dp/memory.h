// memory.h: per-rank memory accounting and a caching allocator.
//
// Every tensor is charged to the `RankMemory` of the rank that created it, under a
// category (parameters, gradients, optimizer state, activations, communication
// buffers). The tracker keeps current and peak bytes per category: the ZeRO labs are
// graded on these numbers. The caching allocator keeps freed blocks for reuse because
// the first touch of fresh memory is slow (about 0.3 GB/s on the course machines, 12 us
// per 4 KiB page), far slower than copying into memory that is already mapped.
//
// A tracker may have a budget (`LaunchOptions::memory_budget_bytes`, `dplab train
// --memory-budget`): the memory of one accelerator, for a course machine that has none.
// An allocation that would take the rank past it throws `OutOfMemory` before anything is
// allocated, naming the category it was for and the rank's peak per category, which is
// what a student needs to see which part of the training state does not fit.
//
// Example:
//
//   auto memory = std::make_shared<dp::RankMemory>();
//   dp::ScopedRankMemory bind(memory);           // this thread now charges `memory`
//   dp::Tensor w({256, 64}, dp::MemoryCategory::kParameters);
//   memory->tracker().current(dp::MemoryCategory::kParameters);  // 65536
#pragma once

#include <array>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dp/error.h"

namespace dp {

/// What a block of memory holds; the tracker keeps one account per category.
enum class MemoryCategory {
  kParameters,
  kGradients,
  kOptimizerState,
  kActivations,
  kCommunication,
  kOther,
};

/// Number of `MemoryCategory` values.
inline constexpr std::size_t kNumMemoryCategories = 6;

/// A short lower-case name, e.g. "optimizer_state".
std::string_view to_string(MemoryCategory category);

/// `bytes` as a person reads them, in B, KiB, MiB or GiB (binary units), e.g. "1.50 MiB".
std::string format_bytes(std::size_t bytes);

/// An allocation that would take a rank past its memory budget, or that the machine refused.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

/// This machine's physical memory in bytes (0 when the system does not say).
std::size_t machine_memory_bytes();

/// The error for an allocation of `bytes` for `what` ("parameters", "the safetensors file
/// 'x.st'") that the machine refused (a `std::bad_alloc`): it names what and its size, the
/// machine's memory, and what to do, instead of an unexplained `std::bad_alloc`.
OutOfMemory machine_out_of_memory(std::string_view what, std::size_t bytes);

class Tensor;

/// Current and peak bytes per category for one rank. Thread-safe.
///
/// Only tensors charge it (as they are allocated and freed): its accounting entry points are
/// private, so that the graded lab code it measures cannot charge or release bytes by hand.
class MemoryTracker {
 public:
  /// Bytes currently live under `category`.
  std::size_t current(MemoryCategory category) const;
  /// Highest value `current(category)` reached since construction or `reset_peaks()`.
  std::size_t peak(MemoryCategory category) const;
  /// Number of allocations recorded under `category` since construction: a count that
  /// only grows, so that code which should reuse its buffers can be shown to allocate none
  /// (read it before and after, and subtract).
  std::size_t allocations(MemoryCategory category) const;
  /// Number of allocations recorded in all categories together since construction.
  std::size_t allocations_total() const;
  /// Bytes currently live in all categories together.
  std::size_t current_total() const;
  /// Highest value `current_total()` reached since construction or `reset_peaks()`.
  std::size_t peak_total() const;
  /// Sets every peak to the current value, to measure the peak of a phase.
  void reset_peaks();
  /// Limits `current_total()` to `bytes` from now on (no limit: std::nullopt, the default).
  /// Throws `dp::Error` when more than `bytes` are live already.
  void set_budget(std::optional<std::size_t> bytes);
  /// The limit set by `set_budget`, if any.
  std::optional<std::size_t> budget() const;

 private:
  friend class Tensor;  // charges its memory as it allocates and frees it
#ifdef DP_MEMORY_TRACKER_TESTS
  friend class MemoryTrackerTest;  // the runtime's unit tests (tests/test_memory.cpp) only
#endif

  /// Records that `bytes` were allocated under `category`. Throws `OutOfMemory`, and
  /// records nothing, when that would take `current_total()` past the budget.
  void on_allocate(MemoryCategory category, std::size_t bytes);
  /// Records that `bytes` under `category` were released.
  void on_release(MemoryCategory category, std::size_t bytes);

  mutable std::mutex mutex_;
  std::optional<std::size_t> budget_;
  std::array<std::size_t, kNumMemoryCategories> current_{};
  std::array<std::size_t, kNumMemoryCategories> peak_{};
  std::array<std::size_t, kNumMemoryCategories> allocations_{};
  std::size_t current_total_ = 0;
  std::size_t peak_total_ = 0;
};

/// Keeps freed blocks by size class and hands them out again. Thread-safe.
///
/// Sizes are rounded up to a class (four classes per power of two, at least 4 KiB), so a
/// block serves any request of its class. Blocks are 64-byte aligned.
class CachingAllocator {
 public:
  CachingAllocator() = default;
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;
  ~CachingAllocator();

  /// Returns a block of at least `bytes` bytes (nullptr for 0), reusing a cached one.
  void* allocate(std::size_t bytes);
  /// Returns a block obtained from `allocate(bytes)` to the cache.
  void deallocate(void* block, std::size_t bytes);
  /// Bytes held in the cache, not in use.
  std::size_t cached_bytes() const;
  /// Frees every cached block back to the system.
  void release_cached();

  /// The size class a request of `bytes` is rounded up to.
  static std::size_t size_class(std::size_t bytes);

 private:
  mutable std::mutex mutex_;
  std::map<std::size_t, std::vector<void*>> free_blocks_;  // size class -> blocks
  std::size_t cached_bytes_ = 0;
};

/// The memory of one rank: its accounts and its allocator.
class RankMemory {
 public:
  /// The accounts of this rank.
  MemoryTracker& tracker() { return tracker_; }
  /// The accounts of this rank (read-only).
  const MemoryTracker& tracker() const { return tracker_; }
  /// The allocator tensors of this rank draw from.
  CachingAllocator& allocator() { return allocator_; }

 private:
  MemoryTracker tracker_;
  CachingAllocator allocator_;
};

/// The `RankMemory` bound to the calling thread; a thread that bound none gets its own.
RankMemory& this_rank_memory();
/// The same, shared: a tensor keeps its rank's memory alive until it is destroyed.
std::shared_ptr<RankMemory> this_rank_memory_shared();

/// Binds a `RankMemory` to the calling thread for the lifetime of this object.
/// `dp::launch` binds one per rank, so tensors a rank creates are charged to it.
class ScopedRankMemory {
 public:
  /// Binds `memory` to this thread until destruction, then restores the previous binding.
  explicit ScopedRankMemory(std::shared_ptr<RankMemory> memory);
  ~ScopedRankMemory();
  ScopedRankMemory(const ScopedRankMemory&) = delete;
  ScopedRankMemory& operator=(const ScopedRankMemory&) = delete;

 private:
  std::shared_ptr<RankMemory> previous_;
};

/// Configures glibc malloc so that large blocks are not returned to the system and
/// re-faulted on each use (an MPI_Allreduce of 64 MiB drops from 3.4 to 0.17 GB/s when
/// its temporaries come from fresh mmap memory). Idempotent; `dp::launch` calls it.
void configure_process_allocator();

namespace detail {

/// While one exists on a thread, the check programs' count of heap allocations
/// (grader/support/heap_use.h, which counts operator new and the malloc family per thread)
/// leaves that thread's malloc family out: the runtime opens one around the blocks it takes
/// for itself (tensor memory, which the `MemoryTracker` accounts for; copies of messages in
/// flight; what MPI allocates inside a call), so that the count is what lab code took. Not
/// for lab code: the lab audit refuses it.
class UncountedHeapAllocations {
 public:
  UncountedHeapAllocations();
  ~UncountedHeapAllocations();
  UncountedHeapAllocations(const UncountedHeapAllocations&) = delete;
  UncountedHeapAllocations& operator=(const UncountedHeapAllocations&) = delete;
};

/// True while an `UncountedHeapAllocations` exists on the calling thread.
bool heap_allocations_uncounted();

}  // namespace detail

}  // namespace dp
