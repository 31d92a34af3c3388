// The element-wise operations of dp/tensor_ops.h. Each checks its operands and dispatches
// on their device (detail::on_gpu): in host memory it runs one plain loop (the readable
// ground truth), on a GPU the kernel of cuda/kernels.cu, which gives the same results
// (bitwise for the element-wise operations, within the bound stated there for dot and
// norm). Either way it is one compute op on the rank's clock: n flops, and the bytes it
// reads and writes, on the device's roofline.
//
// 16-bit elements (bfloat16, float16) go through dp/float16.h on the host; the kernels run the
// same bit arithmetic (dp/float16_bits.h), so their results are the host's bit for bit too.
#include "dp/tensor_ops.h"

#include <cmath>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "cuda/device_ops.h"
#include "device_dispatch.h"
#include "dp/clock.h"
#include "dp/error.h"
#include "dp/float16.h"
#include "element_types.h"

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

/// The cost of one pass over `elements` that reads and writes `bytes_per_element` bytes of
/// each (the sum of its operands' element sizes).
OpCost pass_cost_bytes(std::size_t elements, std::size_t bytes_per_element) {
  const auto n = static_cast<double>(elements);
  return {.flops = n, .bytes = n * static_cast<double>(bytes_per_element)};
}

/// Throws `dp::Error` unless operand `operand` of `op`, of elements of `type`, is float32.
void require_float32(std::string_view op, std::string_view operand, DataType type) {
  if (type != DataType::kFloat32)
    throw Error(fmt::format(
        "{}: {} holds {} elements; expected float32 ({} works on float32: dp::convert the "
        "elements to a float32 view first)",
        op, operand, to_string(type), op));
}

/// Throws `dp::Error` unless `y`, the accumulator of `op`, is float32 (its x may be of any
/// type).
void require_float32_accumulator(std::string_view op, DataType x_type, DataType y_type) {
  if (y_type != DataType::kFloat32)
    throw Error(fmt::format(
        "{}: y holds {} elements (x {}); expected a float32 y: {} adds into float32, widening "
        "a 16-bit x exactly (rounding every sum to 16 bits would lose the small terms; "
        "dp::convert the result to 16 bits once at the end)",
        op, to_string(y_type), to_string(x_type), op));
}

using detail::device_element;
using detail::narrow;
using detail::widen;
using detail::with_element_type;

/// The host loop of `convert`: out[i] = in[i] in To's type, through float32.
template <typename From, typename To>
void convert_on_host(const From* in, To* out, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) out[i] = narrow<To>(widen(in[i]));
}

}  // namespace

void fill(TensorView x, float value) {
  const DataType type = x.dtype();
  void* first = x.raw_data();
  timed_compute("fill", "", pass_cost_bytes(x.size(), element_size(type)), [&] {
    if (type == DataType::kFloat32) {
      float* out = static_cast<float*>(first);
      if (detail::on_gpu(x.device())) return cuda::fill(out, x.size(), value);
      for (std::size_t i = 0; i < x.size(); ++i) out[i] = value;
      return;
    }
    // A 16-bit type: the value is rounded once, and every element gets its bits.
    const std::uint16_t bits =
        type == DataType::kBFloat16 ? to_bfloat16(value).bits : to_float16(value).bits;
    auto* out = static_cast<std::uint16_t*>(first);
    if (detail::on_gpu(x.device())) return cuda::fill_bits16(out, x.size(), bits);
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = bits;
  });
}

void copy(ConstTensorView source, TensorView destination) {
  check_same_size("copy", source.size(), destination.size());
  if (source.dtype() != destination.dtype())
    throw Error(
        fmt::format("copy: the views hold {} and {} elements; expected the same type (dp::convert "
                    "converts between types)",
                    to_string(source.dtype()), to_string(destination.dtype())));
  // The one operation that crosses devices: host to device, device to host or within a
  // device. It returns when a host destination holds the elements.
  timed_compute("copy", "", pass_cost(source.size(), 1, 1), [&] {
    if (source.size() == 0 || source.raw_data() == destination.raw_data()) return;
    detail::copy_memory(destination.raw_data(), destination.device(), source.raw_data(),
                        source.device(), source.bytes());
  });
}

