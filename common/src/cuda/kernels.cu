// The kernels of the element-wise operations of dp/tensor_ops.h and of the optimizers'
// updates (dp/optimizer.h) on a CUDA device.
//
// Element-wise kernels (the optimizers' too) give bitwise the host's results: each element is
// computed by one thread with the same IEEE operations, and the intrinsics __fmul_rn, __fadd_rn and
// __fdiv_rn round each one on its own. Without them nvcc would contract a product and a
// sum into one fused multiply-add (rounded once), and axpy would differ from the host in
// the last bit.
//
// Reductions (dot, norm) cannot visit the elements in index order and stay parallel. Each
// product of two floats is exact in double (24 + 24 significant bits < 53), so host and
// device add the same numbers and differ only in the order of the additions: each thread
// sums a strided subset, a block adds its threads' sums as a tree, and one last block adds
// the blocks' sums in block order. Each double addition is rounded with a relative error of
// at most u = 2^-53, so either order lies within (n - 1) u sum|x[i] y[i]| of the exact sum,
// and the two results within
//     |device - host| <= 2 (n - 1) u sum|x[i] y[i]|            (dot; for norm, of the square)
// which the GPU tests check. For the norm the terms are positive: the relative difference is
// at most (n - 1) u + u for the square root, 1.1e-8 for 10^8 elements, below the spacing
// of floats (6e-8). The number of blocks depends only on n, so the device result is
// reproducible bit for bit from run to run and from GPU to GPU.
//
// bfloat16 and float16 elements (dp/tensor.h's element types) are read and written as their
// bit patterns and converted with the functions of dp/float16_bits.h, the very arithmetic the
// host runs (and tests exhaustively): a conversion on the device is the host's bit for bit,
// NaN payloads included, which CUDA's __float2bfloat16_rn and __float2half_rn do not promise.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "cuda/kernel_support.cuh"
#include "dp/float16_bits.h"

namespace dp::cuda {
namespace {

constexpr int kReduceBlocks = 512;  // reductions: at most this many partial sums

// --- Element-wise kernels: thread i handles elements i, i + stride, ... ------------------

__global__ void fill_kernel(float* x, std::size_t n, float value) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) x[i] = value;
}

__global__ void fill_bits16_kernel(std::uint16_t* x, std::size_t n, std::uint16_t bits) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) x[i] = bits;
}

__global__ void scale_kernel(float* x, std::size_t n, float factor) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    x[i] = __fmul_rn(factor, x[i]);
}

__global__ void divide_kernel(float* x, std::size_t n, float divisor) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    x[i] = __fdiv_rn(x[i], divisor);
}

__global__ void add_kernel(const float* x, float* y, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    y[i] = __fadd_rn(y[i], x[i]);
}

__global__ void axpy_kernel(float alpha, const float* x, float* y, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    y[i] = __fadd_rn(y[i], __fmul_rn(alpha, x[i]));
}

/// Sets *found to 1 when some element is not finite (every writer writes the same value).
__global__ void non_finite_kernel(const float* x, std::size_t n, int* found) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    if (!isfinite(x[i])) *found = 1;
}

/// Sets *found to 1 when some 16-bit element is not finite: its exponent bits, `exponent`
/// (0x7f80 for bfloat16, 0x7c00 for float16), all set (an infinity or a NaN).
__global__ void non_finite_bits16_kernel(const std::uint16_t* x, std::size_t n,
                                         std::uint16_t exponent, int* found) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    if ((x[i] & exponent) == exponent) *found = 1;
}

// --- Element types: storage, exact widening to float32, rounding from it ------------------

struct Float32Element {
  using Storage = float;
  __device__ static float widen(float x) { return x; }
  __device__ static float narrow(float x) { return x; }
};

struct BFloat16Element {
  using Storage = std::uint16_t;
  __device__ static float widen(std::uint16_t bits) {
    return __uint_as_float(dp::detail::float_bits_from_bfloat16_bits(bits));
  }
  __device__ static std::uint16_t narrow(float x) {
    return dp::detail::bfloat16_bits_from_float_bits(__float_as_uint(x));
  }
};

struct Float16Element {
  using Storage = std::uint16_t;
  __device__ static float widen(std::uint16_t bits) {
    return __uint_as_float(dp::detail::float_bits_from_float16_bits(bits));
  }
  __device__ static std::uint16_t narrow(float x) {
    return dp::detail::float16_bits_from_float_bits(__float_as_uint(x));
  }
};

/// y[i] = x[i] rounded to To through float32 (From's widening is exact).
template <typename From, typename To>
__global__ void convert_kernel(const typename From::Storage* x, typename To::Storage* y,
                               std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    y[i] = To::narrow(From::widen(x[i]));
}

