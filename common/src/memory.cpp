#include "dp/memory.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <new>
#include <utility>

#include "dp/error.h"

namespace dp {

std::string_view to_string(MemoryCategory category) {
  switch (category) {
    case MemoryCategory::kParameters: return "parameters";
    case MemoryCategory::kGradients: return "gradients";
    case MemoryCategory::kOptimizerState: return "optimizer_state";
    case MemoryCategory::kActivations: return "activations";
    case MemoryCategory::kCommunication: return "communication";
    case MemoryCategory::kOther: return "other";
  }
  return "unknown";
}

std::string format_bytes(std::size_t bytes) {
  if (bytes >= std::size_t{1} << 30) return fmt::format("{:.2f} GiB", bytes / double(1 << 30));
  if (bytes >= std::size_t{1} << 20) return fmt::format("{:.2f} MiB", bytes / double(1 << 20));
  if (bytes >= std::size_t{1} << 10) return fmt::format("{:.2f} KiB", bytes / double(1 << 10));
  return fmt::format("{} B", bytes);
}

std::size_t machine_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page_size <= 0) return 0;
  return static_cast<std::size_t>(pages) * static_cast<std::size_t>(page_size);
}

OutOfMemory machine_out_of_memory(std::string_view what, std::size_t bytes) {
  const std::size_t machine = machine_memory_bytes();
  return OutOfMemory(fmt::format(
      "out of memory: allocating {} for {} failed (this machine has {} of memory, less under a "
      "limit such as ulimit -v); the model, data set or checkpoint is too large for it: use a "
      "smaller one, or a machine with more memory",
      format_bytes(bytes), what, machine > 0 ? format_bytes(machine) : "an unknown amount"));
}

void MemoryTracker::on_allocate(MemoryCategory category, std::size_t bytes) {
  const auto c = static_cast<std::size_t>(category);
  std::lock_guard lock(mutex_);
  if (budget_ && bytes > *budget_ - std::min(*budget_, current_total_)) {
    // Peaks, not current bytes: what fails is often a category that peaks in a phase the
    // rank has left (activations after forward, a gathered layer after its backward).
    std::vector<std::string> peaks;
    for (std::size_t k = 0; k < kNumMemoryCategories; ++k)
      if (peak_[k] > 0)
        peaks.push_back(fmt::format("{} {}", to_string(static_cast<MemoryCategory>(k)),
                                    format_bytes(peak_[k])));
    throw OutOfMemory(fmt::format(
        "out of memory: allocating {} of {} would take this rank to {}, past its memory "
        "budget of {}; {} are in use, and the peaks so far are: {}",
        format_bytes(bytes), to_string(category), format_bytes(current_total_ + bytes),
        format_bytes(*budget_), format_bytes(current_total_),
        peaks.empty() ? std::string("nothing yet") : fmt::format("{}", fmt::join(peaks, ", "))));
  }
  current_[c] += bytes;
  ++allocations_[c];
  peak_[c] = std::max(peak_[c], current_[c]);
  current_total_ += bytes;
  peak_total_ = std::max(peak_total_, current_total_);
}

void MemoryTracker::on_release(MemoryCategory category, std::size_t bytes) {
  const auto c = static_cast<std::size_t>(category);
  std::lock_guard lock(mutex_);
  DP_CHECK(current_[c] >= bytes, "releasing {} bytes of {} but only {} are live", bytes,
           to_string(category), current_[c]);
  current_[c] -= bytes;
  current_total_ -= bytes;
}

std::size_t MemoryTracker::current(MemoryCategory category) const {
  std::lock_guard lock(mutex_);
  return current_[static_cast<std::size_t>(category)];
}

std::size_t MemoryTracker::peak(MemoryCategory category) const {
  std::lock_guard lock(mutex_);
  return peak_[static_cast<std::size_t>(category)];
}

std::size_t MemoryTracker::allocations(MemoryCategory category) const {
  std::lock_guard lock(mutex_);
  return allocations_[static_cast<std::size_t>(category)];
}

std::size_t MemoryTracker::allocations_total() const {
  std::lock_guard lock(mutex_);
  std::size_t total = 0;
  for (std::size_t count : allocations_) total += count;
  return total;
}

std::size_t MemoryTracker::current_total() const {
  std::lock_guard lock(mutex_);
  return current_total_;
}

std::size_t MemoryTracker::peak_total() const {
  std::lock_guard lock(mutex_);
  return peak_total_;
}

