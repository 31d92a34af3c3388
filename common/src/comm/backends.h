// backends.h (internal): the entry points `dp::launch` dispatches to.
#pragma once

#include <exception>
#include <functional>

#include "dp/comm.h"
#include "dp/launch.h"

namespace dp::detail {

/// Rethrows `error`; a `dp::Error` first records that it was raised on `rank`, so that its
/// message names the rank (`Error::set_rank`). A `dp::CommError` (it names the ranks it
/// concerns) and other exceptions are rethrown unchanged.
[[noreturn]] void rethrow_naming_rank(const std::exception_ptr& error, int rank);

/// Runs `rank_main` on `options.world_size` threads of this process (local backend).
void run_local(const LaunchOptions& options, const std::function<void(Communicator&)>& rank_main);

#ifdef DP_HAVE_MPI
/// Runs `rank_main` on this process's rank of MPI_COMM_WORLD (mpi backend).
void run_mpi(const LaunchOptions& options, const std::function<void(Communicator&)>& rank_main);
/// This process's rank and the number of processes in MPI_COMM_WORLD (initialises MPI).
int mpi_rank_of_world();
/// The number of processes in MPI_COMM_WORLD (initialises MPI).
int mpi_size_of_world();
#endif

}  // namespace dp::detail
