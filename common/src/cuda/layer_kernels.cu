// The kernels of the layers (common/src/layers/*.cpp) on a CUDA device, for
// cuda/device_ops.h. Each kernel follows the host loop it replaces; the host code stays
// the definition, and the GPU tests compare every kernel with it.
//
// Which results equal the host's bit for bit, and which only within a tolerance:
//   - bitwise: ReLU forward and backward, the bias broadcast and cross-entropy's backward
//     (each operation rounded on its own with __fadd_rn/__fmul_rn, so nvcc cannot fuse them
//     into a multiply-add);
//   - in a fixed order of their own, reproducible from run to run and GPU to GPU, within the
//     float sum bound of the host's: the column sums of a Linear's bias gradient and of
//     LayerNorm's dgamma and dbeta (below);
//   - within a tolerance: GELU (the device's tanhf is not the host's std::tanh, a few ulps
//     apart), LayerNorm's row statistics and cross-entropy's sum of exponentials (double
//     sums added as a tree, not in index order; the double result then rounds to the same
//     float but for the rare value at a rounding boundary), and the exponentials.
//
// Column sums (the bias gradient, dgamma, dbeta) are latency-bound when one thread adds a
// whole column: a (1024, 4096) gradient is 1024 dependent additions per thread on 4096
// threads, a few per multiprocessor. So each block takes a tile of kColumnTile = 32 columns
// (one warp wide, each row read in coalesced pieces) and kRowGroups = 8 warps, and splits the
// rows into 8 consecutive groups of ceil(rows / 8) rows (the last groups may be shorter or
// empty). The summation order, fixed by the row count alone:
//     partial[g] = (((0 + x[r_g]) + x[r_g + 1]) + ...)   the rows of group g in order, float
//     sum        = ((((0 + partial[0]) + partial[1]) + ...) + partial[7])            float
//     sums[j]    = sums[j] + sum                          one addition, as the host does
// each addition rounded on its own (__fadd_rn). The host adds all rows in order; both sums
// lie within (rows - 1) u sum|x| of the exact one (u = 2^-24), so within twice that of each
// other, which the GPU tests check, and they compare the device with a host loop in the
// order above bit for bit. A warp issues the loads of kRowsInFlight rows before adding them,
// so that it keeps 8 reads in flight whatever the compiler makes of a plain loop.
//
// Row-wise operations (LayerNorm, softmax) give one block to each row: its threads stride
// over the row's columns and add their partial sums with block_sum. The widths of the labs'
// models are a few hundred to a few thousand columns, so one block per row is enough work.
#include <cuda_runtime.h>

#include <cfloat>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cuda/kernel_support.cuh"