void MemoryTracker::set_budget(std::optional<std::size_t> bytes) {
  std::lock_guard lock(mutex_);
  if (bytes && current_total_ > *bytes)
    throw Error(fmt::format("a memory budget of {} bytes is less than the {} bytes in use", *bytes,
                            current_total_));
  budget_ = bytes;
}

std::optional<std::size_t> MemoryTracker::budget() const {
  std::lock_guard lock(mutex_);
  return budget_;
}

void MemoryTracker::reset_peaks() {
  std::lock_guard lock(mutex_);
  peak_ = current_;
  peak_total_ = current_total_;
}

namespace {
constexpr std::size_t kAlignment = 64;       // a cache line, enough for AVX-512 loads
constexpr std::size_t kMinimumClass = 4096;  // one page
}  // namespace

std::size_t CachingAllocator::size_class(std::size_t bytes) {
  if (bytes <= kMinimumClass) return kMinimumClass;
  // Four classes per power of two: at most 25% of a block is unused.
  const std::size_t power = std::bit_floor(bytes);
  const std::size_t step = power / 4;
  return (bytes + step - 1) / step * step;
}

CachingAllocator::~CachingAllocator() {
  release_cached();
}

void* CachingAllocator::allocate(std::size_t bytes) {
  if (bytes == 0) return nullptr;
  const std::size_t size = size_class(bytes);
  {
    std::lock_guard lock(mutex_);
    auto it = free_blocks_.find(size);
    if (it != free_blocks_.end() && !it->second.empty()) {
      void* block = it->second.back();
      it->second.pop_back();
      cached_bytes_ -= size;
      return block;
    }
  }
  void* block = nullptr;
  {
    const detail::UncountedHeapAllocations tensor_memory;  // the tracker accounts for it
    block = std::aligned_alloc(kAlignment, size);
  }
  if (block == nullptr) throw std::bad_alloc();
  return block;
}

void CachingAllocator::deallocate(void* block, std::size_t bytes) {
  if (block == nullptr) return;
  const std::size_t size = size_class(bytes);
  std::lock_guard lock(mutex_);
  free_blocks_[size].push_back(block);
  cached_bytes_ += size;
}

std::size_t CachingAllocator::cached_bytes() const {
  std::lock_guard lock(mutex_);
  return cached_bytes_;
}

void CachingAllocator::release_cached() {
  std::lock_guard lock(mutex_);
  const detail::UncountedHeapAllocations tensor_memory;
  for (auto& [size, blocks] : free_blocks_)
    for (void* block : blocks) std::free(block);
  free_blocks_.clear();
  cached_bytes_ = 0;
}

namespace {
thread_local std::shared_ptr<RankMemory> bound_memory;
}  // namespace

std::shared_ptr<RankMemory> this_rank_memory_shared() {
  // A thread that belongs to no launched rank (a test body, a tool) gets its own.
  if (!bound_memory) bound_memory = std::make_shared<RankMemory>();
  return bound_memory;
}

RankMemory& this_rank_memory() {
  return *this_rank_memory_shared();
}

ScopedRankMemory::ScopedRankMemory(std::shared_ptr<RankMemory> memory)
    : previous_(std::move(bound_memory)) {
  bound_memory = std::move(memory);
}

ScopedRankMemory::~ScopedRankMemory() {
  bound_memory = std::move(previous_);
}

void configure_process_allocator() {
  // Serve every block from the heap and never give heap memory back: buffers freed and
  // allocated again are then already mapped, instead of paying a page fault per 4 KiB.
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  // One arena for every thread: the extra arenas glibc gives new threads (MPI's progress
  // thread among them) are mmap-backed heaps that the two settings above do not keep
  // mapped, so their large temporaries would be faulted in again on every call.
  mallopt(M_ARENA_MAX, 1);
}

namespace detail {
namespace {
// A plain integer: no constructor, so it can be read from inside malloc on any thread.
thread_local int uncounted_depth = 0;

/// Keeps the compiler from moving memory accesses across this point. The compiler knows
/// that malloc reads no memory of the program, so without it an increment before a malloc
/// and the decrement after it could be merged into nothing, and the interposed malloc that
/// reads `uncounted_depth` would see 0.
void compiler_barrier() {
  asm volatile("" ::: "memory");
}
}  // namespace

UncountedHeapAllocations::UncountedHeapAllocations() {
  ++uncounted_depth;
  compiler_barrier();
}

UncountedHeapAllocations::~UncountedHeapAllocations() {
  compiler_barrier();
  --uncounted_depth;
}

bool heap_allocations_uncounted() {
  return uncounted_depth > 0;
}

}  // namespace detail

}  // namespace dp
