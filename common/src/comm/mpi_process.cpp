// mpi_process.cpp: the mpi backend's layer over MPI itself: the process's MPI state
// (initialised once, finalised at exit), MPI's errors as dp::CommError, data types and
// reduce ops in MPI's terms, and waits that sleep between polls. How the backend works:
// mpi_world.h.
#include "comm/mpi_world.h"

namespace dp::detail::mpi {

[[noreturn]] void abort_job(const std::string& message) {
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();  // MPI_Abort does not return; this keeps the compiler and the reader sure
}

void check_mpi(int code, std::string_view what) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw CommError(fmt::format("dplab: {} failed in MPI: {}", what, std::string(text, length)));
}

MPI_Datatype mpi_type(DataType type) {
  switch (type) {
    case DataType::kFloat32: return MPI_FLOAT;
    case DataType::kInt32: return MPI_INT32_T;
    case DataType::kUInt8: return MPI_UINT8_T;
    case DataType::kBFloat16: return MPI_UINT16_T;
    case DataType::kFloat16: return MPI_UINT16_T;
  }
  DP_CHECK(false, "no MPI type for data type {}", static_cast<int>(type));
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_op(ReduceOp op) {
  return op == ReduceOp::kMax ? MPI_MAX : MPI_SUM;
}

int mpi_count(std::size_t count, std::string_view call) {
  if (count > static_cast<std::size_t>(INT_MAX))
    throw Error(
        fmt::format("{}: the mpi backend moves at most {} elements per call, got {}; "
                    "split the buffer",
                    call, INT_MAX, count));
  return static_cast<int>(count);
}

bool wait_sleeping(MPI_Request& request, SteadyClock::time_point deadline) {
  while (true) {
    int done = 0;
    check_mpi(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test");
    if (done) return true;
    if (SteadyClock::now() >= deadline) return false;
    std::this_thread::sleep_for(kSlowPoll);
  }
}

// --- The process -------------------------------------------------------------------------

MpiProcess::MpiProcess() {
  // Before MPI allocates anything: keep large blocks mapped (see memory.h).
  configure_process_allocator();
  int initialized = 0;
  MPI_Initialized(&initialized);
  int provided = MPI_THREAD_SINGLE;
  if (initialized) {
    MPI_Query_thread(&provided);
  } else {
    check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
    std::atexit(finalize);
  }
  if (provided < MPI_THREAD_MULTIPLE)
    throw Error(fmt::format(
        "the mpi backend needs MPI_THREAD_MULTIPLE (its progress thread calls MPI while the "
        "rank's own thread does) but this MPI provides thread level {} of {}; use an Open MPI "
        "built with thread support",
        provided, MPI_THREAD_MULTIPLE));
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &control_), "MPI_Comm_dup");
  MPI_Comm_set_errhandler(control_, MPI_ERRORS_RETURN);
  int* upper_bound = nullptr;
  int found = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &upper_bound, &found);
  tag_upper_bound_ = found ? *upper_bound : 32767;
}

void MpiProcess::finalize() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  // Wait for every process here first, not inside MPI_Finalize: when a peer calls
  // MPI_Abort while processes sit in MPI_Finalize's PMIx fence, Open MPI 4.1's mpirun
  // (with PMIx 4.2) can hang or crash in its own shutdown (seen about once in 10 jobs).
  get().arrive_and_wait();
  MPI_Finalize();
}

}  // namespace dp::detail::mpi
