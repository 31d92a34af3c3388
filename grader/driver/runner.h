// runner.h: runs a lab's check program in its own process and collects what it reports on
// the driver's own results channel.
//
// A check program is a GoogleTest executable (grade_lab1, grade_lab1_reference, ...) whose
// main() is grader/support/check_main.cpp. Student code runs inside it, so the runner
// trusts nothing the program prints or writes: before starting it, the runner makes a
// private directory with one FIFO per process and a fresh token (result_channel.h), and
// only lines that carry the token count. A rubric check whose result never arrived has
// failed, and the runner says why: the program crashed, exited or timed out while running
// it or before.
//
// The runner also bounds what the lab can do to the grader: stdout and stderr go through a
// pipe it reads, of which it keeps at most `kOutputCapBytes`; the time limit kills the
// program's process group; and after every run it kills every process the run left behind,
// a `setsid` or double-forked one too (the runner makes the calling process a child
// subreaper, so that such orphans become its children).
//
// Example:
//
//   dp::grader::RunRequest request;
//   request.program = "build/default/bin/grade_lab1";
//   request.environment["DPLAB_GRADE_SEED"] = "42";
//   const dp::grader::RunResult result = dp::grader::run_check_program(request);
//   if (result.status != dp::grader::RunStatus::kFinished) fmt::print("{}\n", result.summary());
//   for (const auto& [name, test] : result.tests) fmt::print("{}: {}\n", name, test.failure);
#pragma once

#include <chrono>
#include <cstddef>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace dp::grader {

/// The most of a run's stdout and stderr that the runner keeps: the first and the last half.
inline constexpr std::size_t kOutputCapBytes = 1024 * 1024;

/// How one GoogleTest test ended.
enum class TestState {
  kPassed,   ///< ran, no failed assertion
  kFailed,   ///< ran and failed (an assertion or an exception), or did not report on a rank
  kSkipped,  ///< GTEST_SKIP: it did not check anything, so it earns nothing
};

/// One test's result as the check program reported it.
struct TestOutcome {
  std::string name;  ///< full gtest name, "Suite.Name" ("Prefix/Suite.Name/param" too)
  TestState state = TestState::kFailed;  ///< how it ended
  std::string failure;             ///< the failure messages (gtest's "file:line\nmessage"), or ""
  std::vector<std::string> notes;  ///< what it measured (`dp::grading::note_measured`)
  double seconds = 0;              ///< the test's run time
};

/// What one process (rank) of a run said on the results channel.
struct RankReport {
  /// Every test of its program, and whether it was to run (not disabled or filtered out);
  /// empty when it never said.
  std::map<std::string, bool> registered;
  std::map<std::string, TestOutcome> finished;  ///< the tests it sent a result for
  std::string running;                          ///< the test it started and never finished, or ""
  bool program_ended = false;                   ///< it said that every test had run
  /// The first event out of the protocol's order (a second result for a test, a result
  /// without its start, anything after the end), or "": what a lab that forges results
  /// on the channel betrays itself by.
  std::string out_of_order;

  /// True when it sent anything at all.
  bool heard_from() const { return !registered.empty() || !finished.empty() || !running.empty(); }
};

/// Turns the check program's command line into the one to start `processes` processes of
/// it (e.g. `mpirun -n 4 ...`), which must pass on to each of them the environment variables
/// named in `variables` (the runner sets them in the launcher's own environment).
using Launcher =
    std::function<std::vector<std::string>(const std::vector<std::string>& command, int processes,
                                           const std::vector<std::string>& variables)>;

/// What to run, how, and for how long.
struct RunRequest {
  std::filesystem::path program;       ///< the check executable
  std::vector<std::string> arguments;  ///< more arguments for it (e.g. --gtest_filter=...)
  std::string backend = "local";       ///< DPLAB_TEST_BACKEND for the program: local or mpi
  /// More environment variables for the program, e.g. {"DPLAB_GRADE_SEED", "42"}.
  std::map<std::string, std::string> environment;
  int processes = 1;  ///< processes the launcher starts, each with its own channel (rank)
  Launcher launcher;  ///< empty: run the program directly (processes must be 1)
  std::chrono::milliseconds time_limit{std::chrono::seconds(300)};  ///< then it is killed
};

/// How a run ended.
enum class RunStatus {
  kFinished,       ///< every process said that its tests had run
  kMissing,        ///< the check program does not exist (not built)
  kFailedToStart,  ///< it could not be started (e.g. mpirun is not installed)
  kRefused,        ///< the lab audit refused the lab's code, so it was not started
  kCrashed,        ///< killed by a signal
  kTimedOut,       ///< still running at the time limit: it was killed
  kIncomplete,     ///< it exited before every process said that its tests had run
};

