// device_dispatch.h: where the library's work on a tensor runs (internal).
//
// Every operation of the library that touches elements (tensor_ops.cpp, the layers, the
// optimizers, the local backend's data movement) asks `on_gpu(device)` of its operands:
//   true   the elements are GPU memory, reached only through cuda/device_ops.h (kernels,
//          copies) and cuda/comm_device.h;
//   false  the elements are host memory, and the plain host loop (the ground truth) runs
//          on them through raw pointers.
// A `Device::kCuda` tensor is host memory while the emulated device is on
// (dp::set_cuda_device_emulated): the library then runs its host code on it, while the
// public host accessors still refuse it. Code inside the library therefore reaches
// elements through `view().data()`, never through `Tensor::data()` or `span()`, which
// throw for every device tensor, emulated or not.
#pragma once

#include <cstddef>

#include "dp/comm.h"

namespace dp::detail {

/// True when elements on `device` are GPU memory (Device::kCuda without the emulation).
bool on_gpu(Device device);

/// Copies `bytes` from `source` on `source_device` to `destination` on
/// `destination_device`: memcpy when both are host memory, a CUDA copy otherwise. Returns
/// when the destination holds the bytes.
void copy_memory(void* destination, Device destination_device, const void* source,
                 Device source_device, std::size_t bytes);

}  // namespace dp::detail
