// Tests of the runner on a real GoogleTest program (fake_checks) that reports on the results
// channel as a check program does: what arrives there is scored and nothing else; a crash,
// an exit, a hang or endless output ends the run with the right sentence per check and
// never throws; and nothing the program started outlives the run.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>

#include "dp/error.h"
#include "report.h"
#include "result_channel.h"
#include "runner.h"

namespace dp::grader {
namespace {

using namespace std::chrono_literals;

/// A run request for fake_checks in mode `mode`.
class RunnerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    request_.program = DP_FAKE_CHECKS;
    request_.time_limit = 30s;
  }
  void TearDown() override {
    unsetenv("FAKE_CHECKS_MODE");
    unsetenv("FAKE_CHECKS_MARKER");
  }

  RunResult run_in_mode(const char* mode) { return run_check_program(request_in_mode(mode)); }

  /// The request, with fake_checks set to behave as `mode` says.
  RunRequest request_in_mode(const char* mode) {
    setenv("FAKE_CHECKS_MODE", mode, 1);
    return request_;
  }

  RunRequest request_;
};

/// A rubric of fake_checks' tests, one point each.
Rubric rubric_of(const std::vector<std::string>& tests) {
  Rubric rubric;
  rubric.lab = 9;
  rubric.title = "fake";
  for (const std::string& test : tests)
    rubric.checks.push_back({test, 1, Visibility::kVisible, ""});
  return rubric;
}

/// Every pid whose command line contains `marker`.
std::vector<int> processes_with(const std::string& marker) {
  std::vector<int> found;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream file(entry.path() / "cmdline", std::ios::binary);
    const std::string cmdline((std::istreambuf_iterator<char>(file)),
                              std::istreambuf_iterator<char>());
    if (cmdline.find(marker) != std::string::npos) found.push_back(std::stoi(name));
  }
  return found;
}

/// This process's peak resident memory in KiB (VmHWM).
long peak_memory_kib() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.starts_with("VmHWM:")) return std::stol(line.substr(6));
  return -1;
}

TEST_F(RunnerTest, ReadsEveryTestFromTheChannel) {
  const RunResult result = run_in_mode("normal");
  ASSERT_EQ(result.status, RunStatus::kFinished) << result.summary() << result.output_tail;
  EXPECT_EQ(result.exit_code, 1);  // a test failed
  EXPECT_EQ(result.summary(), "");
  EXPECT_EQ(result.lines_without_token, 0u);
  EXPECT_EQ(result.tests.at("FakeChecks.Passes").state, TestState::kPassed);
  EXPECT_EQ(result.tests.at("FakeChecks.ReportsTheBackend").state, TestState::kPassed)
      << result.tests.at("FakeChecks.ReportsTheBackend").failure;
  EXPECT_EQ(result.tests.at("FakeChecks.SeesNoChannelVariables").state, TestState::kPassed)
      << result.tests.at("FakeChecks.SeesNoChannelVariables").failure;
  EXPECT_EQ(result.tests.at("FakeChecks.IsSkipped").state, TestState::kSkipped);
  const TestOutcome& failed = result.tests.at("FakeChecks.FailsWithFeedback");
  EXPECT_EQ(failed.state, TestState::kFailed);
  EXPECT_NE(failed.failure.find("max abs diff 4.1e-2 at [17, 3]; expected <= 2e-6"),
            std::string::npos)
      << failed.failure;
  EXPECT_NE(failed.failure.find("fake_checks.cpp:"), std::string::npos)
      << "gtest's location line, which the report drops: " << failed.failure;
  // Parameterised names as gtest prints them: Prefix/Suite.Name/param.
  EXPECT_EQ(result.tests.at("WorldSizes/FakeRanks.EvenOnly/ranks2").state, TestState::kPassed);
  EXPECT_EQ(result.tests.at("WorldSizes/FakeRanks.EvenOnly/ranks1").state, TestState::kFailed);
  EXPECT_NE(result.output_tail.find("[  FAILED  ] FakeChecks.FailsWithFeedback"), std::string::npos)
      << result.output_tail;
  ASSERT_EQ(result.ranks.size(), 1u);
  EXPECT_TRUE(result.ranks[0].registered.at("FakeOrder.Third"));
}

