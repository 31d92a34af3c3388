// The main() of every lab's check program (grade_lab<N>, grade_lab<N>_reference, ...) and
// of the runtime's own tests under mpiexec (dp_mpi_tests).
//
// On the local backend it is GoogleTest's usual main. Under mpi (DPLAB_TEST_BACKEND=mpi,
// started by `dplab grade --backend mpi`) every process runs every check, so that every
// process makes the same sequence of dp::launch calls; each writes its own JSON report,
// which the grade driver merges, and only rank 0 prints the usual progress: the other
// ranks print just their failures, prefixed with their rank.
#include <gtest/gtest.h>

#include <cstdio>

#include "dp/launch.h"
#include "grading.h"

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

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (dp::grading::check_backend() == dp::Backend::kMpi) {
    const int rank = dp::mpi_world_rank();  // starts MPI
    if (rank != 0) {
      auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new FailurePrinter(rank));
    }
  }
  return RUN_ALL_TESTS();
}