namespace dp::cuda {
namespace {

// sqrt(2 / pi) and the cubic coefficient of the tanh approximation, computed as gelu.cpp
// computes them: sqrt(2) and 1/sqrt(pi) rounded to float, their product rounded to float
// (std::numbers is not available to nvcc's C++17).
constexpr float kSqrtTwoOverPi = 1.41421356237309504880f * 0.56418958354775628695f;
constexpr float kCubic = 0.044715f;

int grid_for(std::size_t n) {
  return blocks_for(n, kMaxBlocks);
}

constexpr int kColumnTile = 32;   // columns per block of a column sum: one warp wide
constexpr int kRowGroups = 8;     // warps per block of a column sum, one group of rows each
constexpr int kRowsInFlight = 8;  // rows a column sum loads before it adds them, in order

/// Blocks of kColumnTile x kRowGroups threads for `cols` columns.
int column_tiles(std::int64_t cols) {
  return static_cast<int>((cols + kColumnTile - 1) / kColumnTile);
}

/// The threads of a column-sum block: x the column in the tile, y the row group.
dim3 column_sum_block() {
  return dim3(kColumnTile, kRowGroups);
}

/// The rows [first, last) of row group `group` of `rows` (see the top).
__device__ void row_group(std::int64_t rows, int group, std::int64_t& first, std::int64_t& last) {
  const std::int64_t per_group = (rows + kRowGroups - 1) / kRowGroups;
  const std::int64_t start = group * per_group;
  first = start < rows ? start : rows;
  last = first + per_group < rows ? first + per_group : rows;
}

/// partial[group][column] of every group, added in group order (see the top); the result is
/// the same in every thread of the column. Every thread of the block calls it.
__device__ float add_row_groups(float (&partial)[kRowGroups][kColumnTile], float mine) {
  partial[threadIdx.y][threadIdx.x] = mine;
  __syncthreads();
  float sum = 0.0f;
#pragma unroll
  for (int group = 0; group < kRowGroups; ++group)
    sum = __fadd_rn(sum, partial[group][threadIdx.x]);
  return sum;
}

// --- Linear -------------------------------------------------------------------------------

__global__ void broadcast_rows_kernel(const float* row, float* out, std::int64_t rows,
                                      std::int64_t cols) {
  const std::size_t n = static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols);
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = row[i % static_cast<std::size_t>(cols)];
}

/// sums[j] += the sum of column j of x, in the order stated at the top: warp y adds its row
/// group of column j in order, loading kRowsInFlight rows before adding them; thread (j, 0)
/// adds the groups' sums in group order and the result into sums[j].
__global__ void add_column_sums_kernel(const float* __restrict__ x, std::int64_t rows,
                                       std::int64_t cols, float* __restrict__ sums) {
  __shared__ float partial[kRowGroups][kColumnTile];
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * kColumnTile + threadIdx.x;
  std::int64_t r = 0;
  std::int64_t last = 0;
  row_group(rows, static_cast<int>(threadIdx.y), r, last);
  float sum = 0.0f;
  if (j < cols) {
    for (; r + kRowsInFlight <= last; r += kRowsInFlight) {
      float value[kRowsInFlight];
#pragma unroll
      for (int k = 0; k < kRowsInFlight; ++k) value[k] = x[(r + k) * cols + j];
#pragma unroll
      for (int k = 0; k < kRowsInFlight; ++k) sum = __fadd_rn(sum, value[k]);
    }
    for (; r < last; ++r) sum = __fadd_rn(sum, x[r * cols + j]);
  }
  const float total = add_row_groups(partial, sum);  // every thread: it synchronises
  if (j < cols && threadIdx.y == 0) sums[j] = __fadd_rn(sums[j], total);
}

// --- Activations --------------------------------------------------------------------------

__global__ void relu_forward_kernel(const float* x, float* y, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

__global__ void relu_backward_kernel(const float* x, const float* dy, float* dx, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    dx[i] = x[i] > 0.0f ? dy[i] : 0.0f;
}

// s = sigmoid(2u) = (1 + tanh(u)) / 2, as the host computes it (dp/layers/gelu.h).
__device__ float gelu_half_one_plus_tanh(float v) {
  return 1.0f / (1.0f + expf(-2.0f * kSqrtTwoOverPi * (v + kCubic * v * v * v)));
}

__global__ void gelu_forward_kernel(const float* x, float* y, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    y[i] = x[i] * gelu_half_one_plus_tanh(x[i]);
}

__global__ void gelu_backward_kernel(const float* x, const float* dy, float* dx, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float v = x[i];
    const float s = gelu_half_one_plus_tanh(v);
    const float du_dx = kSqrtTwoOverPi * (1.0f + 3.0f * kCubic * v * v);
    dx[i] = dy[i] * (s + 2.0f * v * s * (1.0f - s) * du_dx);
  }
}

// --- LayerNorm: one block per row ---------------------------------------------------------

__global__ void layer_norm_forward_kernel(const float* x, const float* gamma, const float* beta,
                                          std::int64_t width, float eps, float* y, float* xhat,
                                          float* inv_std) {
  __shared__ double shared[kThreads];
  const std::int64_t row = blockIdx.x;
  const float* x_row = x + row * width;
  double sum = 0.0;
  for (std::int64_t j = threadIdx.x; j < width; j += kThreads) sum += x_row[j];
  shared[threadIdx.x] = sum;
  const double mean = block_sum(shared) / static_cast<double>(width);
  double squares = 0.0;
  for (std::int64_t j = threadIdx.x; j < width; j += kThreads) {
    const double centred = x_row[j] - mean;
    squares += centred * centred;
  }
  shared[threadIdx.x] = squares;
  const double variance = block_sum(shared) / static_cast<double>(width);  // biased
  const float row_inv_std = static_cast<float>(1.0 / sqrt(variance + eps));
  if (threadIdx.x == 0) inv_std[row] = row_inv_std;
  for (std::int64_t j = threadIdx.x; j < width; j += kThreads) {
    const float normalized = __fmul_rn(static_cast<float>(x_row[j] - mean), row_inv_std);
    xhat[row * width + j] = normalized;
    y[row * width + j] = __fadd_rn(__fmul_rn(gamma[j], normalized), beta[j]);
  }
}

/// dx for one row per block: with g = dy * gamma, dx = inv_std (g - mean(g) - xhat mean(g xhat)).
__global__ void layer_norm_backward_dx_kernel(const float* dy, const float* xhat,
                                              const float* inv_std, const float* gamma,
                                              std::int64_t width, float* dx) {
  __shared__ double shared[kThreads];
  const std::int64_t row = blockIdx.x;
  const float* dy_row = dy + row * width;
  const float* xhat_row = xhat + row * width;
  double sum_g = 0.0;
  double sum_g_xhat = 0.0;
  for (std::int64_t j = threadIdx.x; j < width; j += kThreads) {
    const double g = static_cast<double>(dy_row[j]) * gamma[j];
    sum_g += g;
    sum_g_xhat += g * xhat_row[j];
  }
  shared[threadIdx.x] = sum_g;
  const double mean_g = block_sum(shared) / static_cast<double>(width);
  shared[threadIdx.x] = sum_g_xhat;
  const double mean_g_xhat = block_sum(shared) / static_cast<double>(width);
  const double row_inv_std = inv_std[row];
  for (std::int64_t j = threadIdx.x; j < width; j += kThreads) {
    const double g = static_cast<double>(dy_row[j]) * gamma[j];
    dx[row * width + j] =
        static_cast<float>(row_inv_std * (g - mean_g - xhat_row[j] * mean_g_xhat));
  }
}

/// dgamma[j] += sum over rows of dy * xhat, dbeta[j] += sum over rows of dy (either output
/// may be nullptr), each in the column-sum order stated at the top, the product rounded on
/// its own before it is added.
__global__ void layer_norm_backward_params_kernel(const float* __restrict__ dy,
                                                  const float* __restrict__ xhat, std::int64_t rows,
                                                  std::int64_t width, float* dgamma, float* dbeta) {
  __shared__ float partial[kRowGroups][kColumnTile];
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * kColumnTile + threadIdx.x;
  std::int64_t r = 0;
  std::int64_t last = 0;
  row_group(rows, static_cast<int>(threadIdx.y), r, last);
  float sum_dy_xhat = 0.0f;
  float sum_dy = 0.0f;
  if (j < width) {
    for (; r + kRowsInFlight <= last; r += kRowsInFlight) {
      float d[kRowsInFlight];
      float h[kRowsInFlight];
#pragma unroll
      for (int k = 0; k < kRowsInFlight; ++k) {
        d[k] = dy[(r + k) * width + j];
        h[k] = xhat[(r + k) * width + j];
      }
#pragma unroll
      for (int k = 0; k < kRowsInFlight; ++k) {
        sum_dy_xhat = __fadd_rn(sum_dy_xhat, __fmul_rn(d[k], h[k]));
        sum_dy = __fadd_rn(sum_dy, d[k]);
      }
    }
    for (; r < last; ++r) {
      const float d = dy[r * width + j];
      sum_dy_xhat = __fadd_rn(sum_dy_xhat, __fmul_rn(d, xhat[r * width + j]));
      sum_dy = __fadd_rn(sum_dy, d);
    }
  }
  // Every thread takes part in both (they synchronise); the second waits until every thread
  // has read the first's partial sums before it overwrites them.
  const float total_dy_xhat = add_row_groups(partial, sum_dy_xhat);
  __syncthreads();
  const float total_dy = add_row_groups(partial, sum_dy);
  if (j >= width || threadIdx.y != 0) return;
  if (dgamma != nullptr) dgamma[j] = __fadd_rn(dgamma[j], total_dy_xhat);
  if (dbeta != nullptr) dbeta[j] = __fadd_rn(dbeta[j], total_dy);
}

// --- Softmax cross-entropy: one block per row ---------------------------------------------

__global__ void cross_entropy_forward_kernel(const float* logits, const int* labels,
                                             std::int64_t classes, float* probabilities,
                                             double* row_loss) {
  __shared__ float shared_max[kThreads];
  __shared__ double shared_sum[kThreads];
  const std::int64_t row = blockIdx.x;
  const float* z = logits + row * classes;
  float largest = -INFINITY;
  for (std::int64_t j = threadIdx.x; j < classes; j += kThreads) largest = fmaxf(largest, z[j]);
  shared_max[threadIdx.x] = largest;
  const float max_logit = block_max(shared_max);  // taken out: exp of a large logit overflows
  double sum_exp = 0.0;
  for (std::int64_t j = threadIdx.x; j < classes; j += kThreads)
    sum_exp += exp(static_cast<double>(z[j]) - max_logit);
  shared_sum[threadIdx.x] = sum_exp;
  const double log_sum_exp = max_logit + log(block_sum(shared_sum));
  for (std::int64_t j = threadIdx.x; j < classes; j += kThreads)
    probabilities[row * classes + j] =
        static_cast<float>(exp(static_cast<double>(z[j]) - log_sum_exp));
  if (threadIdx.x == 0) row_loss[row] = log_sum_exp - z[labels[row]];
}

__global__ void cross_entropy_backward_kernel(const float* probabilities, const int* labels,
                                              std::int64_t rows, std::int64_t classes, float factor,
                                              float* grad) {
  const std::size_t n = static_cast<std::size_t>(rows) * static_cast<std::size_t>(classes);
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const std::size_t row = i / static_cast<std::size_t>(classes);
    const std::int64_t j = static_cast<std::int64_t>(i % static_cast<std::size_t>(classes));
    const float p = probabilities[i];
    grad[i] = __fmul_rn(factor, j == labels[row] ? __fsub_rn(p, 1.0f) : p);
  }
}

