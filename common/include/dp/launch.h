// launch.h: start a function on every rank of a backend.
//
// `dp::launch` is how tests, labs and `dplab train` start data-parallel work. On the
// local backend it starts one thread per rank in this process; on the mpi backend each
// process started by mpirun is one rank. Either way `rank_main` receives the rank's
// communicator, and its memory is charged to the rank's own `RankMemory`.
//
// Example:
//
//   dp::launch({.world_size = 4}, [](dp::Communicator& comm) {
//     std::vector<float> x(1024, float(comm.rank()));
//     comm.allreduce(std::span(x), dp::ReduceOp::kSum)->wait();   // every x[i] == 6
//   });
#pragma once

#include <functional>
#include <optional>
#include <string_view>

#include "dp/clock.h"
#include "dp/comm.h"

namespace dp {

/// Which transport the ranks use.
enum class Backend {
  kLocal,  ///< ranks are threads of this process
  kMpi,    ///< ranks are Open MPI processes (start them with `dplab run` or mpirun)
  /// One rank per GPU through NCCL, device buffers only: under mpirun one rank per process
  /// (the unique id goes out by MPI), else one thread per GPU of this process. Needs a
  /// build with CUDA and NCCL and a process that sees a GPU; otherwise `launch` throws.
  kNccl,
};

/// "local", "mpi" or "nccl".
std::string_view to_string(Backend backend);
/// Parses "local", "mpi" or "nccl"; throws `dp::Error` naming the accepted values otherwise.
Backend parse_backend(std::string_view name);

/// The largest world size `launch` accepts. A local rank is two threads of this process
/// (its own and its communication thread) and every rank keeps counters per peer, so a
/// few hundred ranks is where a laptop stops coping; no lab needs more than 64.
inline constexpr int kMaxWorldSize = 256;

/// How to start the ranks.
struct LaunchOptions {
  /// Number of ranks, from 1 to `kMaxWorldSize`. Under mpi it may be smaller than the
  /// number of processes (the others sit this launch out) but not larger.
  int world_size = 1;
  Backend backend = Backend::kLocal;  ///< the transport
  CommOptions comm{};                 ///< timeouts and validation
  /// The simulated interconnect and clock (local backend only; off by default). When it is
  /// on, every rank's thread has its clock bound (`this_thread_clock()`), so models charge
  /// their compute to it.
  SimulationOptions simulation{};
  /// The most bytes of tensors each rank may hold at once (`MemoryTracker::set_budget`);
  /// none by default. An allocation past it throws `OutOfMemory` on that rank.
  std::optional<std::size_t> memory_budget_bytes{};
};

/// Runs `rank_main` on every rank and returns when all have returned. Throws `dp::Error`
/// for a world size outside [1, kMaxWorldSize], a hang timeout outside
/// (0, kMaxHangTimeout] or a memory budget of 0.
///
/// If a rank throws, the other ranks' pending and later calls fail with `dp::CommError`
/// ("aborted because rank r failed"), so nobody hangs, and `launch` rethrows the first
/// rank's original exception. Under mpi an error that not every rank raised ends the job
/// through MPI_Abort after printing it, as a torchrun worker failure would.
void launch(const LaunchOptions& options, const std::function<void(Communicator&)>& rank_main);

/// True when dplab was built with Open MPI.
bool mpi_built();
/// True when dplab was built with CUDA and NCCL (the nccl backend exists on GPUs; on the
/// emulated CUDA device it is emulated in every build, see `kEmulatedGpuCount`).
bool nccl_built();

/// The GPUs of the machine the emulated CUDA device stands for (dp::set_cuda_device_emulated)
/// when the nccl backend runs on it: NCCL runs one rank per GPU, so the emulation refuses
/// more ranks than an 8-GPU node has, as the nccl backend refuses more ranks than GPUs.
/// There the nccl backend is emulated on the local backend's threads, with NCCL's contract
/// (comm/emulated_nccl.cpp): device buffers only, no validation across ranks (a mismatch
/// hangs), sums of 3 or more ranks in the order of NCCL's ring, messages held until the
/// next wait.
inline constexpr int kEmulatedGpuCount = 8;

/// The most ranks the nccl backend runs as threads of this process, one per GPU: the CUDA
/// devices this process sees, or `kEmulatedGpuCount` while the emulated device is on.
int nccl_gpu_count();
/// True when this process was started by mpirun or mpiexec.
bool started_by_mpi();
/// Under mpi, this process's rank in MPI_COMM_WORLD (0 when not started by MPI).
int mpi_world_rank();
/// Under mpi, the number of processes in MPI_COMM_WORLD (1 when not started by MPI).
int mpi_world_size();

}  // namespace dp