void convert(ConstTensorView source, TensorView destination) {
  check_same_size("convert", source.size(), destination.size());
  const Device device = common_device("convert", source.device(), destination.device());
  const DataType from = source.dtype();
  const DataType to = destination.dtype();
  const std::size_t n = source.size();
  timed_compute("convert", "", pass_cost_bytes(n, element_size(from) + element_size(to)), [&] {
    if (n == 0) return;
    if (from == to) {  // nothing to round: the bytes as they are
      if (source.raw_data() != destination.raw_data())
        detail::copy_memory(destination.raw_data(), device, source.raw_data(), device,
                            source.bytes());
      return;
    }
    if (detail::on_gpu(device))
      return cuda::convert(source.raw_data(), device_element(from), destination.raw_data(),
                           device_element(to), n);
    with_element_type(from, [&]<typename From>(From) {
      with_element_type(to, [&]<typename To>(To) {
        convert_on_host(static_cast<const From*>(source.raw_data()),
                        static_cast<To*>(destination.raw_data()), n);
      });
    });
  });
}

void scale(TensorView x, float factor) {
  require_float32("scale", "x", x.dtype());
  float* out = x.data();
  timed_compute("scale", "", pass_cost(x.size(), 1, 1), [&] {
    if (detail::on_gpu(x.device())) return cuda::scale(out, x.size(), factor);
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = factor * out[i];
  });
}

void divide(TensorView x, float divisor) {
  require_float32("divide", "x", x.dtype());
  float* out = x.data();
  timed_compute("divide", "", pass_cost(x.size(), 1, 1), [&] {
    if (detail::on_gpu(x.device())) return cuda::divide(out, x.size(), divisor);
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = out[i] / divisor;
  });
}

void add(ConstTensorView x, TensorView y) {
  check_same_size("add", x.size(), y.size());
  const Device device = common_device("add", x.device(), y.device());
  require_float32_accumulator("add", x.dtype(), y.dtype());
  float* out = y.data();
  const std::size_t n = x.size();
  timed_compute("add", "", pass_cost_bytes(n, element_size(x.dtype()) + 2 * sizeof(float)), [&] {
    if (detail::on_gpu(device)) {
      if (x.dtype() == DataType::kFloat32) return cuda::add(x.data(), out, n);
      return cuda::add_widened(x.raw_data(), device_element(x.dtype()), out, n);
    }
    with_element_type(x.dtype(), [&]<typename T>(T) {
      const T* in = x.data<T>();
      for (std::size_t i = 0; i < n; ++i) out[i] = out[i] + widen(in[i]);
    });
  });
}

void axpy(float alpha, ConstTensorView x, TensorView y) {
  check_same_size("axpy", x.size(), y.size());
  const Device device = common_device("axpy", x.device(), y.device());
  require_float32_accumulator("axpy", x.dtype(), y.dtype());
  float* out = y.data();
  const std::size_t n = x.size();
  timed_compute("axpy", "", pass_cost_bytes(n, element_size(x.dtype()) + 2 * sizeof(float)), [&] {
    if (detail::on_gpu(device)) {
      if (x.dtype() == DataType::kFloat32) return cuda::axpy(alpha, x.data(), out, n);
      return cuda::axpy_widened(alpha, x.raw_data(), device_element(x.dtype()), out, n);
    }
    with_element_type(x.dtype(), [&]<typename T>(T) {
      const T* in = x.data<T>();
      for (std::size_t i = 0; i < n; ++i) {
        const float product = alpha * widen(in[i]);  // rounded on its own, as promised
        out[i] = out[i] + product;
      }
    });
  });
}

double dot(ConstTensorView x, ConstTensorView y) {
  check_same_size("dot", x.size(), y.size());
  require_float32("dot", "x", x.dtype());
  require_float32("dot", "y", y.dtype());
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
  require_float32("norm", "x", x.dtype());
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
  const DataType type = x.dtype();
  return timed_compute("all_finite", "", pass_cost_bytes(x.size(), element_size(type)), [&] {
    if (detail::on_gpu(x.device())) {
      if (type == DataType::kFloat32) return cuda::all_finite(x.data(), x.size());
      return cuda::all_finite_bits16(static_cast<const std::uint16_t*>(x.raw_data()),
                                     device_element(type), x.size());
    }
    return with_element_type(type, [&]<typename T>(T) {
      const T* a = x.data<T>();
      for (std::size_t i = 0; i < x.size(); ++i)
        if (!std::isfinite(widen(a[i]))) return false;
      return true;
    });
  });
}

}  // namespace dp
