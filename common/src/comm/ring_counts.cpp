// The counts of comm/ring_counts.h.
#include "comm/ring_counts.h"

#include <numeric>
#include <vector>

#include "dp/error.h"

namespace dp::detail {

NodeLayout NodeLayout::of_launch(int size, int ranks_per_node) {
  NodeLayout layout;
  layout.launch_ranks.resize(static_cast<std::size_t>(size));
  std::iota(layout.launch_ranks.begin(), layout.launch_ranks.end(), 0);
  layout.ranks_per_node = ranks_per_node;
  return layout;
}

NodeLayout NodeLayout::of_members(const std::vector<int>& members) const {
  NodeLayout layout;
  layout.ranks_per_node = ranks_per_node;
  for (int member : members) layout.launch_ranks.push_back(launch_ranks.at(member));
  return layout;
}

bool NodeLayout::crosses_nodes(int a, int b) const {
  if (ranks_per_node <= 0) return false;  // one node
  return launch_ranks[static_cast<std::size_t>(a)] / ranks_per_node !=
         launch_ranks[static_cast<std::size_t>(b)] / ranks_per_node;
}

void count_sent_link(OpCounters& counted, const NodeLayout& layout, int from, int to,
                     std::uint64_t bytes) {
  (layout.crosses_nodes(from, to) ? counted.inter_node_bytes_sent
                                  : counted.intra_node_bytes_sent) += bytes;
}

void count_received_link(OpCounters& counted, const NodeLayout& layout, int from, int to,
                         std::uint64_t bytes) {
  (layout.crosses_nodes(from, to) ? counted.inter_node_bytes_received
                                  : counted.intra_node_bytes_received) += bytes;
}

void count_collective_links(OpCounters& counted, const NodeLayout& layout, CommOp op, int rank,
                            int root, std::uint64_t sent, std::uint64_t received) {
  const int p = layout.size();
  if (p < 2) return;  // nothing moves
  switch (op) {
    case CommOp::kAllReduce:
    case CommOp::kReduceScatter:
    case CommOp::kAllGather:
      // The ring: everything goes to the next rank and comes from the previous one.
      count_sent_link(counted, layout, rank, (rank + 1) % p, sent);
      count_received_link(counted, layout, (rank + p - 1) % p, rank, received);
      return;
    case CommOp::kBroadcast:
      if (rank == root) {
        // The same bytes to each other rank.
        const std::uint64_t each = sent / static_cast<std::uint64_t>(p - 1);
        for (int peer = 0; peer < p; ++peer)
          if (peer != rank) count_sent_link(counted, layout, rank, peer, each);
      } else {
        count_received_link(counted, layout, root, rank, received);
      }
      return;
    default:
      // A barrier or a split moves no payload.
      DP_CHECK(sent == 0 && received == 0, "{} counted {} bytes sent, {} received", to_string(op),
               sent, received);
      return;
  }
}

void count_ring_collective(CommCounters& counters, const CallRecord& record, int rank,
                           const NodeLayout& layout) {
  const auto p = static_cast<std::size_t>(layout.size());
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
  std::uint64_t sent = 0;
  std::uint64_t received = 0;
  for (std::size_t peer = 0; peer < p; ++peer) {
    sent += to_peer[peer] * element;
    received += from_peer[peer] * element;
    counters.bytes_sent_to[peer] += to_peer[peer] * element;
    counters.bytes_received_from[peer] += from_peer[peer] * element;
  }
  counted.bytes_sent += sent;
  counted.bytes_received += received;
  count_collective_links(counted, layout, record.op, rank, record.peer, sent, received);
}

void count_point_to_point(CommCounters& counters, CommOp op, int rank, int peer,
                          std::uint64_t bytes, const NodeLayout& layout) {
  OpCounters& counted = counters.of(op);
  ++counted.calls;
  const auto index = static_cast<std::size_t>(peer);
  if (op == CommOp::kSend) {
    counted.bytes_sent += bytes;
    ++counted.messages_sent;
    counters.bytes_sent_to[index] += bytes;
    count_sent_link(counted, layout, rank, peer, bytes);
  } else {
    counted.bytes_received += bytes;
    ++counted.messages_received;
    counters.bytes_received_from[index] += bytes;
    count_received_link(counted, layout, peer, rank, bytes);
  }
}

}  // namespace dp::detail