TEST_F(RunnerTest, TheSeedReachesTheCheckProgramAndNotesArriveOnAPass) {
  request_.environment[channel::kSeedVariable] = "18446744073709551615";
  const RunResult result = run_in_mode("normal");
  const TestOutcome& noted = result.tests.at("FakeChecks.NotesWhatItMeasured");
  EXPECT_EQ(noted.state, TestState::kPassed) << noted.failure;
  EXPECT_EQ(noted.notes, (std::vector<std::string>{"saw DPLAB_GRADE_SEED=18446744073709551615",
                                                   "grade_seed() = 18446744073709551615"}));
  // Taken at every test's end: the next test does not inherit them.
  EXPECT_TRUE(result.tests.at("FakeChecks.ReportsTheBackend").notes.empty());

  const LabResult lab = score_lab(rubric_of({"FakeChecks.NotesWhatItMeasured"}), result);
  GradeReport report;
  report.labs.push_back(lab);
  EXPECT_NE(format_table(report).find("measured: grade_seed() = 18446744073709551615"),
            std::string::npos)
      << format_table(report);
}

TEST_F(RunnerTest, AForgedReportAndFakeOkLinesEarnNothing) {
  const std::filesystem::path forged =
      std::filesystem::path(::testing::TempDir()) / "dp_grader_forged_report.json";
  request_.arguments = {"--gtest_output=json:" + forged.string()};
  const RunResult result = run_in_mode("forged");
  ASSERT_TRUE(std::filesystem::exists(forged)) << "the fake wrote its forged report";
  EXPECT_NE(result.output.find("[       OK ] FakeChecks.Passes"), std::string::npos);
  EXPECT_EQ(result.status, RunStatus::kIncomplete);
  EXPECT_TRUE(result.tests.empty());
  const LabResult lab =
      score_lab(rubric_of({"FakeChecks.Passes", "FakeChecks.FailsWithFeedback"}), result);
  EXPECT_DOUBLE_EQ(lab.earned(), 0);
  for (const CheckResult& check : lab.checks)
    EXPECT_EQ(check.feedback,
              "did not report a result: the check program exited (code 0) before running it (it "
              "sent no result at all)");
  std::filesystem::remove(forged);
}

TEST_F(RunnerTest, LinesWithoutTheTokenAreIgnoredAndCounted) {
  const RunResult result = run_in_mode("untokened");
  ASSERT_EQ(result.status, RunStatus::kFinished) << result.summary() << result.output_tail;
  EXPECT_EQ(result.lines_without_token, 3u);
  EXPECT_EQ(result.malformed_lines, 1u);
  EXPECT_EQ(result.tests.at("FakeChecks.FailsWithFeedback").state, TestState::kFailed);
  ASSERT_EQ(result.notices().size(), 2u);
  EXPECT_EQ(result.notices()[0],
            "ignored 3 line(s) on the results channel without this run's token");
  EXPECT_EQ(result.notices()[1], "ignored 1 malformed line(s) on the results channel");
}

TEST_F(RunnerTest, AResultSentOutOfOrderWithTheTokenFailsEveryCheck) {
  // A lab that read the token would forge a pass; the real reporter then sends the real
  // result too. The channel's order gives it away, and nothing of the run counts.
  const RunResult result = run_in_mode("forged_with_token");
  EXPECT_EQ(result.out_of_order(),
            "a result for FakeChecks.FailsWithFeedback that was never started");
  const LabResult lab =
      score_lab(rubric_of({"FakeChecks.Passes", "FakeChecks.FailsWithFeedback"}), result);
  for (const CheckResult& check : lab.checks) {
    EXPECT_FALSE(check.passed) << check.check.test;
    EXPECT_NE(check.feedback.find("something other than the check program's reporter wrote to "
                                  "it"),
              std::string::npos)
        << check.feedback;
  }
}

TEST_F(RunnerTest, AForgedEndFollowedByAnAbortFailsEveryCheck) {
  // The adversarial trial's forgery: the rest of the run's events in order with the token,
  // then abort() before the real reporter sends anything. The order is right; the end is not.
  const RunResult result = run_in_mode("forged_then_abort");
  EXPECT_EQ(result.out_of_order(), "");
  EXPECT_EQ(result.status, RunStatus::kCrashed);
  EXPECT_NE(result.contradiction().find("said that every check had run, and then check "
                                        "program crashed"),
            std::string::npos)
      << result.contradiction();
  const LabResult lab =
      score_lab(rubric_of({"FakeChecks.Passes", "FakeOrder.Second", "FakeOrder.Third"}), result);
  for (const CheckResult& check : lab.checks) {
    EXPECT_FALSE(check.passed) << check.check.test;
    EXPECT_NE(check.feedback.find("no result of this run counts"), std::string::npos)
        << check.feedback;
  }
}

