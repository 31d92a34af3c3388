// The element-wise operations of dp/tensor_ops.h on the host. Each checks its operands,
// then runs one plain loop as one compute op on the rank's clock: n flops, and the bytes
// it reads and writes, on the device's roofline.
#include "dp/tensor_ops.h"

#include <cmath>
#include <cstring>
#include <string_view>

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

void check_host(std::string_view op, Device device) {
  // The GPU backend adds its kernels here; until then only host memory exists.
  if (device != Device::kHost)
    throw Error(fmt::format("{}: no implementation for {} memory", op, to_string(device)));
}

/// The cost of one pass over `elements` that reads `reads` and writes `writes` floats
/// per element.
OpCost pass_cost(std::size_t elements, int reads, int writes) {
  const auto n = static_cast<double>(elements);
  return {.flops = n, .bytes = n * kFloatBytes * (reads + writes)};
}

}  // namespace

void fill(TensorView x, float value) {
  check_host("fill", x.device());
  float* out = x.data();
  timed_compute("fill", "", pass_cost(x.size(), 0, 1), [&] {
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = value;
  });
}

void copy(ConstTensorView source, TensorView destination) {
  check_same_size("copy", source.size(), destination.size());
  check_host("copy", source.device());
  check_host("copy", destination.device());
  timed_compute("copy", "", pass_cost(source.size(), 1, 1), [&] {
    if (source.size() > 0 && source.data() != destination.data())
      std::memcpy(destination.data(), source.data(), source.bytes());
  });
}

void scale(TensorView x, float factor) {
  check_host("scale", x.device());
  float* out = x.data();
  timed_compute("scale", "", pass_cost(x.size(), 1, 1), [&] {
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = factor * out[i];
  });
}

void divide(TensorView x, float divisor) {
  check_host("divide", x.device());
  float* out = x.data();
  timed_compute("divide", "", pass_cost(x.size(), 1, 1), [&] {
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = out[i] / divisor;
  });
}

void add(ConstTensorView x, TensorView y) {
  check_same_size("add", x.size(), y.size());
  check_host("add", x.device());
  check_host("add", y.device());
  const float* in = x.data();
  float* out = y.data();
  timed_compute("add", "", pass_cost(x.size(), 2, 1), [&] {
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = out[i] + in[i];
  });
}

void axpy(float alpha, ConstTensorView x, TensorView y) {
  check_same_size("axpy", x.size(), y.size());
  check_host("axpy", x.device());
  check_host("axpy", y.device());
  const float* in = x.data();
  float* out = y.data();
  timed_compute("axpy", "", pass_cost(x.size(), 2, 1), [&] {
    for (std::size_t i = 0; i < x.size(); ++i) {
      const float product = alpha * in[i];  // rounded on its own, as the comment promises
      out[i] = out[i] + product;
    }
  });
}

double dot(ConstTensorView x, ConstTensorView y) {
  check_same_size("dot", x.size(), y.size());
  check_host("dot", x.device());
  check_host("dot", y.device());
  const float* a = x.data();
  const float* b = y.data();
  return timed_compute("dot", "", pass_cost(x.size(), 2, 0), [&] {
    double sum = 0;
    for (std::size_t i = 0; i < x.size(); ++i)
      sum += static_cast<double>(a[i]) * static_cast<double>(b[i]);
    return sum;
  });
}

double norm(ConstTensorView x) {
  check_host("norm", x.device());
  const float* a = x.data();
  return timed_compute("norm", "", pass_cost(x.size(), 1, 0), [&] {
    double sum = 0;
    for (std::size_t i = 0; i < x.size(); ++i)
      sum += static_cast<double>(a[i]) * static_cast<double>(a[i]);
    return std::sqrt(sum);
  });
}

bool all_finite(ConstTensorView x) {
  check_host("all_finite", x.device());
  const float* a = x.data();
  return timed_compute("all_finite", "", pass_cost(x.size(), 1, 0), [&] {
    for (std::size_t i = 0; i < x.size(); ++i)
      if (!std::isfinite(a[i])) return false;
    return true;
  });
}

}  // namespace dp
