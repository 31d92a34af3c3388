// ring_counts.h (internal): what a backend counts for a native collective.
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
// Example:
//
//   count_ring_collective(counters_, record, rank_, size_);   // once per collective call
#pragma once

#include "comm/call_log.h"
#include "dp/comm.h"

namespace dp::detail {

/// Adds one collective call `record` of rank `rank` among `size` ranks to `counters` (whose
/// per-peer vectors hold `size` entries): the call, and the bytes and messages above.
/// `record.count` is the input's element count (n, or for reduce_scatter size x m).
void count_ring_collective(CommCounters& counters, const CallRecord& record, int rank, int size);

}  // namespace dp::detail
