// The main() of every lab's check program (grade_lab<N>, grade_lab<N>_reference, ...) and
// of the runtime's own tests under mpiexec (dp_mpi_tests).
//
// Started by `dplab grade`, it reports every test on the driver's results channel (see
// result_reporter.h): the driver scores what arrives there, never what the program prints
// or writes to files. Started by hand, it says which grading seed its checks draw from. On the
// local backend it is otherwise GoogleTest's usual main. Under mpi (DPLAB_TEST_BACKEND=mpi, started
// by `dplab grade --backend mpi`) every process runs every check, so that every process makes the
// same sequence of dp::launch calls; each reports on its own rank's channel (the FIFO of the
// rank in Open MPI's environment, opened before main), the driver merges
// them, and only rank 0 prints the usual progress: the other ranks print just their failures,
// prefixed with their rank.
#include <gtest/gtest.h>

#include <cstdio>

#include "dp/launch.h"
#include "grading.h"
#include "result_reporter.h"

namespace {

/// Prints a non-zero rank's failed assertions and tests; stays silent otherwise.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}

  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                 result.file_name() != nullptr ? result.file_name() : "unknown",
                 result.line_number(), result.message());
  }

  void OnTestEnd(const ::testing::TestInfo& test) override {
    if (test.result()->Failed())
      std::fprintf(stderr, "[rank %d] FAILED %s.%s\n", rank_, test.test_suite_name(), test.name());
  }

 private:
  int rank_;
};

}  // namespace

// Before any constructor of the program runs, the lab's static objects included: the token
// file is read and deleted and the channel's variable removed (see result_reporter.h).
DP_TAKE_RESULT_CHANNEL_AT_START();

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  dp::grading::use_check_device();
  int rank = 0;
  if (dp::grading::check_backend() == dp::Backend::kMpi ||
      (dp::grading::check_backend() == dp::Backend::kNccl && dp::started_by_mpi())) {
    rank = dp::mpi_world_rank();  // starts MPI
    if (rank != 0) {
      auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new FailurePrinter(rank));
    }
  }
  if (!dp::grading::started_by_the_driver() && rank == 0)
    std::printf("grading seed %llu (set DPLAB_GRADE_SEED to draw another configuration)\n",
                static_cast<unsigned long long>(dp::grading::grade_seed()));
  dp::grading::report_results_to_driver();
  return RUN_ALL_TESTS();
}
