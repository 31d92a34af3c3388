// The device functions of cuda/device_ops.h in a build without CUDA: each one says so.
#include <string_view>

#include "cuda/device_ops.h"
#include "dp/error.h"

namespace dp::cuda {
namespace {

[[noreturn]] void no_cuda(std::string_view what) {
  throw Error(fmt::format(
      "{} on a CUDA device: this build has no CUDA: configure with a CUDA compiler "
      "(nvcc on the PATH or CMAKE_CUDA_COMPILER set) and DP_CUDA on (the default when one "
      "is found), or keep the tensors on Device::kHost",
      what));
}

}  // namespace

void check_status(int status, const char* what) {
  if (status != 0) no_cuda(what);
}

bool compiled() {
  return false;
}
int device_count() {
  return 0;
}

void* allocate(std::size_t /*bytes*/) {
  no_cuda("allocating a tensor");
}
void deallocate(void* /*block*/) noexcept {}
void copy_bytes(void* /*destination*/, const void* /*source*/, std::size_t /*bytes*/) {
  no_cuda("copy");
}

void fill(float* /*x*/, std::size_t /*n*/, float /*value*/) {
  no_cuda("fill");
}
void scale(float* /*x*/, std::size_t /*n*/, float /*factor*/) {
  no_cuda("scale");
}
void divide(float* /*x*/, std::size_t /*n*/, float /*divisor*/) {
  no_cuda("divide");
}
void add(const float* /*x*/, float* /*y*/, std::size_t /*n*/) {
  no_cuda("add");
}
void axpy(float /*alpha*/, const float* /*x*/, float* /*y*/, std::size_t /*n*/) {
  no_cuda("axpy");
}
double dot(const float* /*x*/, const float* /*y*/, std::size_t /*n*/) {
  no_cuda("dot");
}
double sum_of_squares(const float* /*x*/, std::size_t /*n*/) {
  no_cuda("norm");
}
bool all_finite(const float* /*x*/, std::size_t /*n*/) {
  no_cuda("all_finite");
}

void sgd_update(float* /*params*/, const float* /*grads*/, float* /*buffer*/, std::size_t /*n*/,
                float /*lr*/, float /*momentum*/, float /*weight_decay*/) {
  no_cuda("sgd update");
}
void adamw_update(float* /*params*/, const float* /*grads*/, float* /*m*/, float* /*v*/,
                  std::size_t /*n*/, const AdamWStep& /*step*/) {
  no_cuda("adamw update");
}

}  // namespace dp::cuda
