// report.h: scores a lab's run against its rubric and writes the results three ways: the
// score table students read, Gradescope's results.json, and JUnit XML for CI viewers.
//
// Scoring is all or nothing per check: a check earns its points when its test reported a
// pass on every rank. A test the program does not have, a skipped test, and a test whose
// result never arrived (the program crashed, hung or exited first, or is missing) earn
// nothing, and the feedback says why. A passed check shows what it measured (its notes):
// that is where a lab's lesson becomes visible.
//
// Example:
//
//   GradeReport report;
//   report.seed = 42;
//   report.labs.push_back(score_lab(load_rubric(rubric_file), run_check_program(request)));
//   fmt::print("{}", format_table(report));
//   write_text_file("results.json", to_gradescope_json(report));
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "rubric.h"
#include "runner.h"

namespace dp::grader {

/// One graded check after the run.
struct CheckResult {
  RubricCheck check;      ///< what the rubric says about it
  bool passed = false;    ///< its test passed (on every rank)
  bool reported = false;  ///< its result arrived (else the program died, hung or lacks it)
  double earned = 0;      ///< check.points if passed, else 0
  std::string feedback;   ///< why it failed: expected vs seen, or what went wrong; "" if passed
  std::vector<std::string> notes;  ///< what it measured (rank 0's notes)
  double seconds = 0;              ///< the test's run time
};

/// One lab after the run.
struct LabResult {
  Rubric rubric;                    ///< the lab's rubric
  std::vector<CheckResult> checks;  ///< in rubric order
  std::string problem;  ///< why the program gave no results (crash, hang, missing); "" if it did
  std::string output_tail;           ///< the end of the program's output when there is a problem
  std::vector<std::string> notices;  ///< about the run itself (`RunResult::notices`)
  std::string sanitizer_report;      ///< ThreadSanitizer's first report; then every check failed
  double seconds = 0;                ///< wall time of the lab's run

  double earned() const;    ///< points earned
  double possible() const;  ///< points possible
};

/// Every lab graded in one `dplab grade`.
struct GradeReport {
  std::string implementation;     ///< whose code, e.g. "your code (labs/)"
  std::string backend = "local";  ///< the backend the checks ran on
  /// Where the lab code's tensors were, when not only on the host ("on the host and on the
  /// emulated CUDA device", "on the device cuda"); "" for the host alone.
  std::string devices;
  std::optional<std::uint64_t> seed;  ///< the grading seed the checks drew from, if known
  std::vector<LabResult> labs;        ///< in lab order
  double seconds = 0;                 ///< wall time of the whole grading

  double earned() const;    ///< points earned over all labs
  double possible() const;  ///< points possible over all labs
  bool full_marks() const;  ///< every graded check passed
};

/// Scores `run` against `rubric`. A ThreadSanitizer report in the run fails every check.
LabResult score_lab(const Rubric& rubric, const RunResult& run);

/// The checks `run`'s program registered (rank 0's list) that `rubric` does not list,
/// gtest's DISABLED_ tests aside. Empty when the program sent no list.
std::vector<std::string> checks_the_rubric_leaves_out(const Rubric& rubric, const RunResult& run);

/// Fails every check of `lab` (scored from `run` by `score_lab`) and says why in its problem
/// and each check's feedback when its rubric leaves out checks the program registers: a
/// check left out would be graded by nobody (a rubric of 1 of lab 1's 7 checks scored full
/// marks). `dplab grade` calls it on every run of the whole rubric.
void refuse_an_incomplete_rubric(LabResult& lab, const RunResult& run);

/// One lab graded in several runs of its check program, e.g. {"on the host", ...} and
/// {"on the emulated CUDA device ...", ...}: a check earns its points only when it passed in
/// every run; a failed check's feedback says in which run it failed ("on the emulated CUDA
/// device ...: <feedback>"); the notes are the first run's, the problems and notices every
/// run's, each named, and the time is the runs' sum. One run comes back as it is.
LabResult combine_runs(const std::vector<std::pair<std::string, LabResult>>& runs);

/// The line that names the seed: "grading seed S (repeat this run with --seed S)".
std::string seed_line(std::uint64_t seed);

/// The score table: the seed, then per lab each check's points earned/possible, under a
/// passed check what it measured, under a failed one the first `feedback_lines` lines of
/// its feedback, lab totals and the overall total.
std::string format_table(const GradeReport& report, int feedback_lines = 6);

/// The report as Gradescope's results.json (score, max_score, execution_time, output,
/// visibility, tests[] with name, number, score, max_score, status, output, visibility,
/// tags), per https://gradescope-autograders.readthedocs.io/en/latest/specs/. The top-level
/// output names the seed and each lab's draws; a test's output has its notes.
std::string to_gradescope_json(const GradeReport& report);

/// The report as JUnit XML: a <testsuite> per lab (tests, failures, errors, time, the
/// seed as property "grading_seed") with a <testcase> per check; a check that reported a
/// failure has <failure>, one that did not report has <error>, and the notes go to
/// <system-out>.
std::string to_junit_xml(const GradeReport& report);

/// `text` with the five XML special characters escaped, and control characters that XML
/// 1.0 forbids and bytes that are not UTF-8 replaced by '?' (check output may contain
/// anything).
std::string xml_escape(std::string_view text);

/// Writes `text` to `file` as dp/output_file.h describes (a whole file or none; only a
/// regular file is replaced); throws `dp::Error` naming the file when it cannot.
void write_text_file(const std::filesystem::path& file, const std::string& text);

}  // namespace dp::grader
