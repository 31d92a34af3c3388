// The collectives of host values of dp/host_collectives.h.
#include "dp/host_collectives.h"

#include <cstring>
#include <vector>

#include "dp/memory.h"
#include "dp/tensor.h"

namespace dp {
namespace {

/// Runs `call` (a collective on `buffer`, waited for) on `count` elements of `type` at `host`:
/// on the host buffer itself, or on a device tensor holding the same bytes, copied back after.
template <typename Call>
void through_device_if_needed(void* host, std::size_t count, DataType type, Communicator& comm,
                              Call&& call) {
  if (device_for_host_values(comm) == Device::kHost) {
    call(MutableBuffer(host, count, type));
    return;
  }
  // A float32 tensor carries the bytes of any element type: only copies touch them.
  const std::size_t bytes = count * element_size(type);
  std::vector<float> words((bytes + sizeof(float) - 1) / sizeof(float), 0.0f);
  if (bytes > 0) std::memcpy(words.data(), host, bytes);
  Tensor staged = Tensor::from(words, MemoryCategory::kCommunication, Device::kCuda);
  call(MutableBuffer(staged.view().data(), count, type, Device::kCuda));
  const Tensor back = staged.to(Device::kHost);
  if (bytes > 0) std::memcpy(host, back.span().data(), bytes);
}

}  // namespace

Device device_for_host_values(const Communicator& comm) {
  return comm.backend() == "nccl" ? Device::kCuda : Device::kHost;
}

void allreduce_host_values(std::span<float> values, ReduceOp op, Communicator& comm) {
  through_device_if_needed(values.data(), values.size(), DataType::kFloat32, comm,
                           [&](MutableBuffer buffer) { comm.allreduce(buffer, op)->wait(); });
}

void allreduce_host_values(std::span<std::int32_t> values, ReduceOp op, Communicator& comm) {
  through_device_if_needed(values.data(), values.size(), DataType::kInt32, comm,
                           [&](MutableBuffer buffer) { comm.allreduce(buffer, op)->wait(); });
}

void broadcast_host_values(std::span<float> values, int root, Communicator& comm) {
  through_device_if_needed(values.data(), values.size(), DataType::kFloat32, comm,
                           [&](MutableBuffer buffer) { comm.broadcast(buffer, root)->wait(); });
}

void broadcast_host_values(std::span<std::uint8_t> bytes, int root, Communicator& comm) {
  through_device_if_needed(bytes.data(), bytes.size(), DataType::kUInt8, comm,
                           [&](MutableBuffer buffer) { comm.broadcast(buffer, root)->wait(); });
}

}  // namespace dp
