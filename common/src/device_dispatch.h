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

// The emulated device's memory. A GPU refuses a host address handed over as device memory
// (NCCL and the kernels fault on it), so a buffer's device label cannot lie there. The
// emulated device's memory is the host's, so the label alone would be believed: a host
// buffer relabelled Device::kCuda would pass for device memory wherever the label is read
// (the graders read each call's). The runtime therefore notes every block it holds as
// emulated device memory, and the backends check that a Device::kCuda buffer lies in one.

/// Notes [first, first + bytes) as a block of emulated device memory: a Device::kCuda
/// tensor's, or a runtime buffer's, while the emulation is on. Nothing for 0 bytes.
void note_emulated_device_memory(const void* first, std::size_t bytes);
/// Forgets the block noted at `first` (when it is released).
void forget_emulated_device_memory(const void* first);
/// True when [first, first + bytes) lies inside one block noted as emulated device memory.
bool in_emulated_device_memory(const void* first, std::size_t bytes);

}  // namespace dp::detail