/// A device copy of host labels, from the stream-ordered pool and freed on the stream.
class DeviceLabels {
 public:
  DeviceLabels(const int* labels, std::int64_t rows) {
    const std::size_t bytes = static_cast<std::size_t>(rows) * sizeof(int);
    check(cudaMallocAsync(reinterpret_cast<void**>(&labels_), bytes, compute()),
          "cudaMallocAsync (labels)");
    // From pageable memory the call returns once the labels are staged: the host may reuse
    // them, and the kernels after it on the stream see them.
    const cudaError_t status =
        cudaMemcpyAsync(labels_, labels, bytes, cudaMemcpyHostToDevice, compute());
    if (status != cudaSuccess) {
      (void)cudaFreeAsync(labels_, compute());
      check(status, "copying the labels to the device");
    }
  }
  ~DeviceLabels() { (void)cudaFreeAsync(labels_, compute()); }
  DeviceLabels(const DeviceLabels&) = delete;
  DeviceLabels& operator=(const DeviceLabels&) = delete;

  const int* get() const { return labels_; }

 private:
  int* labels_ = nullptr;
};

// --- GPT layers: the causal softmax (one block per row) and the embedding --------------------

__global__ void causal_softmax_forward_kernel(float* scores, std::int64_t time) {
  __shared__ float shared_max[kThreads];
  __shared__ double shared_sum[kThreads];
  const std::int64_t row_index = blockIdx.x;
  const std::int64_t i = row_index % time;  // this row sees positions 0..i
  float* row = scores + row_index * time;
  float largest = -INFINITY;
  for (std::int64_t j = threadIdx.x; j <= i; j += kThreads) largest = fmaxf(largest, row[j]);
  shared_max[threadIdx.x] = largest;
  const float row_max = block_max(shared_max);  // taken out: exp of a large score overflows
  double sum = 0.0;
  for (std::int64_t j = threadIdx.x; j <= i; j += kThreads) {
    const float e = expf(__fsub_rn(row[j], row_max));
    row[j] = e;
    sum += e;
  }
  shared_sum[threadIdx.x] = sum;
  const float inverse_sum = static_cast<float>(1.0 / block_sum(shared_sum));
  // Each thread rescales the entries it wrote above: no other thread's write is read.
  for (std::int64_t j = threadIdx.x; j < time; j += kThreads)
    row[j] = j <= i ? __fmul_rn(row[j], inverse_sum) : 0.0f;
}

