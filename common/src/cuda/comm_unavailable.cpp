// The functions of cuda/comm_device.h in a build without CUDA: no buffer can be on a device
// (no tensor can be allocated there), so each one that would touch a device says so.
#include <string_view>
#include <utility>

#include "cuda/comm_device.h"
#include "dp/error.h"

namespace dp::cuda {
namespace {

[[noreturn]] void no_cuda_for_buffers(std::string_view what) {
  throw Error(fmt::format(
      "{} of a communication buffer on a CUDA device: this build has no CUDA: configure with "
      "a CUDA compiler and DP_CUDA on, or keep the buffers on Device::kHost",
      what));
}

}  // namespace

DeviceScope::DeviceScope(int /*device*/) {}
DeviceScope::~DeviceScope() = default;

int device_of(const void* /*pointer*/) {
  no_cuda_for_buffers("the device");
}
void* comm_stream(int /*device*/) {
  no_cuda_for_buffers("a stream");
}

ReadyEvent ReadyEvent::record_on_compute_stream() {
  no_cuda_for_buffers("an event");
}
ReadyEvent::~ReadyEvent() = default;
ReadyEvent::ReadyEvent(ReadyEvent&& other) noexcept : event_(other.event_) {
  other.event_ = nullptr;
}
ReadyEvent& ReadyEvent::operator=(ReadyEvent&& other) noexcept {
  std::swap(event_, other.event_);
  return *this;
}

void comm_stream_wait(const ReadyEvent& event, int /*device*/) {
  if (event.handle() != nullptr) no_cuda_for_buffers("a wait");
}
void comm_copy(void* /*destination*/, const void* /*source*/, std::size_t /*bytes*/,
               int /*device*/) {
  no_cuda_for_buffers("a copy");
}
void comm_reduce(const ReduceJob& /*job*/, int /*device*/) {
  no_cuda_for_buffers("a reduction");
}
void comm_divide_on(void* /*stream*/, void* /*data*/, std::size_t /*count*/, ReduceElement /*type*/,
                    int /*divisor*/) {
  no_cuda_for_buffers("a division");
}
void synchronize_comm_stream() {}

}  // namespace dp::cuda