TEST_F(RunnerTest, AForgedEndWithTheWrongExitStatusFailsEveryCheck) {
  // The same forgery ended with _Exit(0): GoogleTest exits 0 only when no check failed, and
  // FakeChecks.FailsWithFeedback did.
  const RunResult result = run_in_mode("forged_then_exit");
  EXPECT_EQ(result.status, RunStatus::kFinished);
  EXPECT_EQ(result.exit_code, 0);
  EXPECT_NE(result.contradiction().find("reported a failed check and exited with status 0"),
            std::string::npos)
      << result.contradiction();
  const LabResult lab = score_lab(rubric_of({"FakeChecks.Passes", "FakeOrder.Third"}), result);
  for (const CheckResult& check : lab.checks) EXPECT_FALSE(check.passed) << check.check.test;
}

TEST_F(RunnerTest, ARunThatBreaksCountsNothingAndEveryOtherCheckRunsAlone) {
  // A crash in FakeOrder.Second: the run's results do not count (the code that broke it could
  // have forged them), and every other check runs again on its own, so the crash costs the
  // check that crashes and nothing else.
  const RunRequest request = request_in_mode("crash");
  const std::vector<std::string> checks = {"FakeChecks.Passes", "FakeChecks.FailsWithFeedback",
                                           "FakeOrder.Second", "FakeOrder.Third"};
  const RunResult result = run_checks(request, checks);
  EXPECT_NE(result.rerun_note.find("while running FakeOrder.Second: no result of that run "
                                   "counts; every other check ran again"),
            std::string::npos)
      << result.rerun_note;
  const LabResult lab = score_lab(rubric_of(checks), result);
  EXPECT_TRUE(lab.checks[0].passed) << lab.checks[0].feedback;
  EXPECT_FALSE(lab.checks[1].passed);
  EXPECT_NE(lab.checks[1].feedback.find("rank 2 parameter fc1.weight differs"), std::string::npos)
      << lab.checks[1].feedback;
  EXPECT_FALSE(lab.checks[2].passed);
  EXPECT_NE(lab.checks[2].feedback.find("crashed"), std::string::npos) << lab.checks[2].feedback;
  EXPECT_TRUE(lab.checks[3].passed) << lab.checks[3].feedback;
  EXPECT_EQ(lab.problem, result.rerun_note);
}

TEST_F(RunnerTest, AForgedRunWithoutItsEndCountsNothingOfWhatItForged) {
  // The second trial's forgery: passes for the rest of the run without the program's end,
  // then abort(). Nothing of the run counts; alone, each check reports what it is.
  const RunRequest request = request_in_mode("forged_without_end_then_abort");
  const std::vector<std::string> checks = {"FakeChecks.FailsWithFeedback", "FakeOrder.Second",
                                           "FakeOrder.Third"};
  const LabResult lab = score_lab(rubric_of(checks), run_checks(request, checks));
  EXPECT_FALSE(lab.checks[0].passed) << "the forged pass of a failing check counted";
  EXPECT_FALSE(lab.checks[1].passed) << "the check that forged counted";
}

TEST_F(RunnerTest, AnExitInsideATestFailsItAndEveryLaterOne) {
  const RunResult result = run_in_mode("exit");
  EXPECT_EQ(result.status, RunStatus::kIncomplete);
  EXPECT_EQ(result.exit_code, 0);
  EXPECT_EQ(result.summary(), "check program exited with code 0 before reporting every result");
  const LabResult lab =
      score_lab(rubric_of({"FakeOrder.First", "FakeOrder.Second", "FakeOrder.Third",
                           "WorldSizes/FakeRanks.EvenOnly/ranks2"}),
                result);
  EXPECT_TRUE(lab.checks[0].passed) << lab.checks[0].feedback;
  EXPECT_EQ(lab.checks[1].feedback,
            "did not report a result: the check program exited (code 0) while running it");
  EXPECT_EQ(lab.checks[2].feedback,
            "did not report a result: the check program exited (code 0) while running "
            "FakeOrder.Second, before this check");
  EXPECT_FALSE(lab.checks[3].passed);
  EXPECT_DOUBLE_EQ(lab.earned(), 1);
}

