// ops.h: the matrix products of the runtime, as thin wrappers over CBLAS (OpenBLAS) on the
// host and cuBLAS on a CUDA device.
//
// Every matrix product in dplab goes through here, never through a naive loop: BLAS is
// tens of times faster, and one place to call it is the one place that dispatches on the
// device. Matrices are row-major. `matmul` and `matmul_into` run where their tensors live
// (all on one device); `gemm` and `gemv` take host pointers.
//
// On a CUDA device the products go through cuBLAS, one handle per thread (per rank) on the
// thread's compute stream, in full float32: the math mode is CUBLAS_DEFAULT_MATH and TF32
// is never enabled (TF32 rounds the inputs to 10 mantissa bits, an error near 1e-3 that the
// labs' equivalence checks would see). The sums run in another order than OpenBLAS's, so
// device and host agree within float32 rounding, not bit for bit (tests/gpu states the
// tolerance). Ranks are threads, so `dp::launch` sets BLAS to one thread
// per process with `set_blas_threads(1)`: the cores are already busy with ranks, and a
// single-threaded BLAS sums in a fixed order, so results are deterministic.
//
// Example:
//
//   dp::Tensor x({32, 64});                                  // (B, in)
//   dp::Tensor w({256, 64}, dp::MemoryCategory::kParameters); // (out, in)
//   dp::Tensor y = dp::matmul(x, dp::Transpose::kNo, w, dp::Transpose::kYes);  // (B, out)
//   dp::matmul_into(x, dp::Transpose::kNo, w, dp::Transpose::kYes, y, 1.0f, 1.0f);  // y += x w^T
#pragma once

#include <cstdint>

#include "dp/tensor.h"

namespace dp {

/// Whether a matrix operand is used as stored or transposed.
enum class Transpose {
  kNo,   ///< use the matrix as stored
  kYes,  ///< use its transpose
};

/// C = alpha * op(A) op(B) + beta * C on row-major matrices (cblas_sgemm).
///
/// op(A) is (m, k), op(B) is (k, n) and C is (m, n); `lda`, `ldb`, `ldc` are the row
/// strides of the matrices as stored. With beta = 0, C is overwritten (its old contents
/// may be garbage); with beta = 1 the product is added to C.
void gemm(Transpose transpose_a, Transpose transpose_b, std::int64_t m, std::int64_t n,
          std::int64_t k, float alpha, const float* a, std::int64_t lda, const float* b,
          std::int64_t ldb, float beta, float* c, std::int64_t ldc);

/// y = alpha * op(A) x + beta * y for a row-major (rows, cols) matrix A (cblas_sgemv).
///
/// x has cols elements and y has rows elements when A is not transposed, and the other
/// way round when it is.
void gemv(Transpose transpose_a, std::int64_t rows, std::int64_t cols, float alpha, const float* a,
          std::int64_t lda, const float* x, float beta, float* y);

/// c = alpha * op(a) op(b) + beta * c for 2-D tensors, on the device they live on (cuBLAS
/// on a CUDA device, float32 without TF32). Throws `dp::Error` when the shapes do not fit
/// together or the tensors live on different devices.
void matmul_into(const Tensor& a, Transpose transpose_a, const Tensor& b, Transpose transpose_b,
                 Tensor& c, float alpha = 1.0f, float beta = 0.0f);

/// A new tensor op(a) op(b) on a's device, charged under `category`; throws `dp::Error`
/// when the shapes do not fit together or the operands live on different devices.
Tensor matmul(const Tensor& a, Transpose transpose_a, const Tensor& b, Transpose transpose_b,
              MemoryCategory category = MemoryCategory::kActivations);

/// Wall seconds the calling thread has spent inside host BLAS (every `gemm` and `gemv` it
/// made; cuBLAS calls return before the GPU has run them and are not counted),
/// since it started: a benchmark's measure of how much of a training step is matrix
/// products. Timing costs two clock reads per call, nothing next to a product.
double blas_seconds_of_this_thread();

/// Sets the number of threads BLAS uses in this process (openblas_set_num_threads).
/// Throws `dp::Error` unless `threads` is positive.
void set_blas_threads(int threads);

/// The number of threads BLAS uses in this process.
int blas_threads();

}  // namespace dp
