// The conversions of precision.h: host loops over dp/float16.h, or the kernels on a GPU.
#include "precision.h"

#include "cuda/device_ops.h"
#include "device_dispatch.h"
#include "dp/error.h"
#include "dp/float16.h"
#include "element_types.h"

namespace dp::detail {

void convert_uncharged(ConstTensorView source, TensorView destination) {
  DP_CHECK(source.size() == destination.size(), "convert of {} elements into {}", source.size(),
           destination.size());
  DP_CHECK(source.device() == destination.device(), "convert across devices");
  const std::size_t n = source.size();
  if (n == 0) return;
  if (source.dtype() == destination.dtype()) {
    if (source.raw_data() != destination.raw_data())
      copy_memory(destination.raw_data(), destination.device(), source.raw_data(), source.device(),
                  source.bytes());
    return;
  }
  if (on_gpu(source.device()))
    return cuda::convert(source.raw_data(), device_element(source.dtype()), destination.raw_data(),
                         device_element(destination.dtype()), n);
  // Host memory, or the emulated device's (host memory too): the pointers are readable.
  with_element_type(source.dtype(), [&]<typename From>(From) {
    with_element_type(destination.dtype(), [&]<typename To>(To) {
      const auto* in = static_cast<const From*>(source.raw_data());
      auto* out = static_cast<To*>(destination.raw_data());
      for (std::size_t i = 0; i < n; ++i) out[i] = narrow<To>(widen(in[i]));
    });
  });
}

Tensor widened(const Tensor& tensor, MemoryCategory category) {
  Tensor wide =
      Tensor::uninitialized(tensor.shape(), DataType::kFloat32, category, tensor.device());
  convert_uncharged(tensor.view(), wide.view());
  return wide;
}

Tensor rounded(const Tensor& tensor, DataType type, MemoryCategory category) {
  Tensor narrow_copy = Tensor::uninitialized(tensor.shape(), type, category, tensor.device());
  convert_uncharged(tensor.view(), narrow_copy.view());
  return narrow_copy;
}

void accumulate_rounded(ConstTensorView contribution, TensorView destination) {
  DP_CHECK(contribution.dtype() == DataType::kFloat32, "a contribution of {} elements",
           to_string(contribution.dtype()));
  DP_CHECK(contribution.size() == destination.size(), "accumulating {} elements into {}",
           contribution.size(), destination.size());
  const std::size_t n = contribution.size();
  if (n == 0) return;
  if (on_gpu(destination.device())) {
    if (destination.dtype() == DataType::kFloat32)
      return cuda::add(contribution.data(), destination.data(), n);
    // widen, add in float32, round: three passes through a float32 temporary
    Tensor sum({static_cast<std::int64_t>(n)}, MemoryCategory::kActivations, destination.device());
    convert_uncharged(destination, sum.view());
    cuda::add(contribution.data(), sum.view().data(), n);
    return convert_uncharged(sum.view(), destination);
  }
  const float* in = contribution.data();
  with_element_type(destination.dtype(), [&]<typename T>(T) {
    T* out = destination.data<T>();
    for (std::size_t i = 0; i < n; ++i) out[i] = narrow<T>(widen(out[i]) + in[i]);
  });
}

void scale_uncharged(TensorView x, float factor) {
  float* values = x.data();
  if (on_gpu(x.device())) return cuda::scale(values, x.size(), factor);
  for (std::size_t i = 0; i < x.size(); ++i) values[i] = factor * values[i];
}

void require_16bit_off_gpu(std::string_view layer, const Tensor& tensor) {
  if (on_gpu(tensor.device()))
    throw Error(fmt::format(
        "{}: {} activations on a GPU: the 16-bit layers run on the host and the emulated "
        "device only (train a 16-bit model with --device host or emulated)",
        layer, to_string(tensor.dtype())));
}

}  // namespace dp::detail
