// mpi_point_to_point.cpp: isend and irecv of the mpi backend. The rank's own thread posts
// MPI_Isend / MPI_Irecv on the launch's p2p communicator and completes them with MPI_Test
// in wait() and test(); a message of the wrong size becomes a size-mismatch error. The
// progress thread keeps MPI moving meanwhile (mpi_collectives.cpp). Overview: mpi_world.h.
#include "comm/mpi_world.h"

namespace dp::detail::mpi {

// --- Point-to-point ----------------------------------------------------------------------

std::unique_ptr<Work> MpiCommunicator::isend(ConstBuffer data, int peer, int tag) {
  require_device(data.device, Device::kHost, "mpi", "isend");
  require_peer_in_range(peer, size_, "isend");
  check_tag(tag, "isend");
  CallRecord record{
      .op = CommOp::kSend, .count = data.count, .type = data.type, .peer = peer, .tag = tag};
  return post(record, data.data, data.count, /*send=*/true);
}

std::unique_ptr<Work> MpiCommunicator::irecv(MutableBuffer data, int peer, int tag) {
  require_device(data.device, Device::kHost, "mpi", "irecv");
  require_peer_in_range(peer, size_, "irecv");
  check_tag(tag, "irecv");
  CallRecord record{
      .op = CommOp::kRecv, .count = data.count, .type = data.type, .peer = peer, .tag = tag};
  return post(record, data.data, data.count, /*send=*/false);
}

std::unique_ptr<Work> MpiCommunicator::post(CallRecord record, const void* data, std::size_t count,
                                            bool send) {
  auto call = std::make_unique<PointToPoint>();
  const int elements = mpi_count(count, send ? "isend" : "irecv");
  const detail::UncountedHeapAllocations inside_mpi;  // what MPI allocates is not the lab's
  if (send) {
    check_mpi(MPI_Isend(data, elements, mpi_type(record.type), record.peer, record.tag, p2p_,
                        &call->request),
              "MPI_Isend");
  } else {
    check_mpi(MPI_Irecv(const_cast<void*>(data), elements, mpi_type(record.type), record.peer,
                        record.tag, p2p_, &call->request),
              "MPI_Irecv");
  }
  const std::uint64_t bytes = count * element_size(record.type);
  {
    std::lock_guard lock(mutex_);
    record.index = log_.record(record);
    call->record = record;
    count_point_to_point(counters_, record.op, rank_, record.peer, bytes, layout_);
    ++outstanding_p2p_;
  }
  changed_.notify_all();  // the progress thread now drives MPI while the caller computes
  return std::make_unique<PointToPointWork>(*this, std::move(call));
}

void MpiCommunicator::complete(PointToPoint& call, int code, const MPI_Status& status) {
  const CallRecord& record = call.record;
  if (code == MPI_ERR_TRUNCATE) {
    call.error = std::make_exception_ptr(CommError(fmt::format(
        "message size mismatch: rank {} sent more than {} {} with tag {} to rank {}, which "
        "posted a receive of {} {}",
        record.peer, record.count, to_string(record.type), record.tag, rank_, record.count,
        to_string(record.type))));
  } else if (code != MPI_SUCCESS) {
    try {
      check_mpi(code, record.op == CommOp::kSend ? "isend" : "irecv");
    } catch (...) {
      call.error = std::current_exception();
    }
  } else if (record.op == CommOp::kRecv) {
    int bytes = 0;
    MPI_Get_count(&status, MPI_BYTE, &bytes);
    const std::size_t size = element_size(record.type);
    if (static_cast<std::size_t>(bytes) != record.count * size)
      call.error = std::make_exception_ptr(CommError(fmt::format(
          "message size mismatch: rank {} sent {} {} with tag {} to rank {}, which posted a "
          "receive of {} {}",
          record.peer, static_cast<std::size_t>(bytes) / size, to_string(record.type), record.tag,
          rank_, record.count, to_string(record.type))));
  }
  call.done = true;
  std::lock_guard lock(mutex_);
  log_.complete(record.index);
  --outstanding_p2p_;
}

bool MpiCommunicator::test(PointToPoint& call) {
  if (call.done) return true;
  int done = 0;
  MPI_Status status;
  int code = MPI_SUCCESS;
  {
    const detail::UncountedHeapAllocations inside_mpi;  // what MPI allocates is not the lab's
    code = MPI_Test(&call.request, &done, &status);
  }
  if (done || code != MPI_SUCCESS) complete(call, code, status);
  return call.done;
}

void MpiCommunicator::wait(PointToPoint& call) {
  if (!call.done) {
    {
      std::lock_guard lock(mutex_);
      blocked_on_ = call.record.index;
      caller_drives_progress_ = true;
    }
    const auto deadline = SteadyClock::now() + options_.hang_timeout;
    // Spin on MPI_Test (yielding to the other processes that share the cores): the
    // latency of a small message is what a ring of p2p steps pays per step.
    while (!test(call)) {
      if (SteadyClock::now() >= deadline) report_hang_and_abort(timeout_headline(call.record));
      std::this_thread::yield();
    }
    std::lock_guard lock(mutex_);
    blocked_on_.reset();
    caller_drives_progress_ = false;
  }
  if (call.error) std::rethrow_exception(call.error);
}

// --- Work handles ------------------------------------------------------------------------

PointToPointWork::~PointToPointWork() {
  try {
    comm_.wait(*call_);
  } catch (const std::exception&) {
    // The error was, or will be, reported through wait() or the end of the launch.
  }
}

void PointToPointWork::wait() {
  comm_.wait(*call_);
}

bool PointToPointWork::test() {
  return comm_.test(*call_);
}

}  // namespace dp::detail::mpi