TEST_F(RunnerTest, ACrashInTheSecondTestKeepsTheFirstPass) {
  for (const auto& [mode, signal] : {std::pair{"crash", SIGSEGV}, std::pair{"abort", SIGABRT}}) {
    SCOPED_TRACE(mode);
    const RunResult result = run_in_mode(mode);
    EXPECT_EQ(result.status, RunStatus::kCrashed);
    EXPECT_EQ(result.signal, signal);
    EXPECT_NE(result.summary().find(fmt::format("check program crashed (signal {}", signal)),
              std::string::npos)
        << result.summary();
    const LabResult lab = score_lab(rubric_of({"FakeOrder.First", "FakeOrder.Second"}), result);
    EXPECT_TRUE(lab.checks[0].passed);
    EXPECT_EQ(lab.checks[1].feedback,
              fmt::format("did not report a result: the check program crashed (signal {}: {}) "
                          "while running it",
                          signal, strsignal(signal)));
  }
}

TEST_F(RunnerTest, AHangIsKilledAtTheTimeLimit) {
  // 2 s, not less: the fake program must start, pass its first test and reach the hang
  // within the limit, and at a CI run's start (load ~10 on 2 cores) starting took over 0.5 s.
  request_.time_limit = 2s;
  const auto start = std::chrono::steady_clock::now();
  const RunResult result = run_in_mode("hang");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(result.status, RunStatus::kTimedOut);
  EXPECT_EQ(result.summary(), "timed out after 2 s (the check program was killed)");
  EXPECT_LT(seconds, 6.0) << "SIGTERM should end the hang at once";
  EXPECT_NE(result.output_tail.find("fake_checks: mode hang"), std::string::npos)
      << "the output before the hang is kept";
  EXPECT_EQ(result.tests.at("FakeOrder.First").state, TestState::kPassed);
  EXPECT_EQ(result.missing_result("FakeOrder.Second"),
            "did not report a result: the check program timed out while running it");
}

TEST_F(RunnerTest, EndlessOutputIsCappedAndTimesOut) {
  request_.time_limit = 1500ms;
  const long peak_before = peak_memory_kib();
  const RunResult result = run_in_mode("print_forever");
  EXPECT_EQ(result.status, RunStatus::kTimedOut);
  EXPECT_LE(result.output.size(), kOutputCapBytes + 100) << "the cap plus the note";
  EXPECT_GE(result.output.size(), kOutputCapBytes) << "it printed far more than the cap";
  EXPECT_NE(result.output.find("fake_checks: mode print_forever"), std::string::npos)
      << "the head is kept";
  EXPECT_NE(result.output.find(" bytes left out ...]"), std::string::npos);
  EXPECT_NE(result.output_tail.find("fills no disk and no memory"), std::string::npos)
      << "the tail is kept";
  EXPECT_LT(peak_memory_kib() - peak_before, 64 * 1024) << "the driver's memory stays bounded";
}

TEST_F(RunnerTest, NoProcessTheRunStartedOutlivesIt) {
  std::random_device device;
  const std::string marker = fmt::format("dplab-fake-orphan-{:08x}{:08x}", device(), device());
  setenv("FAKE_CHECKS_MARKER", marker.c_str(), 1);
  const RunResult result = run_in_mode("orphan");
  EXPECT_EQ(result.status, RunStatus::kFinished) << result.summary() << result.output_tail;
  EXPECT_EQ(result.tests.at("FakeOrder.Second").state, TestState::kPassed)
      << result.tests.at("FakeOrder.Second").failure;
  EXPECT_TRUE(result.surviving_processes.empty());
  EXPECT_EQ(processes_with(marker), std::vector<int>{})
      << "the setsid grandchild " << marker << " outlived the run";
}

