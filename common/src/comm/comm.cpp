#include "dp/comm.h"

#include <algorithm>
#include <map>

#include "comm/argument_checks.h"
#include "device_dispatch.h"
#include "dp/error.h"
#include "dp/tensor.h"

namespace dp {

std::size_t element_size(DataType type) {
  switch (type) {
    case DataType::kFloat32: return 4;
    case DataType::kInt32: return 4;
    case DataType::kUInt8: return 1;
    case DataType::kBFloat16: return 2;
    case DataType::kFloat16: return 2;
  }
  return 0;
}

std::string_view to_string(DataType type) {
  switch (type) {
    case DataType::kFloat32: return "float32";
    case DataType::kInt32: return "int32";
    case DataType::kUInt8: return "uint8";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kFloat16: return "float16";
  }
  return "unknown";
}

std::string_view to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
  }
  return "unknown";
}

std::string_view to_string(CommOp op) {
  switch (op) {
    case CommOp::kSend: return "send";
    case CommOp::kRecv: return "recv";
    case CommOp::kAllReduce: return "allreduce";
    case CommOp::kReduceScatter: return "reduce_scatter";
    case CommOp::kAllGather: return "allgather";
    case CommOp::kBroadcast: return "broadcast";
    case CommOp::kBarrier: return "barrier";
    case CommOp::kSplit: return "split";
  }
  return "unknown";
}

bool is_collective(CommOp op) {
  return op != CommOp::kSend && op != CommOp::kRecv;
}

std::uint64_t CommCounters::total_bytes_sent() const {
  std::uint64_t total = 0;
  for (const auto& op : per_op) total += op.bytes_sent;
  return total;
}

std::uint64_t CommCounters::total_bytes_received() const {
  std::uint64_t total = 0;
  for (const auto& op : per_op) total += op.bytes_received;
  return total;
}

std::uint64_t CommCounters::intra_node_bytes_sent() const {
  std::uint64_t total = 0;
  for (const auto& op : per_op) total += op.intra_node_bytes_sent;
  return total;
}

std::uint64_t CommCounters::inter_node_bytes_sent() const {
  std::uint64_t total = 0;
  for (const auto& op : per_op) total += op.inter_node_bytes_sent;
  return total;
}

std::uint64_t CommCounters::intra_node_bytes_received() const {
  std::uint64_t total = 0;
  for (const auto& op : per_op) total += op.intra_node_bytes_received;
  return total;
}

std::uint64_t CommCounters::inter_node_bytes_received() const {
  std::uint64_t total = 0;
  for (const auto& op : per_op) total += op.inter_node_bytes_received;
  return total;
}

std::uint64_t CommCounters::collective_calls() const {
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < kNumCommOps; ++i)
    if (is_collective(static_cast<CommOp>(i))) total += per_op[i].calls;
  return total;
}

std::uint64_t CommCounters::total_calls() const {
  std::uint64_t total = 0;
  for (const auto& op : per_op) total += op.calls;
  return total;
}

CommCounters CommCounters::since(const CommCounters& earlier) const {
  DP_CHECK(earlier.bytes_sent_to.size() == bytes_sent_to.size() &&
               earlier.bytes_received_from.size() == bytes_received_from.size(),
           "counters of communicators of {} and {} ranks subtracted", bytes_sent_to.size(),
           earlier.bytes_sent_to.size());
  CommCounters difference = *this;
  for (std::size_t op = 0; op < kNumCommOps; ++op) {
    OpCounters& d = difference.per_op[op];
    const OpCounters& e = earlier.per_op[op];
    DP_CHECK(d.calls >= e.calls, "a later snapshot counts fewer {} calls ({} < {})",
             to_string(static_cast<CommOp>(op)), d.calls, e.calls);
    d.calls -= e.calls;
    d.bytes_sent -= e.bytes_sent;
    d.bytes_received -= e.bytes_received;
    d.messages_sent -= e.messages_sent;
    d.messages_received -= e.messages_received;
    d.intra_node_bytes_sent -= e.intra_node_bytes_sent;
    d.inter_node_bytes_sent -= e.inter_node_bytes_sent;
    d.intra_node_bytes_received -= e.intra_node_bytes_received;
    d.inter_node_bytes_received -= e.inter_node_bytes_received;
  }
  for (std::size_t peer = 0; peer < bytes_sent_to.size(); ++peer) {
    difference.bytes_sent_to[peer] -= earlier.bytes_sent_to[peer];
    difference.bytes_received_from[peer] -= earlier.bytes_received_from[peer];
  }
  return difference;
}

