// cuda/kernel_support.cuh: what the .cu files of common/src/cuda/ share (internal).
//
// The compute stream, the launch shape of the grid-stride kernels, error checks after a
// launch, and the block-wide sum in a fixed order that the reductions use. Only .cu files
// include it (it needs the CUDA compiler).
//
// Example (inside a .cu file of this folder):
//
//   my_kernel<<<blocks_for(n, kMaxBlocks), kThreads, 0, compute()>>>(x, n);
//   check_launch("my kernel");
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>

#include "cuda/device_ops.h"

namespace dp::cuda {

/// Threads per block of every kernel in this folder (a power of two: `block_sum` halves it).
constexpr int kThreads = 256;
/// Element-wise kernels use at most this many blocks and a grid-stride loop past it.
constexpr int kMaxBlocks = 4096;

/// The calling thread's compute stream (cuda/device_ops.h: `compute_stream`).
inline cudaStream_t compute() {
  return cudaStreamPerThread;
}

/// Throws `dp::Error` naming `what` unless `status` is cudaSuccess.
inline void check(cudaError_t status, const char* what) {
  check_status(static_cast<int>(status), what);
}

/// Throws when the last launch failed (a bad configuration, no device, an earlier fault).
inline void check_launch(const char* kernel) {
  check(cudaGetLastError(), kernel);
}

/// Copies `bytes` from device memory to the host on the compute stream, after the work
/// issued before it, and waits for them: the way every host read synchronises.
inline cudaError_t read_back(void* host, const void* device, std::size_t bytes) {
  const cudaError_t status =
      cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, compute());
  return status != cudaSuccess ? status : cudaStreamSynchronize(compute());
}

/// Blocks of kThreads threads for n elements, at most `cap`.
inline int blocks_for(std::size_t n, int cap) {
  const std::size_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<int>(std::min<std::size_t>(blocks, static_cast<std::size_t>(cap)));
}

/// Combines the kThreads values of `shared` with `combine` as a tree in a fixed order and
/// returns the result to every thread of the block. Every thread of the block must call it;
/// `shared` may be written again as soon as it returns (the last barrier follows every
/// thread's read).
template <typename T, typename Combine>
__device__ T block_reduce(T* shared, Combine combine) {
  for (int width = kThreads / 2; width > 0; width /= 2) {
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < width)
      shared[threadIdx.x] = combine(shared[threadIdx.x], shared[threadIdx.x + width]);
  }
  __syncthreads();
  const T result = shared[0];
  __syncthreads();
  return result;
}

/// The sum of the block's `shared` doubles, added as a tree in a fixed order (so the result
/// is the same from run to run), each addition rounded on its own.
__device__ inline double block_sum(double* shared) {
  return block_reduce(shared, [](double a, double b) { return __dadd_rn(a, b); });
}

/// The largest of the block's `shared` floats (a maximum does not depend on the order).
__device__ inline float block_max(float* shared) {
  return block_reduce(shared, [](float a, float b) { return fmaxf(a, b); });
}

}  // namespace dp::cuda
