// Device memory and copies of cuda/device_ops.h, through the CUDA runtime (compiled with
// the host compiler: no kernel here).
//
// Memory comes from CUDA's stream-ordered allocator (cudaMallocAsync) rather than plain
// cudaMalloc, and rather than a cache of our own like the host's CachingAllocator:
//   - cudaMalloc and cudaFree synchronise the whole device (a free waits for every kernel
//     in flight), which would serialise the ranks that share a GPU and undo any overlap of
//     communication with compute;
//   - the pool behind cudaMallocAsync keeps freed blocks and hands them to the next
//     allocation on the same stream without a synchronisation, which is what a caching
//     allocator is for, and it is correct with several streams (a block freed on one
//     stream is reused on another only after the free is ordered before it), which a
//     hand-written cache would need events to get right.
// The release threshold of the pool is set to "never": by default the pool returns its
// memory to the system at every synchronisation, and allocating it again is slow.
// The rank's MemoryTracker is charged by Tensor, as for host memory; the bytes a pool keeps
// are not charged, as the host cache's are not.
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <mutex>
#include <string_view>

#include "cuda/device_ops.h"
#include "dp/error.h"

namespace dp::cuda {
namespace {

void check(cudaError_t status, std::string_view what) {
  if (status != cudaSuccess)
    throw Error(fmt::format("CUDA: {} failed: {} ({})", what, cudaGetErrorString(status),
                            cudaGetErrorName(status)));
}

/// Sets the release threshold of the current device's default pool once per device.
void keep_pool_memory() {
  static std::mutex mutex;
  static std::uint64_t configured = 0;  // bit d: device d is configured
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  const std::lock_guard lock(mutex);
  if (device < 64 && (configured & (std::uint64_t{1} << device)) != 0) return;
  cudaMemPool_t pool = nullptr;
  check(cudaDeviceGetDefaultMemPool(&pool, device), "cudaDeviceGetDefaultMemPool");
  std::uint64_t threshold = std::numeric_limits<std::uint64_t>::max();
  check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold),
        "cudaMemPoolSetAttribute(release threshold)");
  if (device < 64) configured |= std::uint64_t{1} << device;
}

}  // namespace

void check_status(int status, const char* what) {
  check(static_cast<cudaError_t>(status), what);
}

bool compiled() {
  return true;
}

int device_count() {
  int count = 0;
  // No driver or no GPU is an answer here, not an error: the GPU tests skip on it.
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the error so that it is not reported later
    return 0;
  }
  return count;
}

void* allocate(std::size_t bytes) {
  if (device_count() == 0)
    throw Error(
        "allocating a tensor on a CUDA device: this process sees no CUDA device (no GPU, "
        "no driver, or CUDA_VISIBLE_DEVICES hides them); keep the tensors on Device::kHost");
  if (bytes == 0) return nullptr;
  keep_pool_memory();
  void* block = nullptr;
  check(cudaMallocAsync(&block, bytes, cudaStreamPerThread),
        fmt::format("cudaMallocAsync of {} bytes", bytes));
  return block;
}

void deallocate(void* block) noexcept {
  // A failure here (the context is gone at exit) cannot be reported from a destructor;
  // the memory goes with the context.
  if (block != nullptr) (void)cudaFreeAsync(block, cudaStreamPerThread);
}

void copy_bytes(void* destination, const void* source, std::size_t bytes) {
  if (bytes == 0 || destination == source) return;
  // cudaMemcpyDefault: unified addressing tells host from device pointers. The copy is
  // queued on the compute stream after the kernels issued before it. From pageable host
  // memory the call returns once the source has been staged, so the caller may reuse it.
  check(cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDefault, cudaStreamPerThread),
        "cudaMemcpyAsync");
  // A host destination is read as soon as this returns: wait for the copy. A device
  // destination is only read by later work on the same stream, so a device-to-device copy
  // (Tensor::clone of an activation) does not stall the host.
  cudaPointerAttributes attributes{};
  check(cudaPointerGetAttributes(&attributes, destination), "cudaPointerGetAttributes");
  if (attributes.type != cudaMemoryTypeDevice)
    check(cudaStreamSynchronize(cudaStreamPerThread), "cudaStreamSynchronize (copy to host)");
}

void* compute_stream() {
  return static_cast<void*>(cudaStreamPerThread);
}

void synchronize() {
  check(cudaStreamSynchronize(cudaStreamPerThread), "cudaStreamSynchronize");
}

}  // namespace dp::cuda
