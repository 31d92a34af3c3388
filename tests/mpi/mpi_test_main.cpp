// The main() of GoogleTest programs that run under mpiexec: every process runs every test
// (so every process makes the same sequence of dp::launch calls), rank 0 prints the usual
// report, and the other ranks print only their failures, prefixed with their rank. Each
// process exits non-zero when one of its tests failed, and then so does mpiexec.
#include <gtest/gtest.h>

#include <cstdio>

#include "dp/launch.h"

namespace {

/// Prints a non-zero rank's failed assertions and tests; stays silent otherwise.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}

  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                 result.file_name() ? result.file_name() : "unknown", result.line_number(),
                 result.message());
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
  const int rank = dp::mpi_world_rank();  // starts MPI
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(rank));
  }
  return RUN_ALL_TESTS();
}