__global__ void causal_softmax_backward_kernel(const float* probabilities, float* grad,
                                               std::int64_t time) {
  __shared__ double shared_sum[kThreads];
  const std::int64_t row_index = blockIdx.x;
  const std::int64_t i = row_index % time;
  const float* p = probabilities + row_index * time;
  float* g = grad + row_index * time;
  double weighted = 0.0;
  for (std::int64_t j = threadIdx.x; j <= i; j += kThreads)
    weighted += static_cast<double>(g[j]) * p[j];
  shared_sum[threadIdx.x] = weighted;
  const float w = static_cast<float>(block_sum(shared_sum));  // every read of g is done
  for (std::int64_t j = threadIdx.x; j < time; j += kThreads)
    g[j] = j <= i ? __fmul_rn(p[j], __fsub_rn(g[j], w)) : 0.0f;
}

__global__ void embedding_forward_kernel(const float* ids, const float* wte, const float* wpe,
                                         std::int64_t time, std::int64_t dim, std::size_t n,
                                         float* y) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += stride) {
    const std::int64_t row = static_cast<std::int64_t>(e / static_cast<std::size_t>(dim));
    const std::int64_t c = static_cast<std::int64_t>(e % static_cast<std::size_t>(dim));
    const auto token = static_cast<std::int64_t>(ids[row]);
    y[e] = __fadd_rn(wte[token * dim + c], wpe[(row % time) * dim + c]);
  }
}

