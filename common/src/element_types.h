// Element types, written once for the runtime's host loops: the kernels' name for a tensor's
// element type, the exact float32 value of an element, rounding a float32 back to a type,
// and a dispatch that calls code written once with a value of the tensor's C++ type.
// Internal to common/src (tensor_ops.cpp, precision.cpp and comm/reduce_arithmetic.h use it).
//
//   with_element_type(tensor.dtype(), [&]<typename T>(T) {
//     T* out = static_cast<T*>(tensor.raw_data());
//     for (std::size_t i = 0; i < n; ++i) out[i] = narrow<T>(2.0f * widen(out[i]));
//   });
#pragma once

#include <type_traits>

#include "cuda/device_ops.h"
#include "dp/comm.h"
#include "dp/float16.h"

namespace dp::detail {

/// The kernels' name for a tensor's element type.
inline cuda::Element device_element(DataType type) {
  switch (type) {
    case DataType::kBFloat16: return cuda::Element::kBFloat16;
    case DataType::kFloat16: return cuda::Element::kFloat16;
    default: return cuda::Element::kFloat32;
  }
}

/// The float32 value of a tensor element, exactly (every bfloat16 and float16 is a float32).
inline float widen(float value) {
  return value;
}
/// \copydoc widen(float)
inline float widen(BFloat16 value) {
  return to_float(value);
}
/// \copydoc widen(float)
inline float widen(Float16 value) {
  return to_float(value);
}

/// `value` rounded to the element type `T` (to nearest, ties to even; float is unchanged).
template <typename T>
T narrow(float value) {
  if constexpr (std::is_same_v<T, BFloat16>)
    return to_bfloat16(value);
  else if constexpr (std::is_same_v<T, Float16>)
    return to_float16(value);
  else
    return value;
}

/// Calls `body` with a value of the C++ element type of `type` (float, BFloat16 or Float16),
/// for code written once for the three types of a tensor.
template <typename Body>
decltype(auto) with_element_type(DataType type, Body&& body) {
  switch (type) {
    case DataType::kBFloat16: return body(BFloat16{});
    case DataType::kFloat16: return body(Float16{});
    default: return body(float{});
  }
}

}  // namespace dp::detail
