// The counting allocation functions of the check programs (see heap_use.h): every form of
// the global operator new, and the C library's malloc family, replaced in the executable
// itself (the dynamic linker then binds every call of the process to these, the C
// library's own calls included). Each counts on the calling thread and hands the request to
// the C library's allocator under its internal names (__libc_malloc, ...), so that a block
// goes back to the allocator it came from. The lab audit refuses lab code the malloc family
// outright; counting it too means that nothing reaches the heap unseen, whatever path leads
// there (a standard-library function that allocates with malloc, say).
//
// ThreadSanitizer builds (grade_lab<N>_tsan) leave the malloc family to the sanitizer, which
// must see every allocation itself; operator new is still counted there.
#include "heap_use.h"

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <new>

#include "dp/memory.h"

#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
#define DP_COUNT_MALLOC 0
#else
#define DP_COUNT_MALLOC 1
#endif

// The C library's allocator under its own names (glibc exports them for allocators that
// wrap it, as this file does).
extern "C" {
void* __libc_malloc(std::size_t bytes);                    // NOLINT(bugprone-reserved-identifier)
void* __libc_calloc(std::size_t count, std::size_t size);  // NOLINT(bugprone-reserved-identifier)
void* __libc_realloc(void* block, std::size_t bytes);      // NOLINT(bugprone-reserved-identifier)
void* __libc_memalign(std::size_t alignment,
                      std::size_t bytes);  // NOLINT(bugprone-reserved-identifier)
void __libc_free(void* block);             // NOLINT(bugprone-reserved-identifier)
}

namespace dp::grading {
namespace {

// Plain integers: no constructor runs, so counting works even while a thread starts.
thread_local std::uint64_t thread_allocations = 0;
thread_local std::uint64_t thread_bytes = 0;
thread_local std::uint64_t thread_large_bytes = 0;

void count(std::size_t bytes) {
  ++thread_allocations;
  thread_bytes += bytes;
  if (bytes >= kLargeAllocationBytes) thread_large_bytes += bytes;
}

/// Counts one call of the malloc family, unless the runtime asked for its own blocks to be
/// left out (dp::detail::UncountedHeapAllocations).
void count_malloc(std::size_t bytes) {
  if (!dp::detail::heap_allocations_uncounted()) count(bytes);
}

void* counted_allocation(std::size_t bytes, std::size_t alignment) {
  count(bytes);
  if (bytes == 0) bytes = 1;  // operator new must return a distinct pointer for 0 bytes
  if (alignment <= alignof(std::max_align_t)) return __libc_malloc(bytes);
  return __libc_memalign(alignment, bytes);
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

#if DP_COUNT_MALLOC
// NOLINTBEGIN(bugprone-reserved-identifier,cert-dcl37-c,cert-dcl51-cpp): the C library's
// replaceable allocation functions.
extern "C" {

void* malloc(std::size_t bytes) {
  dp::grading::count_malloc(bytes);
  return __libc_malloc(bytes);
}

void* calloc(std::size_t count, std::size_t size) {
  std::size_t bytes = 0;
  if (__builtin_mul_overflow(count, size, &bytes)) {
    errno = ENOMEM;
    return nullptr;
  }
  dp::grading::count_malloc(bytes);
  return __libc_calloc(count, size);
}

void* realloc(void* block, std::size_t bytes) {
  dp::grading::count_malloc(bytes);
  return __libc_realloc(block, bytes);
}

void free(void* block) {
  __libc_free(block);
}

void* memalign(std::size_t alignment, std::size_t bytes) {
  dp::grading::count_malloc(bytes);
  return __libc_memalign(alignment, bytes);
}

void* aligned_alloc(std::size_t alignment, std::size_t bytes) {
  dp::grading::count_malloc(bytes);
  return __libc_memalign(alignment, bytes);
}

int posix_memalign(void** block, std::size_t alignment, std::size_t bytes) {
  // A power of two and a multiple of sizeof(void*), as POSIX requires.
  if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment % sizeof(void*) != 0)
    return EINVAL;
  dp::grading::count_malloc(bytes);
  void* result = __libc_memalign(alignment, bytes);
  if (result == nullptr) return ENOMEM;
  *block = result;
  return 0;
}

}  // extern "C"
// NOLINTEND(bugprone-reserved-identifier,cert-dcl37-c,cert-dcl51-cpp)
#endif

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
  __libc_free(block);
}
void operator delete[](void* block) noexcept {
  __libc_free(block);
}
void operator delete(void* block, std::size_t) noexcept {
  __libc_free(block);
}
void operator delete[](void* block, std::size_t) noexcept {
  __libc_free(block);
}
void operator delete(void* block, std::align_val_t) noexcept {
  __libc_free(block);
}
void operator delete[](void* block, std::align_val_t) noexcept {
  __libc_free(block);
}
void operator delete(void* block, std::size_t, std::align_val_t) noexcept {
  __libc_free(block);
}
void operator delete[](void* block, std::size_t, std::align_val_t) noexcept {
  __libc_free(block);
}
void operator delete(void* block, const std::nothrow_t&) noexcept {
  __libc_free(block);
}
void operator delete[](void* block, const std::nothrow_t&) noexcept {
  __libc_free(block);
}
void operator delete(void* block, std::align_val_t, const std::nothrow_t&) noexcept {
  __libc_free(block);
}
void operator delete[](void* block, std::align_val_t, const std::nothrow_t&) noexcept {
  __libc_free(block);
}
// NOLINTEND(misc-new-delete-overloads)
