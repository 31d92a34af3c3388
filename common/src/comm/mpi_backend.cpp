// mpi_backend.cpp: the mpi backend as `dp::launch` sees it: run_mpi, which gives this
// process's rank of MPI_COMM_WORLD the rank function, the MPI helpers other backends use to
// start (rank, size, broadcast, agreement, ending the job), and the communicator's set-up
// and tear-down. How the backend works: mpi_world.h.
#include "comm/backends.h"
#include "comm/mpi_world.h"

namespace dp::detail {
namespace mpi {

MpiCommunicator::MpiCommunicator(MPI_Comm comm, CommOptions options, NodeLayout layout)
    : options_(options), layout_(std::move(layout)), collectives_(comm) {
  MPI_Comm_set_errhandler(collectives_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(collectives_, &rank_);
  MPI_Comm_size(collectives_, &size_);
  DP_CHECK(layout_.size() == size_, "a layout of {} ranks for a communicator of {}", layout_.size(),
           size_);
  clock_ = std::make_unique<WallClock>(rank_, false);
  for (MPI_Comm* dup : {&validation_, &p2p_, &watchdog_, &finish_})
    check_mpi(MPI_Comm_dup(collectives_, dup), "MPI_Comm_dup");
  counters_.bytes_sent_to.assign(static_cast<std::size_t>(size_), 0);
  counters_.bytes_received_from.assign(static_cast<std::size_t>(size_), 0);
  progress_thread_ = std::thread([this] { run_progress_thread(); });
  watchdog_thread_ = std::thread([this] { run_watchdog_thread(); });
}

MpiCommunicator::~MpiCommunicator() {
  // Reached only after `finish` agreed with every rank, so no peer will ask for a status
  // and every collective has completed.
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  watchdog_stopping_ = true;
  progress_thread_.join();
  watchdog_thread_.join();
  for (MPI_Comm* comm : {&finish_, &watchdog_, &p2p_, &validation_, &collectives_})
    MPI_Comm_free(comm);
}

void MpiCommunicator::check_tag(int tag, std::string_view call) const {
  const int upper_bound = MpiProcess::get().tag_upper_bound();
  if (tag < 0 || tag > upper_bound)
    throw Error(fmt::format("{}: tag {} is out of range: expected 0 <= tag <= {} (MPI_TAG_UB)",
                            call, tag, upper_bound));
}

CommCounters MpiCommunicator::counters() const {
  std::lock_guard lock(mutex_);
  return counters_;
}

}  // namespace mpi

int mpi_rank_of_world() {
  return mpi::MpiProcess::get().rank();
}

int mpi_size_of_world() {
  return mpi::MpiProcess::get().size();
}

void mpi_broadcast_from_first(void* bytes, std::size_t size) {
  const mpi::MpiProcess& process = mpi::MpiProcess::get();
  mpi::check_mpi(MPI_Bcast(bytes, static_cast<int>(size), MPI_BYTE, 0, process.control()),
                 "MPI_Bcast (bootstrap)");
}

int mpi_sum_over_processes(int value) {
  int sum = 0;
  mpi::check_mpi(MPI_Allreduce(&value, &sum, 1, MPI_INT, MPI_SUM, mpi::MpiProcess::get().control()),
                 "MPI_Allreduce (agreement)");
  return sum;
}

void mpi_end_job(const std::string& message) {
  mpi::abort_job(message);
}

void run_mpi(const LaunchOptions& options, const std::function<void(Communicator&)>& rank_main) {
  const mpi::MpiProcess& process = mpi::MpiProcess::get();
  if (options.world_size > process.size())
    throw Error(fmt::format(
        "launch asked for world_size={} ranks but only {} MPI processes are running; start at "
        "least {} processes with `dplab run -n {}` (or mpirun -n {})",
        options.world_size, process.size(), options.world_size, options.world_size,
        options.world_size));
  // Every process calls every launch; those past world_size sit this one out.
  process.arrive_and_wait();
  const bool participates = process.rank() < options.world_size;
  MPI_Comm comm = MPI_COMM_NULL;
  mpi::check_mpi(
      MPI_Comm_split(process.control(), participates ? 0 : MPI_UNDEFINED, process.rank(), &comm),
      "MPI_Comm_split");
  if (!participates) return;

  // The launch's rank r is process r (the split above keeps the processes' order).
  mpi::MpiCommunicator communicator(
      comm, options.comm,
      NodeLayout::of_launch(options.world_size, options.simulation.network.ranks_per_node));
  std::exception_ptr error;
  try {
    rank_main(communicator);
  } catch (...) {
    error = std::current_exception();
  }
  communicator.finish(error);
}

}  // namespace dp::detail
