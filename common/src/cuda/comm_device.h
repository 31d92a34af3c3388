// cuda/comm_device.h: what the communicator backends ask of a CUDA device (internal).
//
// The local backend moves device buffers with these functions, and the nccl backend orders
// its calls against the caller's compute stream (`compute_stream()` of cuda/device_ops.h,
// on which every kernel of the thread runs). Like cuda/device_ops.h the header
// includes no CUDA header (streams and events are `void*` here), so the backends compile
// with the host compiler alone. Two implementations exist, one per build:
//   - comm_device.cpp (streams, events, copies) and comm_kernels.cu (the reduction), when
//     DP_CUDA is on;
//   - comm_unavailable.cpp, when it is off: every function that would touch a device throws
//     a dp::Error that says how to configure a build with CUDA.
//
// Streams. Each thread computes on its compute stream and moves communication data on a
// stream of its own (one per thread and device, created on first use, non-blocking so that
// it runs beside the compute kernels). A call's device buffers are ready when the work
// issued on the caller's compute stream before the call has run: the caller records a
// `ReadyEvent` at the call, and whichever thread moves the data first makes its own
// communication stream wait for it. The moving thread then issues copies and reductions
// and `synchronize_comm_stream()` before it marks the call complete, so a completed call's
// results are in memory for any stream that runs after the host saw it complete.
//
// The header includes no dp header either: comm_kernels.cu is compiled as C++17, and dp/comm.h
// needs C++20 (std::span). The reduction's element types and operations are its own enums.
//
// Example (what the local backend does for one all-reduce of device buffers):
//
//   cuda::ReadyEvent ready = cuda::ReadyEvent::record_on_compute_stream();  // caller
//   cuda::comm_stream_wait(ready);                                          // mover
//   cuda::comm_reduce(reduce_job);
//   cuda::synchronize_comm_stream();
#pragma once

#include <cstddef>

namespace dp::cuda {

/// The device a pointer of device memory belongs to (for the threads that move data for
/// another rank); throws `dp::Error` when `pointer` is not device memory.
int device_of(const void* pointer);

/// An event recorded on the calling thread's compute stream: the point after which a
/// communication call's device buffers hold what the caller computed. Move-only.
class ReadyEvent {
 public:
  /// No event: host buffers, nothing to wait for.
  ReadyEvent() = default;
  /// Records an event on the calling thread's compute stream (`compute_stream()`).
  static ReadyEvent record_on_compute_stream();
  ~ReadyEvent();
  ReadyEvent(ReadyEvent&& other) noexcept;
  ReadyEvent& operator=(ReadyEvent&& other) noexcept;
  ReadyEvent(const ReadyEvent&) = delete;
  ReadyEvent& operator=(const ReadyEvent&) = delete;
  /// The cudaEvent_t, or nullptr for none.
  void* handle() const { return event_; }

 private:
  void* event_ = nullptr;
};

/// Makes `device` current on the calling thread for the scope's life, then restores the
/// device that was current: a rank's thread that moves another rank's data on another GPU
/// must find its own device current again for the kernels it launches next.
class DeviceScope {
 public:
  explicit DeviceScope(int device);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  // -1: nothing to restore. A build without CUDA has nothing to restore ever.
  [[maybe_unused]] int previous_ = -1;
};

/// The calling thread's communication stream on `device` (a cudaStream_t), created
/// non-blocking on first use and kept until the thread ends. A kernel launched on it needs
/// `device` current: hold a `DeviceScope` across the launch.
void* comm_stream(int device);

/// Makes the calling thread's communication stream on `device` wait for `event` (no host
/// block); nothing for an empty event.
void comm_stream_wait(const ReadyEvent& event, int device);

/// Copies `bytes` on the calling thread's communication stream of `device`; either side may
/// be host or device memory. Asynchronous: see `synchronize_comm_stream`.
void comm_copy(void* destination, const void* source, std::size_t bytes, int device);

/// The largest number of buffers one `comm_reduce` combines or writes (a kernel parameter
/// block holds their addresses; dp::kMaxWorldSize is the same).
inline constexpr std::size_t kMaxReduceBuffers = 256;

/// The element types a reduction combines (dp::DataType's reducible ones).
enum class ReduceElement { kFloat32, kInt32, kBFloat16, kFloat16 };
/// How a reduction combines (dp::ReduceOp).
enum class ReduceCombine { kSum, kAvg, kMax };

/// One element-wise reduction: destinations[d][k] = combine(sources[0][k], ...,
/// sources[p-1][k]) for k < count, combined in rank order as the host's
/// `reduce_in_rank_order` does: ((s0 + s1) + s2) + ..., a maximum as `std::max` keeps its
/// first argument on ties and NaN, and an average is the sum divided by p afterwards.
/// bfloat16 and float16 elements are combined in float32 and rounded to their type after
/// each step (comm.h, `ReduceOp`; comm/reduce_arithmetic.h).
/// Destinations may alias sources. Every pointer is device memory on one device.
struct ReduceJob {
  const void* const* sources = nullptr;          ///< p pointers (already offset to element 0)
  std::size_t source_count = 0;                  ///< p, at most kMaxReduceBuffers
  void* const* destinations = nullptr;           ///< pointers to write the result to
  std::size_t destination_count = 0;             ///< at most kMaxReduceBuffers
  std::size_t count = 0;                         ///< elements
  ReduceElement type = ReduceElement::kFloat32;  ///< the element type
  ReduceCombine op = ReduceCombine::kSum;        ///< how to combine
};
/// Launches `job` on the calling thread's communication stream of `device`, asynchronously.
void comm_reduce(const ReduceJob& job, int device);

/// x[k] = x[k] / divisor for k < count on `stream` (a cudaStream_t), asynchronously: the
/// nccl backend's average, a sum divided afterwards as comm.h promises (NCCL's own ncclAvg
/// multiplies each input by 1/p first, which rounds differently).
void comm_divide_on(void* stream, void* data, std::size_t count, ReduceElement type, int divisor);

/// Waits until everything the calling thread issued on its communication streams is done;
/// throws `dp::Error` naming the CUDA error if any of it failed.
void synchronize_comm_stream();

}  // namespace dp::cuda
