// Tests of the runner on a real GoogleTest program (fake_checks): its report is read,
// and a crash, a hang, a missing program or a missing report end the run with the
// right status and never throw.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <filesystem>
#include <string>

#include "dp/error.h"
#include "runner.h"

namespace dp::grader {
namespace {

using namespace std::chrono_literals;

/// A run request for fake_checks in a fresh directory, in mode `mode`.
class RunnerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::path(::testing::TempDir()) / "dp_grader_runner" / info->name();
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    request_.program = DP_FAKE_CHECKS;
    request_.work_dir = dir_;
    request_.name = "fake";
  }
  void TearDown() override { unsetenv("FAKE_CHECKS_MODE"); }

  RunResult run_in_mode(const char* mode) {
    setenv("FAKE_CHECKS_MODE", mode, 1);
    return run_check_program(request_);
  }

  std::filesystem::path dir_;
  RunRequest request_;
};

TEST_F(RunnerTest, ReadsEveryTestOfTheReport) {
  const RunResult result = run_in_mode("normal");
  ASSERT_EQ(result.status, RunStatus::kFinished) << result.summary() << result.output_tail;
  EXPECT_EQ(result.exit_code, 1);  // a test failed
  EXPECT_EQ(result.summary(), "");
  ASSERT_EQ(result.tests.size(), 6u);
  EXPECT_EQ(result.tests.at("FakeChecks.Passes").state, TestState::kPassed);
  EXPECT_EQ(result.tests.at("FakeChecks.ReportsTheBackend").state, TestState::kPassed)
      << result.tests.at("FakeChecks.ReportsTheBackend").failure;
  EXPECT_EQ(result.tests.at("FakeChecks.IsSkipped").state, TestState::kSkipped);
  const TestOutcome& failed = result.tests.at("FakeChecks.FailsWithFeedback");
  EXPECT_EQ(failed.state, TestState::kFailed);
  EXPECT_NE(failed.failure.find("max abs diff 4.1e-2 at [17, 3]; expected <= 2e-6"),
            std::string::npos)
      << failed.failure;
  // Parameterised names as gtest prints them: Prefix/Suite.Name/param.
  EXPECT_EQ(result.tests.at("WorldSizes/FakeRanks.EvenOnly/ranks2").state, TestState::kPassed);
  EXPECT_EQ(result.tests.at("WorldSizes/FakeRanks.EvenOnly/ranks1").state, TestState::kFailed);
  EXPECT_NE(result.output_tail.find("[  FAILED  ] FakeChecks.FailsWithFeedback"), std::string::npos)
      << result.output_tail;
}

TEST_F(RunnerTest, ACrashIsReportedWithItsSignal) {
  const RunResult result = run_in_mode("crash");
  EXPECT_EQ(result.status, RunStatus::kCrashed);
  EXPECT_EQ(result.signal, SIGSEGV);
  EXPECT_NE(result.summary().find("check program crashed (signal 11"), std::string::npos)
      << result.summary();
  EXPECT_TRUE(result.tests.empty());
}

TEST_F(RunnerTest, AHangIsKilledAtTheTimeLimit) {
  request_.time_limit = 500ms;
  const auto start = std::chrono::steady_clock::now();
  const RunResult result = run_in_mode("hang");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(result.status, RunStatus::kTimedOut);
  EXPECT_EQ(result.summary(), "timed out after 0.5 s (the check program was killed)");
  EXPECT_LT(seconds, 5.0) << "SIGTERM should end the hang at once";
  EXPECT_NE(result.output_tail.find("fake_checks: mode hang"), std::string::npos)
      << "the output before the hang is kept";
}

TEST_F(RunnerTest, AMissingProgramIsReportedNotThrown) {
  request_.program = dir_ / "grade_lab99";
  const RunResult result = run_check_program(request_);
  EXPECT_EQ(result.status, RunStatus::kMissing);
  EXPECT_NE(result.summary().find("grade_lab99 not found"), std::string::npos) << result.summary();
}

TEST_F(RunnerTest, AnExitWithoutReportSaysSo) {
  const RunResult result = run_in_mode("no_report");
  EXPECT_EQ(result.status, RunStatus::kNoReport);
  EXPECT_EQ(result.summary(), "check program exited with code 3 without writing its report");
}

TEST_F(RunnerTest, AnUnreadableReportIsNoReport) {
  const RunResult result = run_in_mode("garbage");
  EXPECT_EQ(result.status, RunStatus::kNoReport);
  EXPECT_NE(result.output_tail.find("is not valid JSON at byte"), std::string::npos)
      << result.output_tail;
}

TEST_F(RunnerTest, ALauncherThatStartsNothingIsAFailedStart) {
  request_.launcher = [](const std::vector<std::vector<std::string>>& per_rank) {
    std::vector<std::string> argv = {"dplab-no-such-launcher"};
    for (const auto& command : per_rank) argv.insert(argv.end(), command.begin(), command.end());
    return argv;
  };
  request_.processes = 2;
  const RunResult result = run_check_program(request_);
  EXPECT_EQ(result.status, RunStatus::kFailedToStart);
  EXPECT_NE(result.summary().find("cannot start dplab-no-such-launcher"), std::string::npos)
      << result.summary();
}

TEST_F(RunnerTest, MissingReportsOfOtherRanksAreFine) {
  // A launcher that starts only rank 0: like a check main() whose other ranks write nothing.
  request_.launcher = [](const std::vector<std::vector<std::string>>& per_rank) {
    return per_rank.front();
  };
  request_.processes = 3;
  const RunResult result = run_in_mode("normal");
  EXPECT_EQ(result.status, RunStatus::kFinished) << result.summary();
  EXPECT_EQ(result.tests.size(), 6u);
}

TEST_F(RunnerTest, BadRequestsThrow) {
  request_.processes = 2;
  EXPECT_THROW(run_check_program(request_), Error);  // no launcher
  request_.processes = 1;
  request_.work_dir = dir_ / "missing";
  EXPECT_THROW(run_check_program(request_), Error);
}

TEST(MergeReports, AFailureOnAnyRankFailsTheTest) {
  const std::vector<TestOutcome> rank0 = {{"A.Same", TestState::kPassed, "", 0.1},
                                          {"A.Differs", TestState::kPassed, "", 0.2}};
  const std::vector<TestOutcome> rank1 = {{"A.Same", TestState::kPassed, "", 0.3},
                                          {"A.Differs", TestState::kFailed, "x.cpp:3\nbad", 0.1}};
  const auto merged = merge_reports({{0, rank0}, {1, rank1}});
  EXPECT_EQ(merged.at("A.Same").state, TestState::kPassed);
  EXPECT_DOUBLE_EQ(merged.at("A.Same").seconds, 0.3);
  EXPECT_EQ(merged.at("A.Differs").state, TestState::kFailed);
  EXPECT_EQ(merged.at("A.Differs").failure, "[rank 1] x.cpp:3\nbad");
}

TEST(GtestReport, NotAReportIsAnError) {
  EXPECT_THROW(parse_gtest_report(R"({"tests": 3})", "r.json"), Error);
  EXPECT_THROW(parse_gtest_report("{", "r.json"), Error);
}

TEST(LastLines, KeepsTheEnd) {
  EXPECT_EQ(last_lines("a\nb\nc\nd\n", 2), "c\nd");
  EXPECT_EQ(last_lines("a\nb", 5), "a\nb");
  EXPECT_EQ(last_lines("", 3), "");
  EXPECT_EQ(last_lines("abcdef", 3, 2), "ef");
}

}  // namespace
}  // namespace dp::grader
