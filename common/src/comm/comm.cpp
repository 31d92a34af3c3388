#include "dp/comm.h"

#include "dp/error.h"

namespace dp {

std::size_t element_size(DataType type) {
  switch (type) {
    case DataType::kFloat32: return 4;
    case DataType::kInt32: return 4;
    case DataType::kUInt8: return 1;
  }
  return 0;
}

std::string_view to_string(DataType type) {
  switch (type) {
    case DataType::kFloat32: return "float32";
    case DataType::kInt32: return "int32";
    case DataType::kUInt8: return "uint8";
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

std::uint64_t CommCounters::collective_calls() const {
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < kNumCommOps; ++i)
    if (is_collective(static_cast<CommOp>(i))) total += per_op[i].calls;
  return total;
}

}  // namespace dp
