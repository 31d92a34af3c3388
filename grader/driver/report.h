// report.h: scores a lab's run against its rubric and writes the results three ways: the
// score table students read, Gradescope's results.json, and JUnit XML for CI viewers.
//
// Scoring is all or nothing per check: a check earns its points when its test passed on
// every rank. A test the program does not have, a skipped test, or a lab whose program
// crashed, hung or is missing earns nothing, and the feedback says why.
//
// Example:
//
//   GradeReport report;
//   report.labs.push_back(score_lab(load_rubric(rubric_file), run_check_program(request)));
//   fmt::print("{}", format_table(report));
//   write_file("results.json", to_gradescope_json(report));
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "rubric.h"
#include "runner.h"

namespace dp::grader {

/// One graded check after the run.
struct CheckResult {
  RubricCheck check;     ///< what the rubric says about it
  bool passed = false;   ///< its test passed (on every rank)
  double earned = 0;     ///< check.points if passed, else 0
  std::string feedback;  ///< why it failed: expected vs seen, or what went wrong; "" if passed
  double seconds = 0;    ///< the test's run time
};

/// One lab after the run.
struct LabResult {
  Rubric rubric;                    ///< the lab's rubric
  std::vector<CheckResult> checks;  ///< in rubric order
  std::string problem;  ///< why the program gave no results (crash, hang, missing); "" if it did
  std::string output_tail;  ///< the end of the program's output when there is a problem
  double seconds = 0;       ///< wall time of the lab's run

  double earned() const;    ///< points earned
  double possible() const;  ///< points possible
};

/// Every lab graded in one `dplab grade`.
struct GradeReport {
  std::string implementation;     ///< whose code, e.g. "your code (labs/)"
  std::string backend = "local";  ///< the backend the checks ran on
  std::vector<LabResult> labs;    ///< in lab order
  double seconds = 0;             ///< wall time of the whole grading

  double earned() const;    ///< points earned over all labs
  double possible() const;  ///< points possible over all labs
  bool full_marks() const;  ///< every graded check passed
};

/// Scores `run` against `rubric`.
LabResult score_lab(const Rubric& rubric, const RunResult& run);

/// The score table: per lab each check's points earned/possible, the first
/// `feedback_lines` lines of each failure's feedback, lab totals and the overall total.
std::string format_table(const GradeReport& report, int feedback_lines = 6);

/// The report as Gradescope's results.json (score, max_score, execution_time, output,
/// visibility, tests[] with name, number, score, max_score, status, output, visibility,
/// tags), per https://gradescope-autograders.readthedocs.io/en/latest/specs/.
std::string to_gradescope_json(const GradeReport& report);

/// The report as JUnit XML: a <testsuite> per lab (tests, failures, errors, time) with a
/// <testcase> per check; a failed check has <failure>, a lab that gave no results gives
/// each of its checks an <error>.
std::string to_junit_xml(const GradeReport& report);

/// `text` with the five XML special characters escaped, and control characters that XML
/// 1.0 forbids and bytes that are not UTF-8 replaced by '?' (check output may contain
/// anything).
std::string xml_escape(std::string_view text);

/// Writes `text` to `file` as dp/output_file.h describes (a whole file or none; only a
/// regular file is replaced); throws `dp::Error` naming the file when it cannot.
void write_text_file(const std::filesystem::path& file, const std::string& text);

}  // namespace dp::grader
