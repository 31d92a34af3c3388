// ring_counts.h (internal): what a backend counts for a call, and over which link class.
//
// Backends whose library picks its own algorithm (Open MPI, NCCL) cannot observe the bytes
// it moves, so they count what a ring (reduce-scatter + all-gather) moves, as the local
// backend's algorithm does, with chunk i of n elements being [n*i/p, n*(i+1)/p):
//
//   allreduce       rank i receives (p-1)|c_i| + (n-|c_i|) elements and sends as many;
//                   from / to peer j: |c_i| + |c_j|; 2(p-1) messages each way
//   reduce_scatter  output of m elements: (p-1) m each way, m per peer, p-1 messages
//   allgather       input of m elements: (p-1) m each way, m per peer, p-1 messages
//   broadcast       the root sends n to every other rank (p-1 messages); others receive n
//   barrier         calls only
//
// Link classes (dp/comm.h, `CommCounters`): every backend splits the same bytes the same
// way, by the `NodeLayout` of its communicator: a ring collective's bytes go to the next
// rank and come from the previous one, a broadcast's between the root and each rank, a
// message's between its two ranks.
//
// Example:
//
//   count_ring_collective(counters_, record, rank_, layout_);   // once per collective call
#pragma once

#include <cstdint>
#include <vector>

#include "comm/call_log.h"
#include "dp/comm.h"

namespace dp::detail {

/// Where the ranks of one communicator sit, for the link classes of its counters.
struct NodeLayout {
  /// By rank in the communicator: its rank in the launch.
  std::vector<int> launch_ranks;
  /// The launch's ranks per node (`NetworkModel::ranks_per_node`); 0: one node.
  int ranks_per_node = 0;

  /// The launch's own communicator of `size` ranks: rank r is launch rank r.
  static NodeLayout of_launch(int size, int ranks_per_node);
  /// A communicator of `members` of the communicator this layout describes (by rank there).
  NodeLayout of_members(const std::vector<int>& members) const;
  /// Number of ranks of the communicator.
  int size() const { return static_cast<int>(launch_ranks.size()); }
  /// True when ranks `a` and `b` of the communicator are on different nodes.
  bool crosses_nodes(int a, int b) const;
};

/// Adds `bytes` that rank `from` sent to rank `to` (ranks of the communicator `layout`
/// describes, `from` this rank) to `counted`'s link classes.
void count_sent_link(OpCounters& counted, const NodeLayout& layout, int from, int to,
                     std::uint64_t bytes);
/// Adds `bytes` that rank `to` (this rank) received from rank `from` to `counted`'s link
/// classes.
void count_received_link(OpCounters& counted, const NodeLayout& layout, int from, int to,
                         std::uint64_t bytes);

/// Adds the link classes of one collective of `op` on rank `rank` that sent `sent` and
/// received `received` bytes (its `bytes_sent` and `bytes_received`) to `counted`: the ring's
/// for all-reduce, reduce-scatter and all-gather; the root's to each rank (`root`, a rank of
/// the communicator, the same bytes to each) for a broadcast.
void count_collective_links(OpCounters& counted, const NodeLayout& layout, CommOp op, int rank,
                            int root, std::uint64_t sent, std::uint64_t received);

/// Adds one collective call `record` of rank `rank` of the communicator `layout` describes
/// to `counters` (whose per-peer vectors hold `layout.size()` entries): the call, and the
/// bytes, messages and link classes above. `record.count` is the input's element count (n,
/// or for reduce_scatter size x m).
void count_ring_collective(CommCounters& counters, const CallRecord& record, int rank,
                           const NodeLayout& layout);

/// Adds one point-to-point call (`op` kSend or kRecv) of `bytes` between rank `rank` and
/// `peer` of the communicator `layout` describes to `counters`.
void count_point_to_point(CommCounters& counters, CommOp op, int rank, int peer,
                          std::uint64_t bytes, const NodeLayout& layout);

}  // namespace dp::detail
