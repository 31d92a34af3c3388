// runner.h: runs a lab's check program in its own process and reads what it reports.
//
// A check program is a GoogleTest executable (grade_lab1, grade_lab1_reference, ...). The
// runner starts it with `--gtest_output=json:<file>` and the backend in the environment
// variable DPLAB_TEST_BACKEND, captures its stdout and stderr in a file, and kills its
// whole process group when the time limit passes. So a crash, a hang or a missing
// program ends that lab's run, never the grader: the result says which happened.
//
// Under mpi every process writes its own report (see `RunRequest::launcher`); the runner
// merges them, and a test fails when it failed on any rank.
//
// Example:
//
//   dp::grader::RunRequest request;
//   request.program = "build/default/bin/grade_lab1";
//   request.work_dir = "/tmp/dplab-grade";
//   const dp::grader::RunResult result = dp::grader::run_check_program(request);
//   if (result.status != dp::grader::RunStatus::kFinished) fmt::print("{}\n", result.summary());
#pragma once

#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace dp::grader {

/// How one GoogleTest test ended.
enum class TestState {
  kPassed,   ///< ran, no failed assertion
  kFailed,   ///< ran, at least one failed assertion (or an exception)
  kSkipped,  ///< GTEST_SKIP: it did not check anything, so it earns nothing
  kNotRun,   ///< disabled or filtered out
};

/// One test of a check program's report.
struct TestOutcome {
  std::string name;  ///< full gtest name, "Suite.Name" ("Prefix/Suite.Name/param" too)
  TestState state = TestState::kNotRun;  ///< how it ended
  std::string failure;  ///< the failure messages (gtest's "file:line\nmessage"), or ""
  double seconds = 0;   ///< the test's run time
};

/// Parses one GoogleTest JSON report (the file --gtest_output=json writes). `source`
/// names it in error messages; throws `dp::Error` when it is not such a report.
std::vector<TestOutcome> parse_gtest_report(std::string_view json_text, const std::string& source);

/// Merges the reports of several processes of one run (keyed by rank; a rank may be
/// missing when its main() writes no report): a test that failed on any process failed,
/// with the failures of ranks other than 0 prefixed "[rank r] ", and a test counts as
/// passed only when every report that lists it says so.
std::map<std::string, TestOutcome> merge_reports(
    const std::map<int, std::vector<TestOutcome>>& reports_by_rank);

/// Turns per-process command lines into the one command line to start (e.g. an mpirun
/// MPMD job that gives rank r `per_rank[r]`).
using Launcher =
    std::function<std::vector<std::string>(const std::vector<std::vector<std::string>>& per_rank)>;

/// What to run, how, and for how long.
struct RunRequest {
  std::filesystem::path program;       ///< the check executable
  std::vector<std::string> arguments;  ///< more arguments for it (e.g. --gtest_filter=...)
  std::string backend = "local";       ///< DPLAB_TEST_BACKEND for the program: local or mpi
  int processes = 1;                   ///< processes the launcher starts, each with its own report
  Launcher launcher;                   ///< empty: run the program directly (processes must be 1)
  std::chrono::milliseconds time_limit{std::chrono::seconds(300)};  ///< then it is killed
  std::filesystem::path work_dir;  ///< where reports and the output file go (must exist)
  std::string name = "check";      ///< file name stem in work_dir, e.g. "lab1"
};

/// How a run ended.
enum class RunStatus {
  kFinished,       ///< rank 0's report was written and read: its tests count
  kMissing,        ///< the check program does not exist (not built)
  kFailedToStart,  ///< it could not be started (e.g. mpirun is not installed)
  kCrashed,        ///< killed by a signal before writing its report
  kTimedOut,       ///< still running at the time limit: its process group was killed
  kNoReport,       ///< exited without writing a report (e.g. a rank aborted the MPI job)
};

/// What a run produced.
struct RunResult {
  RunStatus status = RunStatus::kNoReport;   ///< how it ended
  int exit_code = -1;                        ///< the exit status when it exited, else -1
  int signal = 0;                            ///< the signal that killed it, else 0
  double seconds = 0;                        ///< wall time of the run
  double time_limit_seconds = 0;             ///< the limit it ran under
  std::string program;                       ///< the check program, for messages
  std::string start_error;                   ///< why it did not start (kMissing, kFailedToStart)
  std::string output_tail;                   ///< the last lines of its stdout and stderr
  std::map<std::string, TestOutcome> tests;  ///< merged reports (kFinished only)

  /// One line for the score table: "check program crashed (signal 11: Segmentation
  /// fault)", "timed out after 300 s", ...; "" for kFinished.
  std::string summary() const;
};

/// Runs the check program as `request` says and returns what happened. Never throws for
/// anything the program does (crash, hang, garbage report); throws `dp::Error` only for
/// a bad request (no work_dir, processes < 1, several processes without a launcher).
RunResult run_check_program(const RunRequest& request);

/// The last `max_lines` lines of `text` (and at most `max_chars` characters of them).
std::string last_lines(std::string_view text, int max_lines, std::size_t max_chars = 4000);

}  // namespace dp::grader
