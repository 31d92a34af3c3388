#include "dp/ops.h"

#include <cblas.h>

#include <chrono>
#include <limits>

#include "cuda/device_ops.h"
#include "device_dispatch.h"
#include "dp/error.h"

namespace dp {
namespace {

CBLAS_TRANSPOSE to_cblas(Transpose transpose) {
  return transpose == Transpose::kYes ? CblasTrans : CblasNoTrans;
}

// CBLAS takes 32-bit sizes (blasint) in the usual OpenBLAS build; larger matrices would
// silently wrap, so refuse them.
blasint to_blas_int(std::int64_t value, const char* what) {
  DP_CHECK(value >= 0 && value <= std::numeric_limits<blasint>::max(),
           "BLAS argument {} = {} does not fit the BLAS integer type", what, value);
  return static_cast<blasint>(value);
}

// (rows, cols) of op(t) for a 2-D tensor t.
std::pair<std::int64_t, std::int64_t> op_shape(const Tensor& t, Transpose transpose,
                                               const char* operand) {
  if (t.rank() != 2)
    throw Error(
        fmt::format("matmul expects 2-D operands, got {} of shape {}", operand, t.shape_string()));
  return transpose == Transpose::kYes ? std::pair{t.dim(1), t.dim(0)}
                                      : std::pair{t.dim(0), t.dim(1)};
}

thread_local double blas_seconds = 0;

/// Adds the wall time of its own lifetime to this thread's BLAS time.
class BlasTimer {
 public:
  BlasTimer() : start_(std::chrono::steady_clock::now()) {}
  ~BlasTimer() {
    blas_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  BlasTimer(const BlasTimer&) = delete;
  BlasTimer& operator=(const BlasTimer&) = delete;

 private:
  std::chrono::steady_clock::time_point start_;
};

}  // namespace

double blas_seconds_of_this_thread() {
  return blas_seconds;
}

void gemm(Transpose transpose_a, Transpose transpose_b, std::int64_t m, std::int64_t n,
          std::int64_t k, float alpha, const float* a, std::int64_t lda, const float* b,
          std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  if (m == 0 || n == 0) return;  // nothing to write; BLAS rejects some zero strides
  const BlasTimer timer;
  cblas_sgemm(CblasRowMajor, to_cblas(transpose_a), to_cblas(transpose_b), to_blas_int(m, "m"),
              to_blas_int(n, "n"), to_blas_int(k, "k"), alpha, a, to_blas_int(lda, "lda"), b,
              to_blas_int(ldb, "ldb"), beta, c, to_blas_int(ldc, "ldc"));
}

void gemv(Transpose transpose_a, std::int64_t rows, std::int64_t cols, float alpha, const float* a,
          std::int64_t lda, const float* x, float beta, float* y) {
  if (rows == 0 || cols == 0) {
    // An empty product: y = beta * y, which BLAS may skip for zero sizes.
    const std::int64_t y_size = transpose_a == Transpose::kYes ? cols : rows;
    for (std::int64_t i = 0; i < y_size; ++i) y[i] = beta == 0.0f ? 0.0f : beta * y[i];
    return;
  }
  const BlasTimer timer;
  cblas_sgemv(CblasRowMajor, to_cblas(transpose_a), to_blas_int(rows, "rows"),
              to_blas_int(cols, "cols"), alpha, a, to_blas_int(lda, "lda"), x, 1, beta, y, 1);
}

void matmul_into(const Tensor& a, Transpose transpose_a, const Tensor& b, Transpose transpose_b,
                 Tensor& c, float alpha, float beta) {
  const auto [m, k] = op_shape(a, transpose_a, "a");
  const auto [k_b, n] = op_shape(b, transpose_b, "b");
  if (k != k_b)
    throw Error(fmt::format("matmul: op(a) is ({}, {}) but op(b) is ({}, {}); inner sizes differ",
                            m, k, k_b, n));
  if (c.rank() != 2 || c.dim(0) != m || c.dim(1) != n)
    throw Error(fmt::format("matmul: the output must be ({}, {}), got {}", m, n, c.shape_string()));
  if (a.device() != c.device() || b.device() != c.device())
    throw Error(fmt::format(
        "matmul: the operands must live on one device, got a on {}, b on {} and the output on "
        "{} (move them with Tensor::to)",
        to_string(a.device()), to_string(b.device()), to_string(c.device())));
  // The views' raw pointers: Tensor::data() is for host memory only, and the emulated
  // device's tensors are host memory that only the library may touch (device_dispatch.h).
  if (detail::on_gpu(c.device())) {
    cuda::gemm(transpose_a == Transpose::kYes, transpose_b == Transpose::kYes, m, n, k, alpha,
               a.view().data(), a.dim(1), b.view().data(), b.dim(1), beta, c.view().data(), n);
    return;
  }
  gemm(transpose_a, transpose_b, m, n, k, alpha, a.view().data(), a.dim(1), b.view().data(),
       b.dim(1), beta, c.view().data(), n);
}

Tensor matmul(const Tensor& a, Transpose transpose_a, const Tensor& b, Transpose transpose_b,
              MemoryCategory category) {
  const std::int64_t m = op_shape(a, transpose_a, "a").first;
  const std::int64_t n = op_shape(b, transpose_b, "b").second;
  Tensor c = Tensor::uninitialized({m, n}, category, a.device());
  matmul_into(a, transpose_a, b, transpose_b, c, 1.0f, 0.0f);
  return c;
}

void set_blas_threads(int threads) {
  if (threads <= 0) throw Error(fmt::format("BLAS thread count must be positive, got {}", threads));
  openblas_set_num_threads(threads);
}

int blas_threads() {
  return openblas_get_num_threads();
}

}  // namespace dp
