// local_device.h (internal): the local backend's data movement for device buffers.
//
// Ranks that are threads sharing a GPU (or several GPUs of one machine) exchange device
// buffers the way they exchange host buffers: whichever thread runs a collective reads and
// writes every rank's buffer directly, here with device-to-device copies and a reduction
// kernel (cuda/comm_device.h) on its own communication stream instead of memcpy and a loop.
// The reduction visits the ranks in the host path's order, so a float sum, average or
// maximum is bitwise the host path's; the counters and the simulated clock do not look at
// the device at all.
//
// The order of events for one call with device buffers:
//   issue    `DeviceGate::at_issue` records an event on the caller's compute stream;
//   move     the moving thread calls `wait_for` for every call it moves data of (its
//            communication stream waits for each caller's event), then the copies and
//            reductions below, then `finish_device_moves()` (its stream drains);
//   complete only then is the call marked complete, so `Work::wait()` returning means the
//            results are in device memory, for every stream that runs afterwards.
#pragma once

#include <cstddef>
#include <span>

#include "cuda/comm_device.h"
#include "dp/comm.h"

namespace dp::detail {

/// True when `buffer` lives in GPU memory. A buffer on the emulated CUDA device
/// (dp::set_cuda_device_emulated) is host memory and takes the host path.
bool on_device(ConstBuffer buffer);

/// What a call with device buffers carries from its issue to the thread that moves its data.
struct DeviceGate {
  cuda::ReadyEvent ready;  ///< recorded on the caller's compute stream at issue
  int device = -1;         ///< the CUDA device of its buffers; -1 for host buffers

  /// The gate of a call with `input` and `output` (either may be empty): none for host
  /// buffers; for device buffers, their device and an event on the compute stream.
  static DeviceGate at_issue(ConstBuffer input, ConstBuffer output);
  /// Makes the calling thread's communication stream wait until the call's buffers are
  /// ready (no host block); nothing for host buffers.
  void wait_for() const;
};

/// Copies `count` elements from `src` (from `src_offset`) to `dst` (from `dst_offset`), at
/// least one of them on a device, on the calling thread's communication stream.
void copy_device_elements(MutableBuffer dst, std::size_t dst_offset, ConstBuffer src,
                          std::size_t src_offset, std::size_t count);

/// Reduces elements [src_offset, src_offset + count) of every source into elements
/// [dst_offset, dst_offset + count) of every destination, all on one device, with the
/// reduction kernel (rank order, bitwise the host's arithmetic).
void reduce_device_chunk(std::span<const MutableBuffer> destinations, std::size_t dst_offset,
                         std::span<const ConstBuffer> sources, std::size_t src_offset,
                         std::size_t count, ReduceOp op);

/// Waits for the data the calling thread moved on its communication streams; throws
/// `dp::Error` if a copy or the kernel failed. Nothing to wait for after host moves.
void finish_device_moves();

}  // namespace dp::detail
