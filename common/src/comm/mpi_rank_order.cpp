// mpi_rank_order.cpp: float32 sums over three or more ranks, which the mpi backend adds
// itself in rank order, ((x0 + x1) + x2) + ..., instead of in the order Open MPI's
// algorithm picks, so that mpi gives the local backend's bits ("Order of additions" in
// mpi_world.h). The chunks move with MPI_Alltoallv / MPI_Allgatherv; the additions are here.
#include "comm/mpi_world.h"

namespace dp::detail::mpi {

bool needs_rank_order(const CallRecord& record, int world_size) {
  return record.type == DataType::kFloat32 && record.reduce != ReduceOp::kMax && world_size >= 3;
}

namespace {

/// out[k] = ((in_0[k] + in_1[k]) + in_2[k]) + ..., with in_j the j-th of `parts` blocks of
/// `count` floats in `blocks`; then divided by `parts` for kAvg (a post-divide).
void add_blocks_in_rank_order(const std::vector<float>& blocks, int parts, std::size_t count,
                              ReduceOp op, float* out) {
  for (std::size_t k = 0; k < count; ++k) out[k] = blocks[k];
  for (int j = 1; j < parts; ++j) {
    const float* block = blocks.data() + static_cast<std::size_t>(j) * count;
    for (std::size_t k = 0; k < count; ++k) out[k] += block[k];
  }
  if (op == ReduceOp::kAvg)
    for (std::size_t k = 0; k < count; ++k) out[k] /= static_cast<float>(parts);
}

}  // namespace

void rank_order_allreduce(MutableBuffer data, ReduceOp op, MPI_Comm comm, int rank, int size) {
  const std::size_t n = data.count;
  const auto parts = static_cast<std::size_t>(size);
  std::vector<int> chunk_counts(parts);
  std::vector<int> chunk_starts(parts);
  for (std::size_t j = 0; j < parts; ++j) {
    chunk_starts[j] = mpi_count(n * j / parts, "allreduce");
    chunk_counts[j] = mpi_count(n * (j + 1) / parts, "allreduce") - chunk_starts[j];
  }
  const auto mine = static_cast<std::size_t>(chunk_counts[static_cast<std::size_t>(rank)]);
  // My chunk as every rank holds it: p blocks of `mine` floats, in rank order.
  std::vector<float> blocks(mine * parts);
  std::vector<int> block_counts(parts, static_cast<int>(mine));
  std::vector<int> block_starts(parts);
  for (std::size_t j = 0; j < parts; ++j) block_starts[j] = static_cast<int>(j * mine);
  check_mpi(MPI_Alltoallv(data.data, chunk_counts.data(), chunk_starts.data(), MPI_FLOAT,
                          blocks.data(), block_counts.data(), block_starts.data(), MPI_FLOAT, comm),
            "allreduce (exchange of chunks)");
  float* values = static_cast<float*>(data.data);
  add_blocks_in_rank_order(blocks, size, mine, op,
                           values + chunk_starts[static_cast<std::size_t>(rank)]);
  check_mpi(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_FLOAT, values, chunk_counts.data(),
                           chunk_starts.data(), MPI_FLOAT, comm),
            "allreduce (gather of sums)");
}

void rank_order_reduce_scatter(ConstBuffer in, MutableBuffer out, ReduceOp op, MPI_Comm comm,
                               int size) {
  const int shard = mpi_count(out.count, "reduce_scatter");
  std::vector<float> blocks(out.count * static_cast<std::size_t>(size));
  // The input is read completely before `out`, which may overlap it, is written.
  check_mpi(MPI_Alltoall(in.data, shard, MPI_FLOAT, blocks.data(), shard, MPI_FLOAT, comm),
            "reduce_scatter (exchange of shards)");
  add_blocks_in_rank_order(blocks, size, out.count, op, static_cast<float*>(out.data));
}

}  // namespace dp::detail::mpi
