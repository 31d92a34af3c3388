// cuda/device_ops.h: what the host code of library dp asks of a CUDA device (internal).
//
// tensor.cpp and tensor_ops.cpp dispatch on a view's device and call these functions for
// device memory. The header includes no CUDA header, so the rest of the library compiles
// with the host compiler alone. Two implementations exist, one per build:
//   - runtime.cpp (memory, copies) and kernels.cu (the kernels), when DP_CUDA is on;
//   - unavailable.cpp, when it is off: every function throws a dp::Error that says how to
//     configure a build with CUDA.
//
// Every function works on the calling thread's current CUDA device and, for now, on its
// legacy default stream (one stream, so operations run in the order they are issued and a
// host read after them sees their results). A compute stream per rank comes with the
// kernels of the layers.
#pragma once

#include <cstddef>

namespace dp::cuda {

/// Throws `dp::Error` naming `what` and the CUDA error unless `status` (a cudaError_t) is
/// cudaSuccess. Defined in runtime.cpp, so that kernels.cu needs no formatting library.
void check_status(int status, const char* what);

/// True when this build has CUDA (DP_CUDA on).
bool compiled();
/// Number of CUDA devices this process sees (0 without CUDA, a driver or a GPU).
int device_count();

/// `bytes` of device memory, uninitialised (nullptr for 0); throws `dp::Error` on failure.
void* allocate(std::size_t bytes);
/// Returns memory obtained from `allocate`.
void deallocate(void* block) noexcept;

/// Copies `bytes` from `source` to `destination`, either of which may be host or device
/// memory; returns when the destination holds the bytes (a host destination can be read).
void copy_bytes(void* destination, const void* source, std::size_t bytes);

/// x[i] = value.
void fill(float* x, std::size_t n, float value);
/// x[i] = factor * x[i].
void scale(float* x, std::size_t n, float factor);
/// x[i] = x[i] / divisor.
void divide(float* x, std::size_t n, float divisor);
/// y[i] = y[i] + x[i].
void add(const float* x, float* y, std::size_t n);
/// y[i] = y[i] + (alpha * x[i]), the product rounded on its own.
void axpy(float alpha, const float* x, float* y, std::size_t n);
/// Sum of x[i] * y[i] in double precision (see kernels.cu for how it differs from the
/// host's index-order sum).
double dot(const float* x, const float* y, std::size_t n);
/// Sum of x[i]^2 in double precision (the square of the norm).
double sum_of_squares(const float* x, std::size_t n);
/// True when every x[i] is finite.
bool all_finite(const float* x, std::size_t n);

/// SGD on n elements, the arithmetic of Sgd::update (dp/optimizer.h); `buffer` is the
/// momentum buffer at the same offset, nullptr without momentum.
void sgd_update(float* params, const float* grads, float* buffer, std::size_t n, float lr,
                float momentum, float weight_decay);

/// The per-step constants of AdamW (AdamW::update computes them on the host).
struct AdamWStep {
  float beta1, beta2, eps;  ///< the settings
  float step_size;          ///< lr / (1 - beta1^t)
  float sqrt_correction2;   ///< sqrt(1 - beta2^t)
  float decay;              ///< 1 - lr * weight_decay
};
/// AdamW on n elements, the arithmetic of AdamW::update; m and v at the same offset.
void adamw_update(float* params, const float* grads, float* m, float* v, std::size_t n,
                  const AdamWStep& step);

}  // namespace dp::cuda
