// reduce_element.h: the CUDA reduction's element type of a dp::DataType (internal). The
// local backend's device reductions and the nccl backend's device division both hand
// cuda/comm_device.h an element type; it names its own enum, since it includes no dp header
// (comm_kernels.cu is compiled as C++17), so the backends map dp::DataType to it here.
#pragma once

#include <fmt/format.h>

#include <string_view>

#include "cuda/comm_device.h"
#include "dp/comm.h"
#include "dp/error.h"

namespace dp::detail {

/// The element type the device reduction and division take for `type`. Throws
/// `dp::Error`, prefixed with `operation` (e.g. "nccl: an average"), for a type no
/// reduction combines (uint8).
inline cuda::ReduceElement device_reduce_element(DataType type, std::string_view operation) {
  switch (type) {
    case DataType::kFloat32: return cuda::ReduceElement::kFloat32;
    case DataType::kInt32: return cuda::ReduceElement::kInt32;
    case DataType::kBFloat16: return cuda::ReduceElement::kBFloat16;
    case DataType::kFloat16: return cuda::ReduceElement::kFloat16;
    case DataType::kUInt8: break;
  }
  throw Error(
      fmt::format("{} of {} elements on a device: expected float32, int32, bfloat16 or "
                  "float16",
                  operation, to_string(type)));
}

}  // namespace dp::detail
