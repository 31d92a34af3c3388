// fake_checks: a stand-in for a lab's check program, for the grade driver's tests.
//
// FAKE_CHECKS_MODE picks its behaviour: unset or "normal" runs the tests below (one
// passes, one fails with a message, one is skipped, two are parameterised); "crash"
// dies of SIGSEGV, "hang" sleeps forever, "no_report" exits 3 before gtest writes a
// report, "garbage" writes a report that is not JSON.
#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

namespace {

std::string mode() {
  const char* value = std::getenv("FAKE_CHECKS_MODE");
  return value == nullptr ? "normal" : value;
}

TEST(FakeChecks, Passes) {
  EXPECT_EQ(2 + 2, 4);
}

TEST(FakeChecks, FailsWithFeedback) {
  ADD_FAILURE() << "rank 2 parameter fc1.weight differs from the 1-rank baseline after step 3: "
                   "max abs diff 4.1e-2 at [17, 3]; expected <= 2e-6";
}

TEST(FakeChecks, IsSkipped) {
  // A fixture, not a check of dplab: test_runner and test_report need a skipped test to
  // show that a skip earns no points.
  GTEST_SKIP() << "skipped on purpose: the grader must score a skipped check 0";
}

TEST(FakeChecks, ReportsTheBackend) {
  const char* backend = std::getenv("DPLAB_TEST_BACKEND");
  ASSERT_NE(backend, nullptr);
  EXPECT_STREQ(backend, "local");
}

class FakeRanks : public ::testing::TestWithParam<int> {};
TEST_P(FakeRanks, EvenOnly) {
  EXPECT_EQ(GetParam() % 2, 0) << "odd world size " << GetParam();
}
INSTANTIATE_TEST_SUITE_P(WorldSizes, FakeRanks, ::testing::Values(1, 2),
                         [](const ::testing::TestParamInfo<int>& instance) {
                           return "ranks" + std::to_string(instance.param);
                         });

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const std::string how = mode();
  std::printf("fake_checks: mode %s\n", how.c_str());
  std::fflush(stdout);
  if (how == "crash") {
    // Sanitizers catch SIGSEGV to print a report and exit with 1: restore the default
    // action so that the process dies of the signal, as a real crash does.
    std::signal(SIGSEGV, SIG_DFL);
    std::raise(SIGSEGV);
  }
  if (how == "hang")
    while (true) std::this_thread::sleep_for(std::chrono::seconds(1));
  if (how == "no_report") return 3;
  if (how == "garbage") {
    // Find the report file gtest would write and put something that is not JSON there.
    const std::string output = ::testing::GTEST_FLAG(output);
    const std::string path = output.substr(std::strlen("json:"));
    if (FILE* file = std::fopen(path.c_str(), "w")) {
      std::fputs("{\"testsuites\": [", file);
      std::fclose(file);
    }
    return 1;
  }
  return RUN_ALL_TESTS();
}
