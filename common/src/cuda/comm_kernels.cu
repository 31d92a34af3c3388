// The reduction kernel of the local backend's collectives on device buffers
// (cuda/comm_device.h, `comm_reduce`).
//
// One thread computes element k for every destination, combining the sources in rank order
// with the host's operations, so the device result is bitwise the host's
// (`reduce_in_rank_order` in comm/local_backend.cpp): a float sum is ((s0 + s1) + s2) + ...
// with each addition rounded on its own (__fadd_rn: nvcc may not contract or reorder it),
// a maximum keeps the running value unless the next is greater (std::max's rule, NaN
// included), and an average divides the sum by p once, correctly rounded (__fdiv_rn). A
// thread reads element k of every source before it writes element k of any destination,
// and no other thread touches element k, so destinations may alias sources. bfloat16 and
// float16 elements are converted to float32, combined there and rounded back to their type
// after each step, as the host's comm/reduce_arithmetic.h and NCCL do (comm.h, `ReduceOp`):
// the same bits, except that a NaN's payload may differ (CUDA's conversions choose their own).
//
// The buffers' addresses travel in the kernel's parameter block (4 KiB for 256 ranks; CUDA
// 12.1 and later accept 32 KiB on the architectures built here), so a launch needs no copy
// of them to the device.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/comm_device.h"
#include "cuda/device_ops.h"

namespace dp::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;

/// The addresses and shape of one reduction, passed by value to the kernel.
struct ReduceParameters {
  const void* sources[kMaxReduceBuffers];
  void* destinations[kMaxReduceBuffers];
  int source_count;
  int destination_count;
  std::size_t count;
};

__device__ inline float combine(float running, float next, ReduceCombine op) {
  if (op == ReduceCombine::kMax) return running < next ? next : running;
  return __fadd_rn(running, next);
}

__device__ inline std::int32_t combine(std::int32_t running, std::int32_t next, ReduceCombine op) {
  if (op == ReduceCombine::kMax) return running < next ? next : running;
  // Wraps on overflow as the host's addition does in practice (two's complement).
  return static_cast<std::int32_t>(static_cast<std::uint32_t>(running) +
                                   static_cast<std::uint32_t>(next));
}

__device__ inline __nv_bfloat16 combine(__nv_bfloat16 running, __nv_bfloat16 next,
                                        ReduceCombine op) {
  const float a = __bfloat162float(running);
  const float b = __bfloat162float(next);
  if (op == ReduceCombine::kMax) return a < b ? next : running;
  return __float2bfloat16_rn(__fadd_rn(a, b));
}

__device__ inline __half combine(__half running, __half next, ReduceCombine op) {
  const float a = __half2float(running);
  const float b = __half2float(next);
  if (op == ReduceCombine::kMax) return a < b ? next : running;
  return __float2half_rn(__fadd_rn(a, b));
}

__device__ inline float average(float sum, int parts) {
  return __fdiv_rn(sum, static_cast<float>(parts));
}

__device__ inline std::int32_t average(std::int32_t sum, int parts) {
  return sum / parts;
}

__device__ inline __nv_bfloat16 average(__nv_bfloat16 sum, int parts) {
  return __float2bfloat16_rn(__fdiv_rn(__bfloat162float(sum), static_cast<float>(parts)));
}

__device__ inline __half average(__half sum, int parts) {
  return __float2half_rn(__fdiv_rn(__half2float(sum), static_cast<float>(parts)));
}

template <typename T>
__global__ void reduce_kernel(const ReduceParameters parameters, ReduceCombine op) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t k = blockIdx.x * blockDim.x + threadIdx.x; k < parameters.count; k += stride) {
    T value = static_cast<const T*>(parameters.sources[0])[k];
    for (int s = 1; s < parameters.source_count; ++s)
      value = combine(value, static_cast<const T*>(parameters.sources[s])[k], op);
    if (op == ReduceCombine::kAvg) value = average(value, parameters.source_count);
    for (int d = 0; d < parameters.destination_count; ++d)
      static_cast<T*>(parameters.destinations[d])[k] = value;
  }
}

template <typename T>
__global__ void divide_kernel(T* data, std::size_t count, int divisor) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t k = blockIdx.x * blockDim.x + threadIdx.x; k < count; k += stride)
    data[k] = average(data[k], divisor);
}

int blocks_for(std::size_t count) {
  const std::size_t wanted = (count + kThreads - 1) / kThreads;
  return static_cast<int>(std::min<std::size_t>(wanted, kMaxBlocks));
}

}  // namespace

void comm_divide_on(void* stream, void* data, std::size_t count, ReduceElement type, int divisor) {
  if (count == 0) return;
  const auto on = static_cast<cudaStream_t>(stream);
  switch (type) {
    case ReduceElement::kFloat32:
      divide_kernel<float>
          <<<blocks_for(count), kThreads, 0, on>>>(static_cast<float*>(data), count, divisor);
      break;
    case ReduceElement::kInt32:
      divide_kernel<std::int32_t><<<blocks_for(count), kThreads, 0, on>>>(
          static_cast<std::int32_t*>(data), count, divisor);
      break;
    case ReduceElement::kBFloat16:
      divide_kernel<__nv_bfloat16><<<blocks_for(count), kThreads, 0, on>>>(
          static_cast<__nv_bfloat16*>(data), count, divisor);
      break;
    case ReduceElement::kFloat16:
      divide_kernel<__half>
          <<<blocks_for(count), kThreads, 0, on>>>(static_cast<__half*>(data), count, divisor);
      break;
  }
  check_status(static_cast<int>(cudaGetLastError()), "comm_divide kernel launch");
}

void comm_reduce(const ReduceJob& job, int device) {
  if (job.count == 0 || job.destination_count == 0) return;
  if (job.source_count == 0 || job.source_count > kMaxReduceBuffers ||
      job.destination_count > kMaxReduceBuffers)
    check_status(static_cast<int>(cudaErrorInvalidValue),
                 "comm_reduce: 1 to 256 sources and at most 256 destinations");
  ReduceParameters parameters{};
  std::copy_n(job.sources, job.source_count, parameters.sources);
  std::copy_n(job.destinations, job.destination_count, parameters.destinations);
  parameters.source_count = static_cast<int>(job.source_count);
  parameters.destination_count = static_cast<int>(job.destination_count);
  parameters.count = job.count;
  const DeviceScope on_device(device);
  const auto stream = static_cast<cudaStream_t>(comm_stream(device));
  const int blocks = blocks_for(job.count);
  switch (job.type) {
    case ReduceElement::kFloat32:
      reduce_kernel<float><<<blocks, kThreads, 0, stream>>>(parameters, job.op);
      break;
    case ReduceElement::kInt32:
      reduce_kernel<std::int32_t><<<blocks, kThreads, 0, stream>>>(parameters, job.op);
      break;
    case ReduceElement::kBFloat16:
      reduce_kernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(parameters, job.op);
      break;
    case ReduceElement::kFloat16:
      reduce_kernel<__half><<<blocks, kThreads, 0, stream>>>(parameters, job.op);
      break;
  }
  check_status(static_cast<int>(cudaGetLastError()), "comm_reduce kernel launch");
}

}  // namespace dp::cuda
