// The element-wise operations of dp/tensor_ops.h. Each checks its operands and dispatches
// on their device (detail::on_gpu): in host memory it runs one plain loop (the readable
// ground truth), on a GPU the kernel of cuda/kernels.cu, which gives the same results
// (bitwise for the element-wise operations, within the bound stated there for dot and
// norm). Either way it is one compute op on the rank's clock: n flops, and the bytes it
// reads and writes, on the device's roofline.
#include "dp/tensor_ops.h"

#include <cmath>
#include <string_view>

#include "cuda/device_ops.h"
#include "device_dispatch.h"
#include "dp/clock.h"
#include "dp/error.h"

namespace dp {
namespace {

constexpr double kFloatBytes = sizeof(float);

void check_same_size(std::string_view op, std::size_t first, std::size_t second) {
  if (first != second)
    throw Error(fmt::format("{}: the views hold {} and {} elements; expected equal sizes", op,
                            first, second));
}

/// The device both operands live on; throws `dp::Error` when they differ (an operation
/// never moves data between devices behind the caller's back: that is `copy`'s job).
Device common_device(std::string_view op, Device first, Device second) {
  if (first != second)
    throw Error(
        fmt::format("{}: the views live in {} and {} memory; expected both on the "
                    "same device (dp::copy moves elements between devices)",
                    op, to_string(first), to_string(second)));
  return first;
}

/// The cost of one pass over `elements` that reads `reads` and writes `writes` floats
/// per element.
OpCost pass_cost(std::size_t elements, int reads, int writes) {
  const auto n = static_cast<double>(elements);
  return {.flops = n, .bytes = n * kFloatBytes * (reads + writes)};
}

}  // namespace

void fill(TensorView x, float value) {
  float* out = x.data();
  timed_compute("fill", "", pass_cost(x.size(), 0, 1), [&] {
    if (detail::on_gpu(x.device())) return cuda::fill(out, x.size(), value);
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = value;
  });
}

void copy(ConstTensorView source, TensorView destination) {
  check_same_size("copy", source.size(), destination.size());
  // The one operation that crosses devices: host to device, device to host or within a
  // device. It returns when a host destination holds the elements.
  timed_compute("copy", "", pass_cost(source.size(), 1, 1), [&] {
    if (source.size() == 0 || source.data() == destination.data()) return;
    detail::copy_memory(destination.data(), destination.device(), source.data(), source.device(),
                        source.bytes());
  });
}

void scale(TensorView x, float factor) {
  float* out = x.data();
  timed_compute("scale", "", pass_cost(x.size(), 1, 1), [&] {
    if (detail::on_gpu(x.device())) return cuda::scale(out, x.size(), factor);
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = factor * out[i];
  });
}

void divide(TensorView x, float divisor) {
  float* out = x.data();
  timed_compute("divide", "", pass_cost(x.size(), 1, 1), [&] {
    if (detail::on_gpu(x.device())) return cuda::divide(out, x.size(), divisor);
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = out[i] / divisor;
  });
}

void add(ConstTensorView x, TensorView y) {
  check_same_size("add", x.size(), y.size());
  const Device device = common_device("add", x.device(), y.device());
  const float* in = x.data();
  float* out = y.data();
  timed_compute("add", "", pass_cost(x.size(), 2, 1), [&] {
    if (detail::on_gpu(device)) return cuda::add(in, out, x.size());
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = out[i] + in[i];
  });
}

void axpy(float alpha, ConstTensorView x, TensorView y) {
  check_same_size("axpy", x.size(), y.size());
  const Device device = common_device("axpy", x.device(), y.device());
  const float* in = x.data();
  float* out = y.data();
  timed_compute("axpy", "", pass_cost(x.size(), 2, 1), [&] {
    if (detail::on_gpu(device)) return cuda::axpy(alpha, in, out, x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      const float product = alpha * in[i];  // rounded on its own, as the comment promises
      out[i] = out[i] + product;
    }
  });
}

double dot(ConstTensorView x, ConstTensorView y) {
  check_same_size("dot", x.size(), y.size());
  const Device device = common_device("dot", x.device(), y.device());
  const float* a = x.data();
  const float* b = y.data();
  return timed_compute("dot", "", pass_cost(x.size(), 2, 0), [&] {
    if (detail::on_gpu(device)) return cuda::dot(a, b, x.size());
    double sum = 0;
    for (std::size_t i = 0; i < x.size(); ++i)
      sum += static_cast<double>(a[i]) * static_cast<double>(b[i]);
    return sum;
  });
}

double norm(ConstTensorView x) {
  const float* a = x.data();
  return timed_compute("norm", "", pass_cost(x.size(), 1, 0), [&] {
    if (detail::on_gpu(x.device())) return std::sqrt(cuda::sum_of_squares(a, x.size()));
    double sum = 0;
    for (std::size_t i = 0; i < x.size(); ++i)
      sum += static_cast<double>(a[i]) * static_cast<double>(a[i]);
    return std::sqrt(sum);
  });
}

bool all_finite(ConstTensorView x) {
  const float* a = x.data();
  return timed_compute("all_finite", "", pass_cost(x.size(), 1, 0), [&] {
    if (detail::on_gpu(x.device())) return cuda::all_finite(a, x.size());
    for (std::size_t i = 0; i < x.size(); ++i)
      if (!std::isfinite(a[i])) return false;
    return true;
  });
}

}  // namespace dp
