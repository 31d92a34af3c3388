// backends.h (internal): the entry points `dp::launch` dispatches to.
#pragma once

#include <cstddef>
#include <exception>
#include <functional>
#include <string>

#include "dp/comm.h"
#include "dp/launch.h"

namespace dp::detail {

/// Rethrows `error`; a `dp::Error` first records that it was raised on `rank`, so that its
/// message names the rank (`Error::set_rank`). A `dp::CommError` (it names the ranks it
/// concerns) and other exceptions are rethrown unchanged.
[[noreturn]] void rethrow_naming_rank(const std::exception_ptr& error, int rank);

/// Runs `rank_main` on `options.world_size` threads of this process (local backend).
void run_local(const LaunchOptions& options, const std::function<void(Communicator&)>& rank_main);

/// Runs `rank_main` on `options.world_size` threads of this process with the nccl backend's
/// contract emulated over the local backend (comm/emulated_nccl.cpp): the nccl backend while
/// the emulated CUDA device is on, in every build.
void run_emulated_nccl(const LaunchOptions& options,
                       const std::function<void(Communicator&)>& rank_main);

#ifdef DP_HAVE_MPI
/// Runs `rank_main` on this process's rank of MPI_COMM_WORLD (mpi backend).
void run_mpi(const LaunchOptions& options, const std::function<void(Communicator&)>& rank_main);
/// This process's rank and the number of processes in MPI_COMM_WORLD (initialises MPI).
int mpi_rank_of_world();
/// The number of processes in MPI_COMM_WORLD (initialises MPI).
int mpi_size_of_world();
/// Every process of MPI_COMM_WORLD calls it: process 0's `size` bytes reach every process
/// (MPI_Bcast; how the nccl backend shares its unique id).
void mpi_broadcast_from_first(void* bytes, std::size_t size);
/// Every process calls it: the sum of their `value`s (MPI_Allreduce).
int mpi_sum_over_processes(int value);
/// Prints `message` and ends every process of the job (MPI_Abort). Never returns.
[[noreturn]] void mpi_end_job(const std::string& message);
#endif

#ifdef DP_HAVE_NCCL
/// Runs `rank_main` with one rank per GPU (nccl backend): under MPI on this process's rank,
/// else on `options.world_size` threads of this process, thread r driving GPU r.
void run_nccl(const LaunchOptions& options, const std::function<void(Communicator&)>& rank_main);
#endif

}  // namespace dp::detail
