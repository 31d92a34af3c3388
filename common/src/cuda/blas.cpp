// The matrix products of cuda/device_ops.h through cuBLAS (compiled with the host compiler).
//
// Row-major without a copy: cuBLAS is column-major, and a row-major (m, n) matrix with row
// stride ldc is, read column-major, its transpose (n, m) with leading dimension ldc. So
//     C = op(A) op(B)   (row-major)   <=>   C^T = op(B)^T op(A)^T   (column-major),
// which is one cublasSgemm with the operands swapped, m and n swapped, and the same
// transpose flags: the transposes are already there in how the memory is read.
//
// One handle per thread and device, that is per rank: a cuBLAS handle must not be used by
// two threads at once, and each rank's products must go to its own compute stream. Handles
// come from a pool (cuda/handle_pool.h): a thread leases one on its first product on a
// device and gives it back when it ends, so the ranks of the next launch reuse them instead
// of making new ones; the pool destroys them at process exit.
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
#include <atomic>
#include <cstddef>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda/device_ops.h"
#include "cuda/handle_pool.h"
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

/// A new handle on the current device, in full float32 (the stream is set per lease).
cublasHandle_t create_handle(int /*device*/) {
  cublasHandle_t handle = nullptr;
  check_cublas(cublas().create(&handle), "cublasCreate");
  const cublasStatus_t status = cublas().set_math_mode(handle, CUBLAS_DEFAULT_MATH);
  if (status != CUBLAS_STATUS_SUCCESS) (void)cublas().destroy(handle);
  check_cublas(status, "cublasSetMathMode");
  return handle;
}

/// At process exit the CUDA context may already be gone: nothing to report then.
void destroy_handle(cublasHandle_t handle) {
  (void)cublas().destroy(handle);
}

/// The process's handles (see cuda/handle_pool.h), made on first use and never freed before
/// exit; the leases of the main thread are returned first (thread-locals end before statics).
HandlePool<cublasHandle_t>& handle_pool() {
  static HandlePool<cublasHandle_t> pool(create_handle, destroy_handle);
  return pool;
}

std::atomic<bool> pooling{true};               // set_cublas_handle_pooling
std::atomic<std::size_t> unpooled_created{0};  // handles made with pooling off

/// The calling thread's handles, one per device it multiplied on: leased from the pool on
/// first use and given back (or destroyed, without pooling) when the thread ends.
class ThreadHandles {
 public:
  ThreadHandles() = default;
  ~ThreadHandles() {
    for (const auto& [device, handle] : leased_) {
      // The handle's workspace may still serve products queued on this thread's stream:
      // they finish before another thread's products can use it (errors are ignored: at
      // process exit the context may be gone).
      if (cudaSetDevice(device) == cudaSuccess) (void)cudaStreamSynchronize(cudaStreamPerThread);
      if (pooling.load()) {
        handle_pool().release(device, handle);
      } else {
        destroy_handle(handle);
      }
    }
  }
  ThreadHandles(const ThreadHandles&) = delete;
  ThreadHandles& operator=(const ThreadHandles&) = delete;

  /// The handle for the calling thread's current device, on the thread's compute stream.
  cublasHandle_t get() {
    int device = 0;
    check_status(static_cast<int>(cudaGetDevice(&device)), "cudaGetDevice (cuBLAS handle)");
    for (const auto& [leased_device, handle] : leased_)
      if (leased_device == device) return handle;
    cublasHandle_t handle = nullptr;
    if (pooling.load()) {
      handle = handle_pool().acquire(device);
    } else {
      handle = create_handle(device);
      unpooled_created.fetch_add(1);
    }
    leased_.emplace_back(device, handle);
    // cudaStreamPerThread names the calling thread's own stream, so a handle another thread
    // used before points at this thread's stream too; set again in case a caller changed it.
    check_cublas(cublas().set_stream(handle, cudaStreamPerThread), "cublasSetStream");
    return handle;
  }

 private:
  std::vector<std::pair<int, cublasHandle_t>> leased_;  // few: one per device
};

cublasHandle_t thread_handle() {
  thread_local ThreadHandles handles;
  return handles.get();
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

void set_cublas_handle_pooling(bool pooled) {
  pooling.store(pooled);
}

std::size_t cublas_handles_created() {
  return handle_pool().created() + unpooled_created.load();
}

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