template <typename From>
__global__ void add_widened_kernel(const typename From::Storage* x, float* y, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    y[i] = __fadd_rn(y[i], From::widen(x[i]));
}

template <typename From>
__global__ void axpy_widened_kernel(float alpha, const typename From::Storage* x, float* y,
                                    std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    y[i] = __fadd_rn(y[i], __fmul_rn(alpha, From::widen(x[i])));
}

/// Calls `body` with a value of the element struct of `type` (Float32Element,
/// BFloat16Element or Float16Element), for host code written once for the three.
template <typename Body>
void with_element(Element type, Body body) {
  switch (type) {
    case Element::kFloat32: return body(Float32Element{});
    case Element::kBFloat16: return body(BFloat16Element{});
    case Element::kFloat16: return body(Float16Element{});
  }
}

/// True unless `launch(found)`, which queues kernels that set the device int *found to 1 on
/// a non-finite element, raised the flag; `what` names the operation in errors.
template <typename Launch>
bool no_flag_raised(const char* what, Launch launch) {
  int* found = nullptr;
  check(cudaMallocAsync(reinterpret_cast<void**>(&found), sizeof(int), compute()),
        "cudaMallocAsync (all_finite flag)");
  int host_found = 0;
  cudaError_t status = cudaMemsetAsync(found, 0, sizeof(int), compute());
  if (status == cudaSuccess) {
    launch(found);
    status = cudaGetLastError();
  }
  if (status == cudaSuccess) status = read_back(&host_found, found, sizeof(int));
  (void)cudaFreeAsync(found, compute());
  check(status, what);
  return host_found == 0;
}

/// *largest = the bits of max |x[i]|. Non-negative floats order as their bit patterns read
/// as integers, so an integer atomicMax finds the largest, and the result does not depend
/// on the order the threads arrive in. The block combines its threads' maxima in shared
/// memory first, so the address sees one atomic per block instead of one per thread.
__global__ void max_abs_kernel(const float* x, std::size_t n, unsigned int* largest) {
  __shared__ unsigned int shared[kThreads];
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  unsigned int mine = 0;  // the bits of +0.0f
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    mine = max(mine, __float_as_uint(fabsf(x[i])));
  shared[threadIdx.x] = mine;
  const unsigned int block_largest =
      block_reduce(shared, [](unsigned int a, unsigned int b) { return max(a, b); });
  if (threadIdx.x == 0) atomicMax(largest, block_largest);
}

/// The arrays one launch of gradient_scan_kernel reads, passed by value (about 1 KiB of
/// kernel arguments, well under the 4 KiB every architecture accepts).
struct ScanTable {
  const float* data[kScanArraysPerLaunch];
  std::size_t size[kScanArraysPerLaunch];
  int count;
};

/// The bits of max |x| over the table's arrays, folded into *scan and *running (either may be
/// nullptr): each thread keeps its own maximum over a grid-stride walk of every array, the
/// block combines its threads' in shared memory (block_reduce), and thread 0 issues one
/// atomicMax per target, so the same address sees one atomic per block, not per thread.
__global__ void gradient_scan_kernel(ScanTable table, unsigned int* scan, unsigned int* running) {
  __shared__ unsigned int shared[kThreads];
  const std::size_t first = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  unsigned int mine = 0;  // the bits of +0.0f
  for (int a = 0; a < table.count; ++a) {
    const float* x = table.data[a];
    for (std::size_t i = first; i < table.size[a]; i += stride)
      mine = max(mine, __float_as_uint(fabsf(x[i])));
  }
  shared[threadIdx.x] = mine;
  const unsigned int largest =
      block_reduce(shared, [](unsigned int a, unsigned int b) { return max(a, b); });
  if (threadIdx.x != 0) return;
  if (scan != nullptr) atomicMax(scan, largest);
  if (running != nullptr) atomicMax(running, largest);
}

// --- Optimizers: the loops of common/src/optimizer.cpp, one element per thread ----------

__global__ void sgd_kernel(float* p, const float* grad, float* buffer, std::size_t n, float lr,
                           float momentum, float weight_decay) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float g =
        weight_decay != 0.0f ? __fadd_rn(grad[i], __fmul_rn(weight_decay, p[i])) : grad[i];
    if (buffer == nullptr) {
      p[i] = __fsub_rn(p[i], __fmul_rn(lr, g));
    } else {
      buffer[i] = __fadd_rn(__fmul_rn(momentum, buffer[i]), g);
      p[i] = __fsub_rn(p[i], __fmul_rn(lr, buffer[i]));
    }
  }
}

