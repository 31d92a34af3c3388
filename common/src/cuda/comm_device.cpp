// Streams, events and copies of cuda/comm_device.h, through the CUDA runtime (compiled with
// the host compiler; the reduction kernel is in comm_kernels.cu).
//
// A thread's communication streams live in a thread_local table, one per device it has
// moved data on, and are destroyed with the thread: the local backend's threads (ranks and
// their communication threads) end with the launch, so streams never outlive it. A stream
// is created with cudaStreamNonBlocking: a blocking stream would also wait for whatever
// runs on the legacy default stream, and the communication would stop overlapping. The
// compute kernels run on cudaStreamPerThread (cuda/device_ops.h); events order the two.
#include "cuda/comm_device.h"

#include <cuda_runtime.h>

#include <array>
#include <string_view>
#include <utility>

#include "cuda/device_ops.h"
#include "dp/error.h"

namespace dp::cuda {
namespace {

void check(cudaError_t status, const char* what) {
  check_status(static_cast<int>(status), what);
}

/// Devices a thread can keep a stream for; more than any machine dplab runs on has.
constexpr int kMaxDevices = 64;

/// The calling thread's communication streams, by device, and which of them have work
/// that `synchronize_comm_stream` has not waited for.
class ThreadStreams {
 public:
  ThreadStreams() = default;
  ThreadStreams(const ThreadStreams&) = delete;
  ThreadStreams& operator=(const ThreadStreams&) = delete;
  ~ThreadStreams() {
    // The context may be gone at process exit: nothing to report then.
    for (cudaStream_t stream : streams_)
      if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }

  cudaStream_t get(int device) {
    if (device < 0 || device >= kMaxDevices)
      throw Error(fmt::format("communication stream: expected a device below {}, got {}",
                              kMaxDevices, device));
    cudaStream_t& stream = streams_[static_cast<std::size_t>(device)];
    if (stream == nullptr) {
      const DeviceScope on_device(device);
      check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
            "cudaStreamCreateWithFlags (communication stream)");
    }
    used_[static_cast<std::size_t>(device)] = true;
    return stream;
  }

  void synchronize() {
    for (std::size_t device = 0; device < streams_.size(); ++device) {
      if (!used_[device]) continue;
      used_[device] = false;
      check(cudaStreamSynchronize(streams_[device]), "communication stream");
    }
  }

 private:
  std::array<cudaStream_t, kMaxDevices> streams_{};
  std::array<bool, kMaxDevices> used_{};
};

ThreadStreams& thread_streams() {
  thread_local ThreadStreams streams;
  return streams;
}

}  // namespace

int device_of(const void* pointer) {
  if (device_count() == 0)
    throw Error(
        "a communication buffer in cuda memory: this process sees no CUDA device (no GPU, no "
        "driver, or CUDA_VISIBLE_DEVICES hides them); keep the buffers on Device::kHost");
  cudaPointerAttributes attributes{};
  check(cudaPointerGetAttributes(&attributes, pointer), "cudaPointerGetAttributes");
  if (attributes.type != cudaMemoryTypeDevice && attributes.type != cudaMemoryTypeManaged)
    throw Error(
        "a communication buffer marked Device::kCuda does not point at device memory "
        "(expected memory from a Tensor on Device::kCuda, got host or unregistered memory)");
  return attributes.device;
}

DeviceScope::DeviceScope(int device) {
  int current = 0;
  check(cudaGetDevice(&current), "cudaGetDevice");
  if (current == device) return;
  check(cudaSetDevice(device), "cudaSetDevice");
  previous_ = current;
}

DeviceScope::~DeviceScope() {
  // A destructor cannot throw: a failure here shows at the thread's next CUDA call.
  if (previous_ >= 0) (void)cudaSetDevice(previous_);
}

void* comm_stream(int device) {
  return thread_streams().get(device);
}

ReadyEvent ReadyEvent::record_on_compute_stream() {
  ReadyEvent ready;
  cudaEvent_t event = nullptr;
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  ready.event_ = event;
  check(cudaEventRecord(event, static_cast<cudaStream_t>(compute_stream())),
        "cudaEventRecord (compute stream)");
  return ready;
}

ReadyEvent::~ReadyEvent() {
  if (event_ != nullptr) (void)cudaEventDestroy(static_cast<cudaEvent_t>(event_));
}

ReadyEvent::ReadyEvent(ReadyEvent&& other) noexcept
    : event_(std::exchange(other.event_, nullptr)) {}

ReadyEvent& ReadyEvent::operator=(ReadyEvent&& other) noexcept {
  std::swap(event_, other.event_);
  return *this;
}

void comm_stream_wait(const ReadyEvent& event, int device) {
  if (event.handle() == nullptr) return;
  const DeviceScope on_device(device);
  check(cudaStreamWaitEvent(thread_streams().get(device), static_cast<cudaEvent_t>(event.handle()),
                            0),
        "cudaStreamWaitEvent (communication stream)");
}

void comm_copy(void* destination, const void* source, std::size_t bytes, int device) {
  if (bytes == 0 || destination == source) return;
  const DeviceScope on_device(device);
  // cudaMemcpyDefault: unified addressing tells host from device and one device from
  // another (a peer copy where the devices can reach each other, staged otherwise).
  check(
      cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDefault, thread_streams().get(device)),
      "cudaMemcpyAsync (communication stream)");
}

void synchronize_comm_stream() {
  thread_streams().synchronize();
}

}  // namespace dp::cuda
