// The matrix products of cuda/device_ops.h through cuBLAS (compiled with the host compiler).
//
// Row-major without a copy: cuBLAS is column-major, and a row-major (m, n) matrix with row
// stride ldc is, read column-major, its transpose (n, m) with leading dimension ldc. So
//     C = op(A) op(B)   (row-major)   <=>   C^T = op(B)^T op(A)^T   (column-major),
// which is one cublasSgemm with the operands swapped, m and n swapped, and the same
// transpose flags: the transposes are already there in how the memory is read.
//
// One handle per thread, that is per rank: a cuBLAS handle must not be used by two threads
// at once, and each rank's products must go to its own compute stream. The handle is made
// on first use and destroyed when the thread ends.
//
// Precision: the handle's math mode is CUBLAS_DEFAULT_MATH, and TF32 is never enabled, so
// the products are float32 multiply-adds as on the host (the order of the additions
// differs: the GPU tests state the tolerance). TF32 would round the inputs to 10 bits of
// mantissa, a relative error near 1e-3 that the equivalence checks of the labs would not
// tolerate. The NVIDIA_TF32_OVERRIDE environment variable can only turn TF32 off, never on.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <limits>

#include "cuda/device_ops.h"
#include "dp/error.h"

namespace dp::cuda {
namespace {

void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw Error(fmt::format("cuBLAS: {} failed: {} ({})", what, cublasGetStatusString(status),
                            cublasGetStatusName(status)));
}

/// The calling thread's cuBLAS handle, on its compute stream, in full float32.
class ThreadHandle {
 public:
  ThreadHandle() {
    check_cublas(cublasCreate(&handle_), "cublasCreate");
    check_cublas(cublasSetStream(handle_, cudaStreamPerThread), "cublasSetStream");
    check_cublas(cublasSetMathMode(handle_, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
  }
  ~ThreadHandle() {
    // At process exit the CUDA context may already be gone: nothing to report then.
    (void)cublasDestroy(handle_);
  }
  ThreadHandle(const ThreadHandle&) = delete;
  ThreadHandle& operator=(const ThreadHandle&) = delete;

  cublasHandle_t get() const { return handle_; }

 private:
  cublasHandle_t handle_ = nullptr;
};

cublasHandle_t thread_handle() {
  thread_local ThreadHandle handle;
  return handle.get();
}

// cublasSgemm takes 32-bit sizes; refuse larger ones rather than let them wrap.
int to_int(std::int64_t value, const char* what) {
  DP_CHECK(value >= 0 && value <= std::numeric_limits<int>::max(),
           "cuBLAS argument {} = {} does not fit an int", what, value);
  return static_cast<int>(value);
}

cublasOperation_t to_cublas(bool transpose) {
  return transpose ? CUBLAS_OP_T : CUBLAS_OP_N;
}

}  // namespace

void gemm(bool transpose_a, bool transpose_b, std::int64_t m, std::int64_t n, std::int64_t k,
          float alpha, const float* a, std::int64_t lda, const float* b, std::int64_t ldb,
          float beta, float* c, std::int64_t ldc) {
  if (m == 0 || n == 0) return;  // nothing to write
  // C^T (n, m) = op(B)^T (n, k) op(A)^T (k, m), column-major: see the top of this file.
  check_cublas(cublasSgemm(thread_handle(), to_cublas(transpose_b), to_cublas(transpose_a),
                           to_int(n, "n"), to_int(m, "m"), to_int(k, "k"), &alpha, b,
                           to_int(ldb, "ldb"), a, to_int(lda, "lda"), &beta, c, to_int(ldc, "ldc")),
               "cublasSgemm");
}

}  // namespace dp::cuda