__global__ void adamw_kernel(float* p, const float* grad, float* m, float* v, std::size_t n,
                             AdamWStep step) {
  const float one_minus_beta1 = 1.0f - step.beta1;  // as the host loop computes them
  const float one_minus_beta2 = 1.0f - step.beta2;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float g = grad[i];
    const float decayed = __fmul_rn(p[i], step.decay);
    const float m_i = __fadd_rn(__fmul_rn(step.beta1, m[i]), __fmul_rn(one_minus_beta1, g));
    const float v_i =
        __fadd_rn(__fmul_rn(step.beta2, v[i]), __fmul_rn(__fmul_rn(one_minus_beta2, g), g));
    m[i] = m_i;
    v[i] = v_i;
    const float denominator =
        __fadd_rn(__fdiv_rn(__fsqrt_rn(v_i), step.sqrt_correction2), step.eps);
    p[i] = __fsub_rn(decayed, __fdiv_rn(__fmul_rn(step.step_size, m_i), denominator));
  }
}

// --- Reductions ---------------------------------------------------------------------------

/// partial[block] = sum over the block's elements of x[i] * y[i] (y == nullptr: x[i]^2).
__global__ void dot_partial_kernel(const float* x, const float* y, std::size_t n, double* partial) {
  __shared__ double shared[kThreads];
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  double sum = 0.0;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const double a = x[i];
    const double b = y != nullptr ? static_cast<double>(y[i]) : a;
    sum = __dadd_rn(sum, __dmul_rn(a, b));  // the product is exact: see the file comment
  }
  shared[threadIdx.x] = sum;
  const double total = block_sum(shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

/// *result = the sum of partial[0 .. count), by one block.
__global__ void sum_partials_kernel(const double* partial, int count, double* result) {
  __shared__ double shared[kThreads];
  double sum = 0.0;
  for (int i = static_cast<int>(threadIdx.x); i < count; i += kThreads)
    sum = __dadd_rn(sum, partial[i]);
  shared[threadIdx.x] = sum;
  const double total = block_sum(shared);
  if (threadIdx.x == 0) *result = total;
}

double reduce_products(const float* x, const float* y, std::size_t n) {
  if (n == 0) return 0.0;
  const int blocks = blocks_for(n, kReduceBlocks);
  // The partial sums live in a small scratch block from the stream-ordered pool (a few
  // KiB, not charged to a memory category: like the host's loop variables).
  double* scratch = nullptr;
  check(
      cudaMallocAsync(reinterpret_cast<void**>(&scratch), (blocks + 1) * sizeof(double), compute()),
      "cudaMallocAsync (reduction scratch)");
  double result = 0.0;
  cudaError_t status = cudaSuccess;
  dot_partial_kernel<<<blocks, kThreads, 0, compute()>>>(x, y, n, scratch);
  sum_partials_kernel<<<1, kThreads, 0, compute()>>>(scratch, blocks, scratch + blocks);
  status = cudaGetLastError();
  if (status == cudaSuccess) status = read_back(&result, scratch + blocks, sizeof(double));
  (void)cudaFreeAsync(scratch, compute());
  check(status, "reduction (dot, norm)");
  return result;
}

}  // namespace

void fill(float* x, std::size_t n, float value) {
  if (n == 0) return;
  fill_kernel<<<blocks_for(n, kMaxBlocks), kThreads, 0, compute()>>>(x, n, value);
  check_launch("fill");
}

void fill_bits16(std::uint16_t* x, std::size_t n, std::uint16_t bits) {
  if (n == 0) return;
  fill_bits16_kernel<<<blocks_for(n, kMaxBlocks), kThreads, 0, compute()>>>(x, n, bits);
  check_launch("fill");
}

void scale(float* x, std::size_t n, float factor) {
  if (n == 0) return;
  scale_kernel<<<blocks_for(n, kMaxBlocks), kThreads, 0, compute()>>>(x, n, factor);
  check_launch("scale");
}

void divide(float* x, std::size_t n, float divisor) {
  if (n == 0) return;
  divide_kernel<<<blocks_for(n, kMaxBlocks), kThreads, 0, compute()>>>(x, n, divisor);
  check_launch("divide");
}

void add(const float* x, float* y, std::size_t n) {
  if (n == 0) return;
  add_kernel<<<blocks_for(n, kMaxBlocks), kThreads, 0, compute()>>>(x, y, n);
  check_launch("add");
}

void axpy(float alpha, const float* x, float* y, std::size_t n) {
  if (n == 0) return;
  axpy_kernel<<<blocks_for(n, kMaxBlocks), kThreads, 0, compute()>>>(alpha, x, y, n);
  check_launch("axpy");
}

double dot(const float* x, const float* y, std::size_t n) {
  return reduce_products(x, y, n);
}

double sum_of_squares(const float* x, std::size_t n) {
  return reduce_products(x, nullptr, n);
}

