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
//
// Loaded on first use (dlopen), not linked: cuBLAS's static constructors (cublasLt's) take
// about 0.5 s of every process start, and most processes of this project never multiply on
// a device (the grader starts thousands of check programs in CI). The functions are looked
// up by the names cublas_v2.h maps to, with the header's own types.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <limits>
#include <string>
#include <type_traits>

#include "cuda/device_ops.h"
#include "dp/error.h"

namespace dp::cuda {
namespace {

/// The cuBLAS functions this file calls, from the library loaded at first use.
struct Cublas {
  decltype(&::cublasCreate_v2) create = nullptr;
  decltype(&::cublasDestroy_v2) destroy = nullptr;
  decltype(&::cublasSetStream_v2) set_stream = nullptr;
  decltype(&::cublasSetMathMode) set_math_mode = nullptr;
  decltype(&::cublasSgemm_v2) sgemm = nullptr;
  decltype(&::cublasGetStatusString) status_string = nullptr;
};

/// Loads libcublas.so.<major of the headers> once per process; throws `dp::Error` naming
/// the library and the loader's reason when it or one of its functions is missing.
const Cublas& cublas() {
  static const Cublas library = [] {
    const std::string name = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
    void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);  // kept open for the process
    if (handle == nullptr)
      throw Error(fmt::format(
          "cuBLAS: cannot load {} ({}); install the CUDA toolkit's cuBLAS {} or put its "
          "directory on LD_LIBRARY_PATH",
          name, dlerror(), CUBLAS_VER_MAJOR));
    const auto find = [&](auto& function, const char* symbol) {
      function =
          reinterpret_cast<std::remove_reference_t<decltype(function)>>(dlsym(handle, symbol));
      if (function == nullptr) throw Error(fmt::format("cuBLAS: {} has no {}", name, symbol));
    };
    Cublas loaded;
    find(loaded.create, "cublasCreate_v2");
    find(loaded.destroy, "cublasDestroy_v2");
    find(loaded.set_stream, "cublasSetStream_v2");
    find(loaded.set_math_mode, "cublasSetMathMode");
    find(loaded.sgemm, "cublasSgemm_v2");
    find(loaded.status_string, "cublasGetStatusString");
    return loaded;
  }();
  return library;
}

void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw Error(fmt::format("cuBLAS: {} failed: {} (status {})", what,
                            cublas().status_string(status), static_cast<int>(status)));
}

/// The calling thread's cuBLAS handle, on its compute stream, in full float32.
class ThreadHandle {
 public:
  ThreadHandle() {
    check_cublas(cublas().create(&handle_), "cublasCreate");
    check_cublas(cublas().set_stream(handle_, cudaStreamPerThread), "cublasSetStream");
    check_cublas(cublas().set_math_mode(handle_, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
  }
  ~ThreadHandle() {
    // At process exit the CUDA context may already be gone: nothing to report then.
    (void)cublas().destroy(handle_);
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
  // With k = 0 a row of A or B may hold no element and its leading dimension be 0, which
  // cuBLAS refuses (it asks for at least 1); the product is then C = beta C, as BLAS defines it.
  const auto leading = [](std::int64_t ld) { return std::max<std::int64_t>(ld, 1); };
  // C^T (n, m) = op(B)^T (n, k) op(A)^T (k, m), column-major: see the top of this file.
  check_cublas(cublas().sgemm(thread_handle(), to_cublas(transpose_b), to_cublas(transpose_a),
                              to_int(n, "n"), to_int(m, "m"), to_int(k, "k"), &alpha, b,
                              to_int(leading(ldb), "ldb"), a, to_int(leading(lda), "lda"), &beta, c,
                              to_int(ldc, "ldc")),
               "cublasSgemm");
}

}  // namespace dp::cuda