/// What a run produced.
struct RunResult {
  RunStatus status = RunStatus::kIncomplete;  ///< how it ended
  int exit_code = -1;                         ///< the exit status when it exited, else -1
  int signal = 0;                             ///< the signal that killed it, else 0
  double seconds = 0;                         ///< wall time of the run
  double time_limit_seconds = 0;              ///< the limit it ran under
  std::string program;                        ///< the check program, for messages
  /// Why it did not start (kMissing, kFailedToStart), or what the lab audit refused (kRefused).
  std::string start_error;
  /// Its stdout and stderr: at most `kOutputCapBytes`, the middle left out with a note.
  std::string output;
  std::string output_tail;                   ///< the last lines of `output`
  std::vector<RankReport> ranks;             ///< what each process reported, by rank
  std::map<std::string, TestOutcome> tests;  ///< the merged results (`merge_reports`)
  std::size_t lines_without_token = 0;       ///< channel lines ignored: not this run's token
  std::size_t malformed_lines = 0;           ///< channel lines ignored: token, but not an event
  std::size_t ignored_result_bytes = 0;      ///< channel bytes ignored beyond the 1 MiB cap
  std::vector<int> surviving_processes;      ///< pids the runner could not kill (expected empty)
  /// Set by `run_checks` when the run broke and each check ran again on its own: what broke
  /// and what was done ("check program crashed (signal 11) while running Suite.Name: no
  /// result of that run counts; every other check ran again in a process of its own").
  std::string rerun_note;
  /// The first ThreadSanitizer report in `output` (a program built with -fsanitize=thread),
  /// or "": a lab with one fails every check.
  std::string sanitizer_report;
  std::size_t sanitizer_reports = 0;  ///< how many ThreadSanitizer reports `output` holds

  /// One line for the score table: "check program crashed (signal 11: Segmentation
  /// fault)", "timed out after 300 s", ...; "" for kFinished.
  std::string summary() const;

  /// Why `test` has no result (on rank `rank`): "did not report a result: the check
  /// program crashed (signal 11: Segmentation fault) while running it", "... exited (code 0)
  /// before running it", "... timed out while running Suite.Other, before this check", or
  /// that the program has no such test or did not run it.
  std::string missing_result(const std::string& test, int rank) const;

  /// Why `test` has no result on any rank: `missing_result` of rank 0, or of every rank
  /// ("[rank r] ..." for r > 0) when they differ.
  std::string missing_result(const std::string& test) const;

  /// Sentences about the run itself for the reports: lines the channel ignored, processes
  /// that outlived the run. Empty when there is nothing to say.
  std::vector<std::string> notices() const;

  /// The first out-of-order event any rank's channel carried ("a second result for
  /// Suite.Name", prefixed "[rank r] " for r > 0), or "" when every rank kept the protocol.
  std::string out_of_order() const;

  /// Why the run's results cannot be trusted although they arrived in order, or "": every
  /// process said that its tests had run and then the run crashed, hung or was killed, or it
  /// exited with a status that disagrees with what it reported (GoogleTest exits 0 exactly
  /// when no test failed). Code that forges results on the channel must then also end the
  /// process as a passing run ends, which it cannot do by calling exit (the lab audit refuses
  /// it) or abort.
  std::string contradiction() const;
};

/// Runs the check program as `request` says and returns what happened. Never throws for
/// anything the program does (crash, hang, garbage on the channel, endless output); throws
/// `dp::Error` for a bad request (processes < 1, several processes without a launcher) or
/// when the channel cannot be made. Kills every descendant of the calling process that
/// the run started, and makes the calling process a child subreaper for good.
RunResult run_check_program(const RunRequest& request);

/// Runs the check program as `request` says, and counts its results only if it ended as a
/// run that sent them ends: every process said that its tests had run, and it exited with a
/// status that agrees with them. Otherwise (it crashed, hung or exited early) no result of
/// that run counts, since results that arrived in order could still have been forged by
/// the code that broke it, and every check of `checks` but the one that was running is run
/// again in a process of its own (`--gtest_filter`), each counted under the same rule: a
/// crash or a hang then costs the check that causes it and nothing else. The check that was
/// running fails with the first run's reason. `RunResult::rerun_note` says what happened.
/// A run whose channel carried events out of order, or that contradicted its results, is
/// returned as it is: nothing of it counts (`score_lab`).
RunResult run_checks(const RunRequest& request, const std::vector<std::string>& checks);

/// Merges `run.ranks`: a test that some rank finished passed when every rank reported it
/// passed; it failed when any rank reported a failure or did not report it at all (that
/// rank's `missing_result`), with the failures of ranks other than 0 prefixed "[rank r] ";
/// otherwise it is skipped if any rank skipped it. The notes are rank 0's.
std::map<std::string, TestOutcome> merge_reports(const RunResult& run);

/// The last `max_lines` lines of `text` (and at most `max_chars` characters of them).
std::string last_lines(std::string_view text, int max_lines, std::size_t max_chars = 4000);

}  // namespace dp::grader