// A Ctrl-C or a kill of the grader reaches the check program, which runs in a process group
// of its own (where a terminal's Ctrl-C never arrives): without forwarding, mpirun and its
// ranks ran on after `timeout` ended `dplab grade`, busy-polling two cores for 20 minutes.
TEST_F(RunnerTest, ASignalToTheGraderEndsTheCheckProgramToo) {
  const std::filesystem::path pid_file =
      std::filesystem::temp_directory_path() / fmt::format("dplab-forward-{}", getpid());
  std::filesystem::remove(pid_file);
  // The launcher's shell writes its pid and becomes the check program, which hangs; a
  // second later (once the program is asleep: one still printing would die of SIGPIPE when
  // the grader's end of the pipe closes, forwarded or not) a subshell interrupts the grader,
  // the shell's parent.
  request_.launcher = [pid_file](const std::vector<std::string>& command, int, const auto&) {
    std::vector<std::string> argv = {
        "/bin/sh", "-c",
        fmt::format("echo $$ > '{}'; (sleep 1; kill -INT $PPID) & exec \"$@\"", pid_file.string()),
        "sh"};
    argv.insert(argv.end(), command.begin(), command.end());
    return argv;
  };
  setenv("FAKE_CHECKS_MODE", "hang", 1);
  // The grader in a child of this test (not a death test, which would wait for the end of
  // the hanging program's copy of its pipe, forever when forwarding fails).
  const pid_t grader = fork();
  if (grader == 0) {
    run_check_program(request_);
    _exit(0);  // not reached when the signal ends it
  }
  ASSERT_GT(grader, 0);
  int status = 0;
  waitpid(grader, &status, 0);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGINT)
      << "the grader ends as the signal says, after forwarding it (status " << status << ")";
  int pid = 0;
  std::ifstream(pid_file) >> pid;
  std::filesystem::remove(pid_file);
  ASSERT_GT(pid, 0) << "the launcher did not run";
  // Gone, or a zombie of this process (a subreaper since an earlier run) left to reap.
  const auto running = [pid] {
    std::ifstream stat(fmt::format("/proc/{}/stat", pid));
    std::string text;
    if (!std::getline(stat, text)) return false;
    return text.substr(text.rfind(')') + 2, 1) != "Z";
  };
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (running() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(10ms);
  const bool survived = running();
  if (survived) kill(pid, SIGKILL);
  waitpid(pid, nullptr, WNOHANG);
  EXPECT_FALSE(survived) << "the hanging check program outlived the grader";
}

TEST_F(RunnerTest, AThreadSanitizerReportFailsEveryCheck) {
  const RunResult result = run_in_mode("tsan_report");
  EXPECT_EQ(result.status, RunStatus::kFinished) << result.summary();
  EXPECT_EQ(result.sanitizer_reports, 1u);
  EXPECT_TRUE(result.sanitizer_report.starts_with("WARNING: ThreadSanitizer: data race"))
      << result.sanitizer_report;
  EXPECT_TRUE(result.sanitizer_report.ends_with("in increment")) << result.sanitizer_report;
  const LabResult lab = score_lab(rubric_of({"FakeChecks.Passes", "FakeOrder.Second"}), result);
  EXPECT_DOUBLE_EQ(lab.earned(), 0);
  EXPECT_NE(lab.checks[0].feedback.find("ThreadSanitizer reported 1 threading error(s)"),
            std::string::npos)
      << lab.checks[0].feedback;
  GradeReport report;
  report.labs.push_back(lab);
  EXPECT_NE(format_table(report).find("    | SUMMARY: ThreadSanitizer: data race fake.cpp:12"),
            std::string::npos)
      << format_table(report);
}

#ifdef DP_FAKE_CHECKS_TSAN
TEST_F(RunnerTest, ARealDataRaceUnderThreadSanitizerFailsEveryCheck) {
  request_.program = DP_FAKE_CHECKS_TSAN;
  const RunResult clean = run_in_mode("normal");
  EXPECT_EQ(clean.sanitizer_reports, 0u) << clean.sanitizer_report;
  const RunResult raced = run_in_mode("race");
  EXPECT_GE(raced.sanitizer_reports, 1u) << raced.output_tail;
  EXPECT_NE(raced.sanitizer_report.find("data race"), std::string::npos) << raced.sanitizer_report;
  EXPECT_DOUBLE_EQ(score_lab(rubric_of({"FakeChecks.Passes"}), raced).earned(), 0);
}
#endif

TEST_F(RunnerTest, AMissingProgramIsReportedNotThrown) {
  request_.program = "/nonexistent/grade_lab99";
  const RunResult result = run_check_program(request_);
  EXPECT_EQ(result.status, RunStatus::kMissing);
  EXPECT_NE(result.summary().find("grade_lab99 not found"), std::string::npos) << result.summary();
}

