// The counting global operator new of the check programs (see heap_use.h). Every form of
// operator new is replaced, and every form of operator delete with it, so that each block
// goes back to the allocator it came from: malloc, or aligned_alloc for over-aligned types.
#include "heap_use.h"

#include <cstddef>
#include <cstdlib>
#include <new>

namespace dp::grading {
namespace {

// Plain integers: no constructor runs, so counting works even while a thread starts.
thread_local std::uint64_t thread_allocations = 0;
thread_local std::uint64_t thread_bytes = 0;
thread_local std::uint64_t thread_large_bytes = 0;

void* counted_allocation(std::size_t bytes, std::size_t alignment) {
  ++thread_allocations;
  thread_bytes += bytes;
  if (bytes >= kLargeAllocationBytes) thread_large_bytes += bytes;
  if (bytes == 0) bytes = 1;  // operator new must return a distinct pointer for 0 bytes
  if (alignment <= alignof(std::max_align_t)) return std::malloc(bytes);
  // aligned_alloc wants a size that is a multiple of the alignment.
  const std::size_t rounded = (bytes + alignment - 1) / alignment * alignment;
  return std::aligned_alloc(alignment, rounded);
}

void* allocate_or_throw(std::size_t bytes, std::size_t alignment) {
  void* block = counted_allocation(bytes, alignment);
  if (block == nullptr) throw std::bad_alloc();
  return block;
}

}  // namespace

HeapUse heap_use_of_this_thread() {
  return {thread_allocations, thread_bytes, thread_large_bytes};
}

}  // namespace dp::grading

using dp::grading::allocate_or_throw;
using dp::grading::counted_allocation;

// NOLINTBEGIN(misc-new-delete-overloads): the replaceable global allocation functions.
void* operator new(std::size_t bytes) {
  return allocate_or_throw(bytes, 0);
}
void* operator new[](std::size_t bytes) {
  return allocate_or_throw(bytes, 0);
}
void* operator new(std::size_t bytes, std::align_val_t alignment) {
  return allocate_or_throw(bytes, static_cast<std::size_t>(alignment));
}
void* operator new[](std::size_t bytes, std::align_val_t alignment) {
  return allocate_or_throw(bytes, static_cast<std::size_t>(alignment));
}
void* operator new(std::size_t bytes, const std::nothrow_t&) noexcept {
  return counted_allocation(bytes, 0);
}
void* operator new[](std::size_t bytes, const std::nothrow_t&) noexcept {
  return counted_allocation(bytes, 0);
}
void* operator new(std::size_t bytes, std::align_val_t alignment, const std::nothrow_t&) noexcept {
  return counted_allocation(bytes, static_cast<std::size_t>(alignment));
}
void* operator new[](std::size_t bytes, std::align_val_t alignment,
                     const std::nothrow_t&) noexcept {
  return counted_allocation(bytes, static_cast<std::size_t>(alignment));
}

void operator delete(void* block) noexcept {
  std::free(block);
}
void operator delete[](void* block) noexcept {
  std::free(block);
}
void operator delete(void* block, std::size_t) noexcept {
  std::free(block);
}
void operator delete[](void* block, std::size_t) noexcept {
  std::free(block);
}
void operator delete(void* block, std::align_val_t) noexcept {
  std::free(block);
}
void operator delete[](void* block, std::align_val_t) noexcept {
  std::free(block);
}
void operator delete(void* block, std::size_t, std::align_val_t) noexcept {
  std::free(block);
}
void operator delete[](void* block, std::size_t, std::align_val_t) noexcept {
  std::free(block);
}
void operator delete(void* block, const std::nothrow_t&) noexcept {
  std::free(block);
}
void operator delete[](void* block, const std::nothrow_t&) noexcept {
  std::free(block);
}
void operator delete(void* block, std::align_val_t, const std::nothrow_t&) noexcept {
  std::free(block);
}
void operator delete[](void* block, std::align_val_t, const std::nothrow_t&) noexcept {
  std::free(block);
}
// NOLINTEND(misc-new-delete-overloads)