// One thread per (token, feature): the rows of the token's positions in increasing order.
__global__ void embedding_token_grad_kernel(const float* dy, const std::int64_t* offsets,
                                            const std::int64_t* positions, std::int64_t dim,
                                            std::size_t n, float* dwte) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += stride) {
    const std::int64_t token = static_cast<std::int64_t>(e / static_cast<std::size_t>(dim));
    const std::int64_t c = static_cast<std::int64_t>(e % static_cast<std::size_t>(dim));
    float sum = 0.0f;
    for (std::int64_t k = offsets[token]; k < offsets[token + 1]; ++k)
      sum = __fadd_rn(sum, dy[positions[k] * dim + c]);
    dwte[e] = __fadd_rn(dwte[e], sum);
  }
}

// One thread per (position, feature): the sequences in order.
__global__ void embedding_position_grad_kernel(const float* dy, std::int64_t batch,
                                               std::int64_t time, std::int64_t dim, std::size_t n,
                                               float* dwpe) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += stride) {
    float sum = 0.0f;
    for (std::int64_t b = 0; b < batch; ++b)
      sum = __fadd_rn(sum, dy[static_cast<std::size_t>(b * time * dim) + e]);
    dwpe[e] = __fadd_rn(dwpe[e], sum);
  }
}