TEST_F(RunnerTest, AProgramWithoutItsExecuteBitIsNotCalledMissing) {
  // Issue 32: it was "not found (build it)", which a build does not fix.
  const std::filesystem::path copy =
      std::filesystem::path(::testing::TempDir()) / "grade_lab98_not_executable";
  std::filesystem::copy_file(DP_FAKE_CHECKS, copy,
                             std::filesystem::copy_options::overwrite_existing);
  std::filesystem::permissions(copy, std::filesystem::perms::owner_read |
                                         std::filesystem::perms::owner_write |
                                         std::filesystem::perms::group_read);
  request_.program = copy;
  const RunResult result = run_check_program(request_);
  EXPECT_EQ(result.status, RunStatus::kMissing);
  EXPECT_NE(result.summary().find("grade_lab98_not_executable is not executable (no execute "
                                  "permission for this user: chmod +x it"),
            std::string::npos)
      << result.summary();
  EXPECT_EQ(result.summary().find("not found"), std::string::npos) << result.summary();
  std::filesystem::remove(copy);
}

TEST_F(RunnerTest, ATemporaryDirectoryThatDoesNotExistIsNamed) {
  // Issue 32: std::filesystem's exception ended as an internal error.
  const char* saved = std::getenv("TMPDIR");
  const std::string before = saved != nullptr ? saved : "";
  setenv("TMPDIR", "/nonexistent-dplab-tmp", 1);
  std::string message;
  try {
    run_in_mode("normal");
  } catch (const Error& error) {
    message = error.what();
  }
  if (saved != nullptr)
    setenv("TMPDIR", before.c_str(), 1);
  else
    unsetenv("TMPDIR");
  EXPECT_NE(message.find("no directory for temporary files: TMPDIR is '/nonexistent-dplab-tmp', "
                         "which is not a directory"),
            std::string::npos)
      << message;
}

TEST_F(RunnerTest, AnExitBeforeAnyTestSaysSo) {
  const RunResult result = run_in_mode("no_report");
  EXPECT_EQ(result.status, RunStatus::kIncomplete);
  EXPECT_EQ(result.summary(), "check program exited with code 3 before reporting every result");
  EXPECT_EQ(result.missing_result("FakeChecks.Passes"),
            "did not report a result: the check program exited (code 3) before running it (it "
            "sent no result at all)");
}

TEST_F(RunnerTest, ARubricTestTheProgramLacksIsNamed) {
  const RunResult result = run_in_mode("normal");
  EXPECT_NE(result.missing_result("FakeChecks.Typo")
                .find("\"FakeChecks.Typo\" not found in the check program"),
            std::string::npos)
      << result.missing_result("FakeChecks.Typo");
}

TEST_F(RunnerTest, ALauncherThatStartsNothingIsAFailedStart) {
  request_.launcher = [](const std::vector<std::string>& command, int, const auto&) {
    std::vector<std::string> argv = {"dplab-no-such-launcher"};
    argv.insert(argv.end(), command.begin(), command.end());
    return argv;
  };
  request_.processes = 2;
  const RunResult result = run_check_program(request_);
  EXPECT_EQ(result.status, RunStatus::kFailedToStart);
  EXPECT_NE(result.summary().find("cannot start dplab-no-such-launcher"), std::string::npos)
      << result.summary();
}

TEST_F(RunnerTest, RanksAreMergedAndAFailureOnAnyRankFails) {
  // Two processes that report as ranks 0 and 1, as mpirun would start them.
  request_.launcher = [](const std::vector<std::string>& command, int, const auto&) {
    std::vector<std::string> argv = {
        "/bin/sh", "-c",
        R"(FAKE_CHECKS_RANK=1 OMPI_COMM_WORLD_RANK=1 "$0" "$@" & "$0" "$@"; wait)"};
    argv.insert(argv.end(), command.begin(), command.end());
    return argv;
  };
  request_.processes = 2;
  const RunResult result = run_in_mode("normal");
  EXPECT_EQ(result.status, RunStatus::kFinished) << result.summary() << result.output_tail;
  EXPECT_EQ(result.tests.at("FakeChecks.Passes").state, TestState::kPassed);
  const TestOutcome& split = result.tests.at("FakeChecks.FailsOnRankOne");
  EXPECT_EQ(split.state, TestState::kFailed);
  EXPECT_NE(split.failure.find("[rank 1] "), std::string::npos) << split.failure;
  EXPECT_NE(split.failure.find("rank 1 disagrees"), std::string::npos) << split.failure;
}