void sgd_update(float* params, const float* grads, float* buffer, std::size_t n, float lr,
                float momentum, float weight_decay) {
  if (n == 0) return;
  sgd_kernel<<<blocks_for(n, kMaxBlocks), kThreads, 0, compute()>>>(params, grads, buffer, n, lr,
                                                                    momentum, weight_decay);
  check_launch("sgd update");
}

void adamw_update(float* params, const float* grads, float* m, float* v, std::size_t n,
                  const AdamWStep& step) {
  if (n == 0) return;
  adamw_kernel<<<blocks_for(n, kMaxBlocks), kThreads, 0, compute()>>>(params, grads, m, v, n, step);
  check_launch("adamw update");
}

bool all_finite(const float* x, std::size_t n) {
  if (n == 0) return true;
  return no_flag_raised("all_finite", [&](int* found) {
    non_finite_kernel<<<blocks_for(n, kMaxBlocks), kThreads, 0, compute()>>>(x, n, found);
  });
}

bool all_finite_bits16(const std::uint16_t* x, Element type, std::size_t n) {
  if (n == 0) return true;
  const std::uint16_t exponent = type == Element::kBFloat16 ? 0x7f80u : 0x7c00u;
  return no_flag_raised("all_finite", [&](int* found) {
    non_finite_bits16_kernel<<<blocks_for(n, kMaxBlocks), kThreads, 0, compute()>>>(x, n, exponent,
                                                                                    found);
  });
}

void convert(const void* x, Element from, void* y, Element to, std::size_t n) {
  if (n == 0) return;
  with_element(from, [&](auto source) {
    using From = decltype(source);
    with_element(to, [&](auto destination) {
      using To = decltype(destination);
      convert_kernel<From, To><<<blocks_for(n, kMaxBlocks), kThreads, 0, compute()>>>(
          static_cast<const typename From::Storage*>(x), static_cast<typename To::Storage*>(y), n);
    });
  });
  check_launch("convert");
}

void add_widened(const void* x, Element type, float* y, std::size_t n) {
  if (n == 0) return;
  with_element(type, [&](auto element) {
    using From = decltype(element);
    add_widened_kernel<From><<<blocks_for(n, kMaxBlocks), kThreads, 0, compute()>>>(
        static_cast<const typename From::Storage*>(x), y, n);
  });
  check_launch("add");
}

void axpy_widened(float alpha, const void* x, Element type, float* y, std::size_t n) {
  if (n == 0) return;
  with_element(type, [&](auto element) {
    using From = decltype(element);
    axpy_widened_kernel<From><<<blocks_for(n, kMaxBlocks), kThreads, 0, compute()>>>(
        alpha, static_cast<const typename From::Storage*>(x), y, n);
  });
  check_launch("axpy");
}

void fold_max_abs_bits(const float* const* arrays, const std::size_t* sizes, std::size_t count,
                       unsigned int* scan, unsigned int* running) {
  if (scan != nullptr)
    check(cudaMemsetAsync(scan, 0, sizeof(unsigned int), compute()), "scan reset");
  for (std::size_t first = 0; first < count; first += kScanArraysPerLaunch) {
    ScanTable table{};
    std::size_t largest = 0;
    for (std::size_t i = first; i < count && i - first < kScanArraysPerLaunch; ++i) {
      table.data[table.count] = arrays[i];
      table.size[table.count] = sizes[i];
      ++table.count;
      largest = std::max(largest, sizes[i]);
    }
    if (largest == 0) continue;  // nothing to read: the targets keep their values
    // Blocks for the largest array: each block walks every array with the same stride.
    gradient_scan_kernel<<<blocks_for(largest, kMaxBlocks), kThreads, 0, compute()>>>(table, scan,
                                                                                      running);
    check_launch("gradient scan (max |x|)");
  }
}

float max_abs(const float* x, std::size_t n) {
  if (n == 0) return 0.0f;
  unsigned int* largest = nullptr;
  check(cudaMallocAsync(reinterpret_cast<void**>(&largest), sizeof(unsigned int), compute()),
        "cudaMallocAsync (max_abs result)");
  unsigned int host_largest = 0;
  cudaError_t status = cudaMemsetAsync(largest, 0, sizeof(unsigned int), compute());
  if (status == cudaSuccess) {
    max_abs_kernel<<<blocks_for(n, kMaxBlocks), kThreads, 0, compute()>>>(x, n, largest);
    status = cudaGetLastError();
  }
  if (status == cudaSuccess) status = read_back(&host_largest, largest, sizeof(unsigned int));
  (void)cudaFreeAsync(largest, compute());
  check(status, "max_abs");
  float result = 0.0f;
  static_assert(sizeof(result) == sizeof(host_largest));
  std::memcpy(&result, &host_largest, sizeof(result));
  return result;
}

}  // namespace dp::cuda