/// A device copy of a host array of int64, from the stream-ordered pool and freed on the
/// stream (as DeviceLabels).
class DeviceIndices {
 public:
  DeviceIndices(const std::int64_t* values, std::size_t count) {
    const std::size_t bytes = std::max<std::size_t>(count, 1) * sizeof(std::int64_t);
    check(cudaMallocAsync(reinterpret_cast<void**>(&values_), bytes, compute()),
          "cudaMallocAsync (indices)");
    if (count == 0) return;
    const cudaError_t status = cudaMemcpyAsync(values_, values, count * sizeof(std::int64_t),
                                               cudaMemcpyHostToDevice, compute());
    if (status != cudaSuccess) {
      (void)cudaFreeAsync(values_, compute());
      check(status, "copying indices to the device");
    }
  }
  ~DeviceIndices() { (void)cudaFreeAsync(values_, compute()); }
  DeviceIndices(const DeviceIndices&) = delete;
  DeviceIndices& operator=(const DeviceIndices&) = delete;

  const std::int64_t* get() const { return values_; }

 private:
  std::int64_t* values_ = nullptr;
};

std::size_t elements(std::int64_t rows, std::int64_t cols) {
  return static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols);
}

}  // namespace

void broadcast_rows(const float* row, float* out, std::int64_t rows, std::int64_t cols) {
  const std::size_t n = elements(rows, cols);
  if (n == 0) return;
  broadcast_rows_kernel<<<grid_for(n), kThreads, 0, compute()>>>(row, out, rows, cols);
  check_launch("broadcast_rows");
}

void add_column_sums(const float* x, std::int64_t rows, std::int64_t cols, float* sums) {
  if (cols == 0) return;
  add_column_sums_kernel<<<column_tiles(cols), column_sum_block(), 0, compute()>>>(x, rows, cols,
                                                                                   sums);
  check_launch("add_column_sums");
}

void relu_forward(const float* x, float* y, std::size_t n) {
  if (n == 0) return;
  relu_forward_kernel<<<grid_for(n), kThreads, 0, compute()>>>(x, y, n);
  check_launch("relu forward");
}

void relu_backward(const float* x, const float* dy, float* dx, std::size_t n) {
  if (n == 0) return;
  relu_backward_kernel<<<grid_for(n), kThreads, 0, compute()>>>(x, dy, dx, n);
  check_launch("relu backward");
}

void gelu_forward(const float* x, float* y, std::size_t n) {
  if (n == 0) return;
  gelu_forward_kernel<<<grid_for(n), kThreads, 0, compute()>>>(x, y, n);
  check_launch("gelu forward");
}

void gelu_backward(const float* x, const float* dy, float* dx, std::size_t n) {
  if (n == 0) return;
  gelu_backward_kernel<<<grid_for(n), kThreads, 0, compute()>>>(x, dy, dx, n);
  check_launch("gelu backward");
}

void layer_norm_forward(const float* x, const float* gamma, const float* beta, std::int64_t rows,
                        std::int64_t width, float eps, float* y, float* xhat, float* inv_std) {
  if (rows == 0) return;
  layer_norm_forward_kernel<<<static_cast<unsigned>(rows), kThreads, 0, compute()>>>(
      x, gamma, beta, width, eps, y, xhat, inv_std);
  check_launch("layer norm forward");
}

void layer_norm_backward(const float* dy, const float* xhat, const float* inv_std,
                         const float* gamma, std::int64_t rows, std::int64_t width, float* dx,
                         float* dgamma, float* dbeta) {
  if (rows == 0) return;
  layer_norm_backward_dx_kernel<<<static_cast<unsigned>(rows), kThreads, 0, compute()>>>(
      dy, xhat, inv_std, gamma, width, dx);
  check_launch("layer norm backward (dx)");
  if (dgamma == nullptr && dbeta == nullptr) return;
  layer_norm_backward_params_kernel<<<column_tiles(width), column_sum_block(), 0, compute()>>>(
      dy, xhat, rows, width, dgamma, dbeta);
  check_launch("layer norm backward (dgamma, dbeta)");
}

