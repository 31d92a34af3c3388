// The device functions of cuda/device_ops.h in a build without CUDA: each one says so.
#include <cstddef>
#include <cstdint>
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

void* compute_stream() {
  no_cuda("a compute stream");
}
void synchronize() {
  no_cuda("synchronize");
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
void fill_bits16(std::uint16_t* /*x*/, std::size_t /*n*/, std::uint16_t /*bits*/) {
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
bool all_finite_bits16(const std::uint16_t* /*x*/, Element /*type*/, std::size_t /*n*/) {
  no_cuda("all_finite");
}
void convert(const void* /*x*/, Element /*from*/, void* /*y*/, Element /*to*/, std::size_t /*n*/) {
  no_cuda("convert");
}
void add_widened(const void* /*x*/, Element /*type*/, float* /*y*/, std::size_t /*n*/) {
  no_cuda("add");
}
void axpy_widened(float /*alpha*/, const void* /*x*/, Element /*type*/, float* /*y*/,
                  std::size_t /*n*/) {
  no_cuda("axpy");
}

float max_abs(const float* /*x*/, std::size_t /*n*/) {
  no_cuda("max_abs");
}

void fold_max_abs_bits(const float* const* /*arrays*/, const std::size_t* /*sizes*/,
                       std::size_t /*count*/, unsigned int* /*scan*/, unsigned int* /*running*/) {
  no_cuda("fold_max_abs_bits");
}

void set_cublas_handle_pooling(bool /*pooled*/) {}  // nothing to pool without CUDA

std::size_t cublas_handles_created() {
  return 0;
}

void gemm(bool /*transpose_a*/, bool /*transpose_b*/, std::int64_t /*m*/, std::int64_t /*n*/,
          std::int64_t /*k*/, float /*alpha*/, const float* /*a*/, std::int64_t /*lda*/,
          const float* /*b*/, std::int64_t /*ldb*/, float /*beta*/, float* /*c*/,
          std::int64_t /*ldc*/) {
  no_cuda("a matrix product");
}

void broadcast_rows(const float* /*row*/, float* /*out*/, std::int64_t /*rows*/,
                    std::int64_t /*cols*/) {
  no_cuda("linear forward (bias)");
}
void add_column_sums(const float* /*x*/, std::int64_t /*rows*/, std::int64_t /*cols*/,
                     float* /*sums*/) {
  no_cuda("linear backward (bias gradient)");
}
void relu_forward(const float* /*x*/, float* /*y*/, std::size_t /*n*/) {
  no_cuda("relu forward");
}
void relu_backward(const float* /*x*/, const float* /*dy*/, float* /*dx*/, std::size_t /*n*/) {
  no_cuda("relu backward");
}
void gelu_forward(const float* /*x*/, float* /*y*/, std::size_t /*n*/) {
  no_cuda("gelu forward");
}
void gelu_backward(const float* /*x*/, const float* /*dy*/, float* /*dx*/, std::size_t /*n*/) {
  no_cuda("gelu backward");
}
void layer_norm_forward(const float* /*x*/, const float* /*gamma*/, const float* /*beta*/,
                        std::int64_t /*rows*/, std::int64_t /*width*/, float /*eps*/, float* /*y*/,
                        float* /*xhat*/, float* /*inv_std*/) {
  no_cuda("layer norm forward");
}
void layer_norm_backward(const float* /*dy*/, const float* /*xhat*/, const float* /*inv_std*/,
                         const float* /*gamma*/, std::int64_t /*rows*/, std::int64_t /*width*/,
                         float* /*dx*/, float* /*dgamma*/, float* /*dbeta*/) {
  no_cuda("layer norm backward");
}
double cross_entropy_forward(const float* /*logits*/, const int* /*labels*/, std::int64_t /*rows*/,
                             std::int64_t /*classes*/, float* /*probabilities*/) {
  no_cuda("cross-entropy forward");
}
void cross_entropy_backward(const float* /*probabilities*/, const int* /*labels*/,
                            std::int64_t /*rows*/, std::int64_t /*classes*/, float /*factor*/,
                            float* /*grad*/) {
  no_cuda("cross-entropy backward");
}
void causal_softmax_forward(float* /*scores*/, std::int64_t /*rows*/, std::int64_t /*time*/) {
  no_cuda("causal softmax forward");
}
void causal_softmax_backward(const float* /*probabilities*/, float* /*grad*/, std::int64_t /*rows*/,
                             std::int64_t /*time*/) {
  no_cuda("causal softmax backward");
}
void embedding_forward(const float* /*ids*/, const float* /*wte*/, const float* /*wpe*/,
                       std::int64_t /*batch*/, std::int64_t /*time*/, std::int64_t /*dim*/,
                       float* /*y*/) {
  no_cuda("embedding forward");
}
void embedding_backward(const float* /*dy*/, const std::int64_t* /*offsets*/,
                        const std::int64_t* /*positions*/, std::int64_t /*vocab*/,
                        std::int64_t /*batch*/, std::int64_t /*time*/, std::int64_t /*dim*/,
                        float* /*dwte*/, float* /*dwpe*/) {
  no_cuda("embedding backward");
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
