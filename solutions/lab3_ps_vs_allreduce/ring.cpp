// ring.cpp: lab 3's chunks and ring all-reduce. Your part: the bodies of chunk_of and
// ring_allreduce.
#include <fmt/format.h>

#include <cstdint>

#include "dp/error.h"
#include "dp/tensor_ops.h"
#include "lab3.h"

namespace dp::lab3 {

Range chunk_of(std::size_t elements, int parts, int index) {
  if (parts < 1 || index < 0 || index >= parts)
    throw Error(
        fmt::format("chunk_of: expected parts >= 1 and 0 <= index < parts, got parts = {} "
                    "and index = {}",
                    parts, index));
  // BEGIN SOLUTION
  // SKELETON: (void)elements;
  // SKELETON: throw NotImplemented("lab3::chunk_of");
  const auto p = static_cast<std::size_t>(parts);
  const auto i = static_cast<std::size_t>(index);
  const std::size_t base = elements / p;
  const std::size_t longer = elements % p;  // the first `longer` chunks hold one more
  return {i * base + std::min(i, longer), base + (i < longer ? 1 : 0)};
  // END SOLUTION
}

void ring_allreduce(TensorView data, Communicator& comm) {
  // BEGIN SOLUTION
  // SKELETON: (void)data;
  // SKELETON: (void)comm;
  // SKELETON: throw NotImplemented("lab3::ring_allreduce");
  const int ranks = comm.size();
  const int rank = comm.rank();
  if (ranks == 1) return;
  const int next = (rank + 1) % ranks;
  const int previous = (rank + ranks - 1) % ranks;
  const auto chunk = [&](int index) {
    const Range range = chunk_of(data.size(), ranks, ((index % ranks) + ranks) % ranks);
    return data.slice(range.offset, range.count);
  };
  // Chunk 0 is the largest: room for any incoming partial sum.
  Tensor incoming({static_cast<std::int64_t>(chunk_of(data.size(), ranks, 0).count)},
                  MemoryCategory::kCommunication, data.device());

  // Reduce-scatter. At step k rank r passes on chunk r-k, which holds the sum of ranks
  // r-k .. r, and adds its own values to chunk r-k-1 from r-1: chunk c starts at rank c
  // and is complete, every rank added once in ring order, at rank c-1 after N-1 steps.
  // Empty chunks are skipped on both sides (both know the sizes).
  constexpr int kReduceScatterTag = 31;
  constexpr int kAllGatherTag = 32;
  for (int step = 0; step < ranks - 1; ++step) {
    const TensorView outgoing = chunk(rank - step);
    const TensorView target = chunk(rank - step - 1);
    const TensorView partial = incoming.view(0, target.size());
    std::unique_ptr<Work> send;
    std::unique_ptr<Work> receive;
    if (!outgoing.empty()) send = comm.isend(outgoing, next, kReduceScatterTag);
    if (!target.empty()) receive = comm.irecv(partial, previous, kReduceScatterTag);
    if (receive) {
      receive->wait();
      add(partial, target);  // x + y and y + x are the same bits: the order is the ring's
    }
    if (send) send->wait();
  }
  // All-gather: rank r holds the complete chunk r+1 and passes each complete chunk on, so
  // every rank receives the one copy of each sum: the same bits everywhere.
  for (int step = 0; step < ranks - 1; ++step) {
    const TensorView outgoing = chunk(rank + 1 - step);
    const TensorView target = chunk(rank - step);
    std::unique_ptr<Work> send;
    std::unique_ptr<Work> receive;
    if (!outgoing.empty()) send = comm.isend(outgoing, next, kAllGatherTag);
    if (!target.empty()) receive = comm.irecv(target, previous, kAllGatherTag);
    if (receive) receive->wait();
    if (send) send->wait();
  }
  // END SOLUTION
}

}  // namespace dp::lab3