double cross_entropy_forward(const float* logits, const int* labels, std::int64_t rows,
                             std::int64_t classes, float* probabilities) {
  if (rows == 0) return 0.0;
  const DeviceLabels device_labels(labels, rows);
  double* row_loss = nullptr;
  check(cudaMallocAsync(reinterpret_cast<void**>(&row_loss),
                        static_cast<std::size_t>(rows) * sizeof(double), compute()),
        "cudaMallocAsync (row losses)");
  cross_entropy_forward_kernel<<<static_cast<unsigned>(rows), kThreads, 0, compute()>>>(
      logits, device_labels.get(), classes, probabilities, row_loss);
  cudaError_t status = cudaGetLastError();
  std::vector<double> host_loss(static_cast<std::size_t>(rows));
  if (status == cudaSuccess)
    status = read_back(host_loss.data(), row_loss, host_loss.size() * sizeof(double));
  (void)cudaFreeAsync(row_loss, compute());
  check(status, "cross-entropy forward");
  double total = 0.0;  // in row order, as the host loop adds them
  for (const double loss : host_loss) total += loss;
  return total;
}

void cross_entropy_backward(const float* probabilities, const int* labels, std::int64_t rows,
                            std::int64_t classes, float factor, float* grad) {
  const std::size_t n = elements(rows, classes);
  if (n == 0) return;
  const DeviceLabels device_labels(labels, rows);
  cross_entropy_backward_kernel<<<grid_for(n), kThreads, 0, compute()>>>(
      probabilities, device_labels.get(), rows, classes, factor, grad);
  check_launch("cross-entropy backward");
}

void causal_softmax_forward(float* scores, std::int64_t rows, std::int64_t time) {
  if (rows == 0) return;
  causal_softmax_forward_kernel<<<static_cast<unsigned>(rows), kThreads, 0, compute()>>>(scores,
                                                                                         time);
  check_launch("causal softmax forward");
}

void causal_softmax_backward(const float* probabilities, float* grad, std::int64_t rows,
                             std::int64_t time) {
  if (rows == 0) return;
  causal_softmax_backward_kernel<<<static_cast<unsigned>(rows), kThreads, 0, compute()>>>(
      probabilities, grad, time);
  check_launch("causal softmax backward");
}

void embedding_forward(const float* ids, const float* wte, const float* wpe, std::int64_t batch,
                       std::int64_t time, std::int64_t dim, float* y) {
  const std::size_t n = elements(batch * time, dim);
  if (n == 0) return;
  embedding_forward_kernel<<<grid_for(n), kThreads, 0, compute()>>>(ids, wte, wpe, time, dim, n, y);
  check_launch("embedding forward");
}

void embedding_backward(const float* dy, const std::int64_t* offsets, const std::int64_t* positions,
                        std::int64_t vocab, std::int64_t batch, std::int64_t time, std::int64_t dim,
                        float* dwte, float* dwpe) {
  if (dwte != nullptr) {
    const DeviceIndices device_offsets(offsets, static_cast<std::size_t>(vocab + 1));
    const DeviceIndices device_positions(positions, static_cast<std::size_t>(batch * time));
    const std::size_t n = elements(vocab, dim);
    embedding_token_grad_kernel<<<grid_for(n), kThreads, 0, compute()>>>(
        dy, device_offsets.get(), device_positions.get(), dim, n, dwte);
    check_launch("embedding backward (wte)");
  }
  if (dwpe != nullptr) {
    const std::size_t n = elements(time, dim);
    if (n == 0) return;
    embedding_position_grad_kernel<<<grid_for(n), kThreads, 0, compute()>>>(dy, batch, time, dim, n,
                                                                            dwpe);
    check_launch("embedding backward (wpe)");
  }
}

}  // namespace dp::cuda
