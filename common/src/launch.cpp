#include "dp/launch.h"

#include <cstdlib>
#include <memory>

#include "comm/adversarial.h"
#include "comm/backends.h"
#include "comm/in_flight_buffers.h"
#include "dp/error.h"
#include "dp/memory.h"
#include "dp/ops.h"
#include "dp/tensor.h"

namespace dp {

std::string_view to_string(Backend backend) {
  switch (backend) {
    case Backend::kLocal: return "local";
    case Backend::kMpi: return "mpi";
    case Backend::kNccl: return "nccl";
  }
  return "unknown";
}

Backend parse_backend(std::string_view name) {
  if (name == "local") return Backend::kLocal;
  if (name == "mpi") return Backend::kMpi;
  if (name == "nccl") return Backend::kNccl;
  throw Error(fmt::format("unknown backend '{}': expected 'local', 'mpi' or 'nccl'", name));
}

bool mpi_built() {
#ifdef DP_HAVE_MPI
  return true;
#else
  return false;
#endif
}

bool nccl_built() {
#ifdef DP_HAVE_NCCL
  return true;
#else
  return false;
#endif
}

int nccl_gpu_count() {
  return cuda_device_emulated() ? kEmulatedGpuCount : cuda_device_count();
}

bool started_by_mpi() {
  // Open MPI's launcher sets these in every process it starts; other launchers set PMI_*.
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr ||
         std::getenv("PMIX_RANK") != nullptr;
}

int mpi_world_rank() {
#ifdef DP_HAVE_MPI
  if (started_by_mpi()) return detail::mpi_rank_of_world();
#endif
  return 0;
}

int mpi_world_size() {
#ifdef DP_HAVE_MPI
  if (started_by_mpi()) return detail::mpi_size_of_world();
#endif
  return 1;
}

void launch(const LaunchOptions& options, const std::function<void(Communicator&)>& rank_main) {
  if (options.world_size < 1 || options.world_size > kMaxWorldSize)
    throw Error(fmt::format("world size must be between 1 and {}, got {}", kMaxWorldSize,
                            options.world_size));
  if (options.comm.hang_timeout.count() <= 0 || options.comm.hang_timeout > kMaxHangTimeout)
    throw Error(fmt::format("hang timeout must be positive and at most {} ms (a week), got {} ms",
                            kMaxHangTimeout.count(), options.comm.hang_timeout.count()));
  // The node layout the counters classify bytes by (dp/comm.h), simulated or not.
  if (options.simulation.network.ranks_per_node < 0)
    throw Error(fmt::format("ranks per node must be >= 0 (0: one node), got {}",
                            options.simulation.network.ranks_per_node));
  if (options.memory_budget_bytes == std::size_t{0})
    throw Error("a memory budget must be a positive number of bytes, got 0");
  configure_process_allocator();
  // Ranks run in parallel already; one BLAS thread per rank also keeps every matrix
  // product's summation order, and so its result, fixed.
  set_blas_threads(1);
  // Under Completion::kAdversarial the rank's code talks to a decorator over the backend's
  // communicator (comm/adversarial.h); the backend underneath is unchanged. In every mode a
  // guard outermost registers each call's buffers while it is in flight, so that a tensor
  // freed under a call is reported (comm/in_flight_buffers.h).
  // Each rank charges its tensors to memory of its own, under the budget if there is one.
  // A rank returns once its device work has finished: kernels still queued on its thread's
  // stream (its last optimizer step) would race with the caller, who reads those tensors on
  // a stream of its own as soon as launch() returns.
  const std::function<void(Communicator&)> run_rank = [&](Communicator& comm) {
    auto memory = std::make_shared<RankMemory>();
    memory->tracker().set_budget(options.memory_budget_bytes);
    ScopedRankMemory bind(std::move(memory));
    if (options.comm.completion != Completion::kAdversarial) {
      const std::unique_ptr<detail::InFlightBufferGuard> guard =
          detail::make_in_flight_buffer_guard(comm);
      rank_main(*guard);
      synchronize_device();
      // A Work destroyed unwaited as the function returned may have found a freed buffer.
      guard->throw_report_of_freed_buffer();
      return;
    }
    const std::unique_ptr<detail::AdversarialCommunicator> adversarial = detail::make_adversarial(
        comm, options.comm.completion_seed, options.comm.point_to_point_in_groups);
    // The guard goes outside: it registers the caller's buffers, not the decorator's copies.
    const std::unique_ptr<detail::InFlightBufferGuard> guard =
        detail::make_in_flight_buffer_guard(*adversarial);
    rank_main(*guard);
    synchronize_device();
    // A Work destroyed unwaited as the function returned may have found a touched buffer.
    adversarial->throw_report_of_destroyed_work();
    guard->throw_report_of_freed_buffer();
  };
  switch (options.backend) {
    case Backend::kLocal: detail::run_local(options, run_rank); return;
    case Backend::kMpi:
#ifdef DP_HAVE_MPI
      detail::run_mpi(options, run_rank);
      return;
#else
      throw Error(
          "the mpi backend was requested but this dplab was built without Open MPI "
          "(install it with tools/install-deps and configure again)");
#endif
    case Backend::kNccl:
      // No GPU to run NCCL on: its contract emulated on the local backend's threads.
      if (cuda_device_emulated()) {
        detail::run_emulated_nccl(options, run_rank);
        return;
      }
#ifdef DP_HAVE_NCCL
      detail::run_nccl(options, run_rank);
      return;
#else
      throw Error(
          "the nccl backend was requested but this dplab was built without CUDA and NCCL "
          "(configure with a CUDA compiler, DP_CUDA on and NCCL installed); use the local "
          "backend, which runs several ranks on one GPU or on the host");
#endif
  }
}

}  // namespace dp