#ifdef DP_MPIRUN
TEST_F(RunnerTest, UnderMpirunEveryRankGetsTheChannelAndTheSeed) {
  request_.launcher = [](const std::vector<std::string>& command, int processes,
                         const std::vector<std::string>& variables) {
    std::vector<std::string> argv = {DP_MPIRUN, "--oversubscribe", "-n", std::to_string(processes)};
    if (geteuid() == 0) argv.push_back("--allow-run-as-root");
    for (const std::string& name : variables) argv.insert(argv.end(), {"-x", name});
    argv.insert(argv.end(), command.begin(), command.end());
    return argv;
  };
  request_.processes = 2;
  request_.environment[channel::kSeedVariable] = "123";
  const RunResult result = run_in_mode("normal");
  EXPECT_EQ(result.status, RunStatus::kFinished) << result.summary() << result.output_tail;
  ASSERT_EQ(result.ranks.size(), 2u);
  EXPECT_EQ(result.ranks[1].finished.at("FakeChecks.NotesWhatItMeasured").notes.front(),
            "saw DPLAB_GRADE_SEED=123");
  EXPECT_EQ(result.tests.at("FakeChecks.Passes").state, TestState::kPassed);
  EXPECT_NE(result.tests.at("FakeChecks.FailsOnRankOne").failure.find("[rank 1] "),
            std::string::npos);
}
#endif

TEST_F(RunnerTest, ARankThatNeverReportsFailsEveryCheck) {
  // A launcher that starts only rank 0 of two.
  request_.launcher = [](const std::vector<std::string>& command, int, const auto&) {
    return command;
  };
  request_.processes = 2;
  const RunResult result = run_in_mode("normal");
  EXPECT_EQ(result.status, RunStatus::kIncomplete);
  const TestOutcome& passes = result.tests.at("FakeChecks.Passes");
  EXPECT_EQ(passes.state, TestState::kFailed);
  EXPECT_EQ(passes.failure,
            "[rank 1] did not report a result: the check program exited (code 1) before running "
            "it (it sent no result at all)");
}

TEST_F(RunnerTest, BadRequestsThrow) {
  request_.processes = 2;
  EXPECT_THROW(run_check_program(request_), Error);  // no launcher
  request_.processes = 0;
  EXPECT_THROW(run_check_program(request_), Error);
}

TEST(MergeReports, AFailureOnAnyRankFailsTheTest) {
  RunResult run;
  run.ranks.resize(2);
  run.ranks[0].finished["A.Same"] = {"A.Same", TestState::kPassed, "", {"rank 0 saw 1"}, 0.1};
  run.ranks[0].finished["A.Differs"] = {"A.Differs", TestState::kPassed, "", {}, 0.2};
  run.ranks[1].finished["A.Same"] = {"A.Same", TestState::kPassed, "", {"rank 1 saw 1"}, 0.3};
  run.ranks[1].finished["A.Differs"] = {"A.Differs", TestState::kFailed, "x.cpp:3\nbad", {}, 0.1};
  const auto merged = merge_reports(run);
  EXPECT_EQ(merged.at("A.Same").state, TestState::kPassed);
  EXPECT_DOUBLE_EQ(merged.at("A.Same").seconds, 0.3);
  EXPECT_EQ(merged.at("A.Same").notes, std::vector<std::string>{"rank 0 saw 1"});
  EXPECT_EQ(merged.at("A.Differs").state, TestState::kFailed);
  EXPECT_EQ(merged.at("A.Differs").failure, "[rank 1] x.cpp:3\nbad");
}

TEST(LastLines, KeepsTheEnd) {
  EXPECT_EQ(last_lines("a\nb\nc\nd\n", 2), "c\nd");
  EXPECT_EQ(last_lines("a\nb", 5), "a\nb");
  EXPECT_EQ(last_lines("", 3), "");
  EXPECT_EQ(last_lines("abcdef", 3, 2), "ef");
}

}  // namespace
}  // namespace dp::grader