CommCounters sum_counters(std::span<const CommCounters> parts) {
  CommCounters sum;  // the per-peer vectors stay empty: peers are numbered per communicator
  for (const CommCounters& part : parts) {
    for (std::size_t op = 0; op < kNumCommOps; ++op) {
      OpCounters& s = sum.per_op[op];
      const OpCounters& p = part.per_op[op];
      s.calls += p.calls;
      s.bytes_sent += p.bytes_sent;
      s.bytes_received += p.bytes_received;
      s.messages_sent += p.messages_sent;
      s.messages_received += p.messages_received;
      s.intra_node_bytes_sent += p.intra_node_bytes_sent;
      s.inter_node_bytes_sent += p.inter_node_bytes_sent;
      s.intra_node_bytes_received += p.intra_node_bytes_received;
      s.inter_node_bytes_received += p.inter_node_bytes_received;
    }
  }
  return sum;
}

CommCounters sum_counters(std::initializer_list<CommCounters> parts) {
  return sum_counters(std::span<const CommCounters>(parts.begin(), parts.size()));
}

std::unique_ptr<Communicator> Communicator::split(int /*color*/, int /*key*/) {
  throw Error(fmt::format(
      "split: this communicator (backend {}) cannot be split: it wraps another communicator "
      "and does not pass split on; call split on the communicator that dp::launch handed the "
      "rank",
      backend()));
}

namespace detail {

void require_split_color(int color) {
  if (color >= 0 || color == Communicator::kNoColor) return;
  throw Error(fmt::format(
      "split: expected a color >= 0 or Communicator::kNoColor ({}) for a rank that joins no "
      "communicator, got {}",
      Communicator::kNoColor, color));
}

std::vector<std::vector<int>> split_groups(std::span<const int> colors, std::span<const int> keys) {
  std::map<int, std::vector<int>> by_color;  // ordered: groups come in increasing color
  for (std::size_t r = 0; r < colors.size(); ++r)
    if (colors[r] != Communicator::kNoColor) by_color[colors[r]].push_back(static_cast<int>(r));
  std::vector<std::vector<int>> groups;
  for (auto& [color, ranks] : by_color) {
    std::stable_sort(ranks.begin(), ranks.end(), [&](int a, int b) {
      return keys[static_cast<std::size_t>(a)] < keys[static_cast<std::size_t>(b)];
    });
    groups.push_back(std::move(ranks));
  }
  return groups;
}

void require_device(Device seen, Device accepted, std::string_view backend, std::string_view call) {
  if (seen == accepted) return;
  const std::string_view advice =
      accepted == Device::kHost
          ? "copy the data to the host first (Tensor::to), or use the local or nccl backend"
          : "keep the tensors on Device::kCuda with this backend, or use the local backend";
  throw Error(
      fmt::format("{} on the {} backend: expected a buffer in {} memory, got one in {} "
                  "memory; {}",
                  call, backend, to_string(accepted), to_string(seen), advice));
}

void require_device_memory(ConstBuffer buffer, std::string_view call) {
  if (buffer.device != Device::kCuda || buffer.count == 0 || !cuda_device_emulated()) return;
  if (in_emulated_device_memory(buffer.data, buffer.bytes())) return;
  throw Error(fmt::format(
      "{}: a buffer of {} {} elements in {} memory lies outside every device tensor: "
      "expected device memory (a view or slice of a Tensor on Device::kCuda); a GPU refuses "
      "host memory given as device memory. Keep what the call sends in a tensor on the "
      "model's device and hand the communicator its view",
      call, buffer.count, to_string(buffer.type), to_string(buffer.device)));
}

void require_same_device(ConstBuffer in, MutableBuffer out, std::string_view call) {
  if (in.device == out.device) return;
  throw Error(
      fmt::format("{}: expected the input and the output on one device, got the input "
                  "in {} memory and the output in {} memory",
                  call, to_string(in.device), to_string(out.device)));
}

void require_peer_in_range(int peer, int world_size, std::string_view call) {
  if (peer >= 0 && peer < world_size) return;
  throw Error(
      fmt::format("{}: peer {} is out of range: expected 0 <= peer < {}", call, peer, world_size));
}

void require_reducible(ConstBuffer buffer, std::string_view call) {
  if (buffer.type != DataType::kUInt8) return;
  throw Error(
      fmt::format("{}: cannot reduce {} elements; expected float32, int32, bfloat16 or "
                  "float16",
                  call, to_string(buffer.type)));
}

void require_reduce_scatter_sizes(ConstBuffer in, MutableBuffer out, int world_size) {
  const std::size_t expected = out.count * static_cast<std::size_t>(world_size);
  if (in.type == out.type && in.count == expected) return;
  throw Error(fmt::format(
      "reduce_scatter: expected the input to hold size() x output = {} x {} = {} {}, got {} {}",
      world_size, out.count, expected, to_string(out.type), in.count, to_string(in.type)));
}

void require_allgather_sizes(ConstBuffer in, MutableBuffer out, int world_size) {
  const std::size_t expected = in.count * static_cast<std::size_t>(world_size);
  if (in.type == out.type && out.count == expected) return;
  throw Error(fmt::format(
      "allgather: expected the output to hold size() x input = {} x {} = {} {}, got {} {}",
      world_size, in.count, expected, to_string(in.type), out.count, to_string(out.type)));
}

}  // namespace detail
}  // namespace dp
