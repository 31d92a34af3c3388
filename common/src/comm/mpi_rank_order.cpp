// mpi_rank_order.cpp: the reductions the mpi backend computes itself, in rank order, instead
// of in the order Open MPI's algorithm picks: float32 sums over three or more ranks, so that
// mpi gives the local backend's bits ("Order of additions" in mpi_world.h), and every
// reduction of bfloat16 and float16, which MPI has no type for (they travel as
// MPI_UINT16_T) and which round each partial sum to their type (comm.h, `ReduceOp`). The
// chunks move with MPI_Alltoallv / MPI_Allgatherv; the arithmetic is comm/reduce_arithmetic.h,
// the local backend's.
#include "comm/mpi_world.h"
#include "comm/reduce_arithmetic.h"

namespace dp::detail::mpi {

bool needs_rank_order(const CallRecord& record, int world_size) {
  if (record.type == DataType::kBFloat16 || record.type == DataType::kFloat16) return true;
  return record.type == DataType::kFloat32 && record.reduce != ReduceOp::kMax && world_size >= 3;
}

namespace {

/// out[k] = ((in_0[k] + in_1[k]) + in_2[k]) + ..., with in_j the j-th of `parts` blocks of
/// `count` elements in `blocks` (for kMax the maximum, in the same order); then divided by
/// `parts` for kAvg (a post-divide).
template <typename T>
void combine_blocks_in_rank_order(const std::vector<T>& blocks, int parts, std::size_t count,
                                  ReduceOp op, T* out) {
  for (std::size_t k = 0; k < count; ++k) out[k] = blocks[k];
  for (int j = 1; j < parts; ++j) {
    const T* block = blocks.data() + static_cast<std::size_t>(j) * count;
    for (std::size_t k = 0; k < count; ++k) out[k] = reduce_step(out[k], block[k], op);
  }
  if (op == ReduceOp::kAvg)
    for (std::size_t k = 0; k < count; ++k) out[k] = reduce_average(out[k], parts);
}

template <typename T>
void allreduce_typed(MutableBuffer data, ReduceOp op, MPI_Comm comm, int rank, int size) {
  const MPI_Datatype type = mpi_type(data.type);
  const std::size_t n = data.count;
  const auto parts = static_cast<std::size_t>(size);
  std::vector<int> chunk_counts(parts);
  std::vector<int> chunk_starts(parts);
  for (std::size_t j = 0; j < parts; ++j) {
    chunk_starts[j] = mpi_count(n * j / parts, "allreduce");
    chunk_counts[j] = mpi_count(n * (j + 1) / parts, "allreduce") - chunk_starts[j];
  }
  const auto mine = static_cast<std::size_t>(chunk_counts[static_cast<std::size_t>(rank)]);
  // My chunk as every rank holds it: p blocks of `mine` elements, in rank order.
  std::vector<T> blocks(mine * parts);
  std::vector<int> block_counts(parts, static_cast<int>(mine));
  std::vector<int> block_starts(parts);
  for (std::size_t j = 0; j < parts; ++j) block_starts[j] = static_cast<int>(j * mine);
  check_mpi(MPI_Alltoallv(data.data, chunk_counts.data(), chunk_starts.data(), type, blocks.data(),
                          block_counts.data(), block_starts.data(), type, comm),
            "allreduce (exchange of chunks)");
  T* values = static_cast<T*>(data.data);
  combine_blocks_in_rank_order(blocks, size, mine, op,
                               values + chunk_starts[static_cast<std::size_t>(rank)]);
  check_mpi(MPI_Allgatherv(MPI_IN_PLACE, 0, type, values, chunk_counts.data(), chunk_starts.data(),
                           type, comm),
            "allreduce (gather of sums)");
}

template <typename T>
void reduce_scatter_typed(ConstBuffer in, MutableBuffer out, ReduceOp op, MPI_Comm comm, int size) {
  const MPI_Datatype type = mpi_type(in.type);
  const int shard = mpi_count(out.count, "reduce_scatter");
  std::vector<T> blocks(out.count * static_cast<std::size_t>(size));
  // The input is read completely before `out`, which may overlap it, is written.
  check_mpi(MPI_Alltoall(in.data, shard, type, blocks.data(), shard, type, comm),
            "reduce_scatter (exchange of shards)");
  combine_blocks_in_rank_order(blocks, size, out.count, op, static_cast<T*>(out.data));
}

}  // namespace

void rank_order_allreduce(MutableBuffer data, ReduceOp op, MPI_Comm comm, int rank, int size) {
  switch (data.type) {
    case DataType::kFloat32: return allreduce_typed<float>(data, op, comm, rank, size);
    case DataType::kBFloat16: return allreduce_typed<BFloat16>(data, op, comm, rank, size);
    case DataType::kFloat16: return allreduce_typed<Float16>(data, op, comm, rank, size);
    case DataType::kInt32:
    case DataType::kUInt8: break;
  }
  DP_CHECK(false, "a rank-order all-reduce of {} (MPI reduces it itself)", to_string(data.type));
}

void rank_order_reduce_scatter(ConstBuffer in, MutableBuffer out, ReduceOp op, MPI_Comm comm,
                               int size) {
  switch (in.type) {
    case DataType::kFloat32: return reduce_scatter_typed<float>(in, out, op, comm, size);
    case DataType::kBFloat16: return reduce_scatter_typed<BFloat16>(in, out, op, comm, size);
    case DataType::kFloat16: return reduce_scatter_typed<Float16>(in, out, op, comm, size);
    case DataType::kInt32:
    case DataType::kUInt8: break;
  }
  DP_CHECK(false, "a rank-order reduce-scatter of {} (MPI reduces it itself)", to_string(in.type));
}

}  // namespace dp::detail::mpi
