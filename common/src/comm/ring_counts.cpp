// The counts of comm/ring_counts.h.
#include "comm/ring_counts.h"

#include <vector>

namespace dp::detail {

void count_ring_collective(CommCounters& counters, const CallRecord& record, int rank, int size) {
  const auto p = static_cast<std::size_t>(size);
  const std::size_t n = record.count;
  const auto chunk = [&](std::size_t r) { return n * (r + 1) / p - n * r / p; };
  // Elements moved from and to each peer, and the messages (a "message" is one chunk moved
  // between two ranks, counted even when the chunk is empty).
  std::vector<std::size_t> from_peer(p, 0);
  std::vector<std::size_t> to_peer(p, 0);
  std::uint64_t messages_sent = 0;
  std::uint64_t messages_received = 0;
  const auto me = static_cast<std::size_t>(rank);
  for (std::size_t peer = 0; peer < p; ++peer) {
    if (peer == me) continue;
    switch (record.op) {
      case CommOp::kAllReduce:
        // Reduce-scatter: my chunk from the peer, its chunk to it; all-gather: the reverse.
        from_peer[peer] = to_peer[peer] = chunk(me) + chunk(peer);
        messages_sent += 2;
        messages_received += 2;
        break;
      case CommOp::kReduceScatter:
      case CommOp::kAllGather: {
        const std::size_t shard = record.op == CommOp::kReduceScatter ? n / p : n;
        from_peer[peer] = to_peer[peer] = shard;
        ++messages_sent;
        ++messages_received;
        break;
      }
      case CommOp::kBroadcast: {
        const auto root = static_cast<std::size_t>(record.peer);
        if (me == root) {
          to_peer[peer] = n;
          ++messages_sent;
        } else if (peer == root) {
          from_peer[peer] = n;
          ++messages_received;
        }
        break;
      }
      default: break;  // a barrier moves no data
    }
  }
  const std::size_t element = element_size(record.type);
  OpCounters& counted = counters.of(record.op);
  ++counted.calls;
  counted.messages_sent += messages_sent;
  counted.messages_received += messages_received;
  for (std::size_t peer = 0; peer < p; ++peer) {
    counted.bytes_sent += to_peer[peer] * element;
    counted.bytes_received += from_peer[peer] * element;
    counters.bytes_sent_to[peer] += to_peer[peer] * element;
    counters.bytes_received_from[peer] += from_peer[peer] * element;
  }
}

}  // namespace dp::detail
