// Jobs that go wrong on purpose, one per scenario, for the ctest cases in
// tests/CMakeLists.txt. Each is started under mpiexec; check_job.sh then checks the exit
// status, the duration and the report the runtime printed.
//
//   mismatch          ranks 0..2 all-reduce different sizes: every rank throws the same
//                     dp::CommError, and it propagates out of dp::launch (exit 0)
//   extra-collective  rank 0 calls one all-reduce more than the others: a hang, reported
//                     after 2 s with every rank's state, and the job aborts
//   p2p-deadlock      ranks 0 and 1 both receive first: reported after 2 s, job aborts
//   too-many-ranks    a launch asks for more ranks than processes: dp::Error (exit 2)
//   rank-throws       rank 2 throws while the others all-reduce: the job aborts
#include <chrono>
#include <cstdio>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "dp/comm.h"
#include "dp/error.h"
#include "dp/launch.h"

namespace {

using std::chrono::seconds;

dp::LaunchOptions on_mpi(int world_size, std::chrono::milliseconds hang_timeout) {
  dp::LaunchOptions options;
  options.world_size = world_size;
  options.backend = dp::Backend::kMpi;
  options.comm.hang_timeout = hang_timeout;
  return options;
}

int mismatch() {
  const int process = dp::mpi_world_rank();
  try {
    dp::launch(on_mpi(3, seconds(60)), [](dp::Communicator& comm) {
      std::vector<float> data(comm.rank() == 1 ? 512 : 1024);
      comm.allreduce(std::span(data), dp::ReduceOp::kSum)->wait();
    });
  } catch (const dp::CommError& e) {
    std::printf("process %d caught dp::CommError: %s\n", process, e.what());
    return 0;
  }
  if (process < 3) {
    std::printf("process %d: launch returned although its collective did not match\n", process);
    return 1;
  }
  std::printf("process %d sat the launch out\n", process);
  return 0;
}

int extra_collective() {
  dp::launch(on_mpi(dp::mpi_world_size(), seconds(2)), [](dp::Communicator& comm) {
    std::vector<float> data(16, 1.0f);
    comm.allreduce(std::span(data), dp::ReduceOp::kSum)->wait();
    if (comm.rank() == 0) comm.allreduce(std::span(data), dp::ReduceOp::kSum)->wait();
  });
  return 0;
}

int p2p_deadlock() {
  dp::launch(on_mpi(2, seconds(2)), [](dp::Communicator& comm) {
    std::vector<float> data(4);
    comm.barrier();
    const int peer = 1 - comm.rank();
    comm.irecv(std::span(data), peer, 0)->wait();
    comm.isend(std::span<const float>(data), peer, 0)->wait();
  });
  return 0;
}

int too_many_ranks() {
  try {
    dp::launch(on_mpi(dp::mpi_world_size() + 1, seconds(60)), [](dp::Communicator&) {});
  } catch (const dp::Error& e) {
    std::printf("process %d: error: %s\n", dp::mpi_world_rank(), e.what());
    return 2;
  }
  return 0;
}

int rank_throws() {
  dp::launch(on_mpi(4, seconds(4)), [](dp::Communicator& comm) {
    std::vector<float> data(4);
    if (comm.rank() == 2) throw std::runtime_error("rank 2 broke");
    comm.allreduce(std::span(data), dp::ReduceOp::kSum)->wait();
  });
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string scenario = argc > 1 ? argv[1] : "";
  if (scenario == "mismatch") return mismatch();
  if (scenario == "extra-collective") return extra_collective();
  if (scenario == "p2p-deadlock") return p2p_deadlock();
  if (scenario == "too-many-ranks") return too_many_ranks();
  if (scenario == "rank-throws") return rank_throws();
  std::fprintf(stderr,
               "usage: %s mismatch|extra-collective|p2p-deadlock|too-many-ranks|rank-throws\n",
               argv[0]);
  return 64;
}
