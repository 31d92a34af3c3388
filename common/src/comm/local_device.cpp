// The local backend's device data movement (comm/local_device.h).
#include "comm/local_device.h"

#include <array>

#include "comm/reduce_element.h"
#include "device_dispatch.h"
#include "dp/error.h"

namespace dp::detail {

bool on_device(ConstBuffer buffer) {
  return on_gpu(buffer.device);
}

namespace {

/// The CUDA device `buffer` lives on (the ranks of a collective agree on the device kind:
/// its signature includes it).
int device_of_buffer(ConstBuffer buffer) {
  return cuda::device_of(buffer.data);
}

cuda::ReduceCombine combine_of(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return cuda::ReduceCombine::kSum;
    case ReduceOp::kAvg: return cuda::ReduceCombine::kAvg;
    case ReduceOp::kMax: return cuda::ReduceCombine::kMax;
  }
  return cuda::ReduceCombine::kSum;
}

}  // namespace

DeviceGate DeviceGate::at_issue(ConstBuffer input, ConstBuffer output) {
  DeviceGate gate;
  const ConstBuffer* on = on_device(input) && input.count > 0     ? &input
                          : on_device(output) && output.count > 0 ? &output
                                                                  : nullptr;
  if (on == nullptr) return gate;
  gate.device = device_of_buffer(*on);
  gate.ready = cuda::ReadyEvent::record_on_compute_stream();
  return gate;
}

void DeviceGate::wait_for() const {
  if (device >= 0) cuda::comm_stream_wait(ready, device);
}

void copy_device_elements(MutableBuffer dst, std::size_t dst_offset, ConstBuffer src,
                          std::size_t src_offset, std::size_t count) {
  if (count == 0) return;
  const std::size_t size = element_size(dst.type);
  const int device = device_of_buffer(on_device(dst) ? ConstBuffer(dst) : src);
  cuda::comm_copy(static_cast<char*>(dst.data) + dst_offset * size,
                  static_cast<const char*>(src.data) + src_offset * size, count * size, device);
}

void reduce_device_chunk(std::span<const MutableBuffer> destinations, std::size_t dst_offset,
                         std::span<const ConstBuffer> sources, std::size_t src_offset,
                         std::size_t count, ReduceOp op) {
  if (count == 0) return;
  const std::size_t size = element_size(sources[0].type);
  std::array<const void*, cuda::kMaxReduceBuffers> inputs{};
  std::array<void*, cuda::kMaxReduceBuffers> outputs{};
  for (std::size_t s = 0; s < sources.size(); ++s)
    inputs[s] = static_cast<const char*>(sources[s].data) + src_offset * size;
  for (std::size_t d = 0; d < destinations.size(); ++d)
    outputs[d] = static_cast<char*>(destinations[d].data) + dst_offset * size;
  const cuda::ReduceJob job{.sources = inputs.data(),
                            .source_count = sources.size(),
                            .destinations = outputs.data(),
                            .destination_count = destinations.size(),
                            .count = count,
                            .type = device_reduce_element(sources[0].type, "a reduction"),
                            .op = combine_of(op)};
  cuda::comm_reduce(job, device_of_buffer(sources[0]));
}

void finish_device_moves() {
  cuda::synchronize_comm_stream();
}

}  // namespace dp::detail
