// report.cpp: scoring, the score table, results.json and JUnit XML.
#include "report.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "dp/error.h"
#include "dp/output_file.h"

namespace dp::grader {
namespace {

using nlohmann::json;

/// Points as people write them: "10", "2.5".
std::string points(double value) {
  return fmt::format("{:g}", value);
}

std::vector<std::string> split_lines(std::string_view text) {
  std::vector<std::string> lines;
  std::istringstream in{std::string(text)};
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

/// True for gtest's location line: "path/checks.cpp:123", "... : Failure", "unknown file".
bool is_location_line(const std::string& line) {
  static const std::regex location(R"(^(\S+\.(cpp|cc|h|hpp):[0-9]+(: Failure)?|unknown file)$)");
  return std::regex_match(line, location);
}

/// A failure message without gtest's location lines: the student wants what was
/// expected and what was seen, not where in checks.cpp the assertion sits.
std::string without_locations(std::string_view failure) {
  std::vector<std::string> kept;
  std::string rank_prefix;  // "[rank 1] " of a dropped location line, for the next line
  for (std::string& line : split_lines(failure)) {
    // Merged reports prefix other ranks' failures: "[rank 1] path/checks.cpp:12".
    if (line.starts_with("[rank ")) {
      const std::size_t end = line.find("] ");
      if (end != std::string::npos && is_location_line(line.substr(end + 2))) {
        rank_prefix = line.substr(0, end + 2);
        continue;
      }
    }
    // "Failed" is how gtest opens an ADD_FAILURE/FAIL message: it says nothing more.
    if (is_location_line(line) || line == "Failed") continue;
    kept.push_back(rank_prefix + line);
    rank_prefix.clear();
  }
  return fmt::format("{}", fmt::join(kept, "\n"));
}

/// What a failed check's own report says: its feedback and, when its result never arrived
/// because the program died or hung, the end of the program's output.
std::string full_feedback(const LabResult& lab, const CheckResult& check) {
  std::string text = check.feedback;
  if (!check.reported && !lab.problem.empty() && !lab.output_tail.empty())
    text += "\n\nlast output of the check program:\n" + lab.output_tail;
  return text;
}

/// The notes of a check as lines "measured: ...".
std::string notes_text(const CheckResult& check) {
  std::vector<std::string> lines;
  for (const std::string& note : check.notes) lines.push_back("measured: " + note);
  return fmt::format("{}", fmt::join(lines, "\n"));
}

std::string check_status_word(const CheckResult& check) {
  return check.passed ? "passed" : "failed";
}

}  // namespace

double LabResult::earned() const {
  double total = 0;
  for (const CheckResult& check : checks) total += check.earned;
  return total;
}

double LabResult::possible() const {
  return rubric.max_points();
}

double GradeReport::earned() const {
  double total = 0;
  for (const LabResult& lab : labs) total += lab.earned();
  return total;
}

double GradeReport::possible() const {
  double total = 0;
  for (const LabResult& lab : labs) total += lab.possible();
  return total;
}

bool GradeReport::full_marks() const {
  for (const LabResult& lab : labs)
    for (const CheckResult& check : lab.checks)
      if (!check.passed) return false;
  return true;
}

LabResult score_lab(const Rubric& rubric, const RunResult& run) {
  LabResult lab;
  lab.rubric = rubric;
  lab.seconds = run.seconds;
  lab.notices = run.notices();
  if (run.status != RunStatus::kFinished) {
    lab.problem = run.summary();
    lab.output_tail = run.output_tail;
  } else if (!run.rerun_note.empty()) {
    lab.problem = run.rerun_note;
    lab.output_tail = run.output_tail;
  }
  const bool never_ran = run.status == RunStatus::kMissing ||
                         run.status == RunStatus::kFailedToStart ||
                         run.status == RunStatus::kRefused;
  lab.sanitizer_report = run.sanitizer_report;
  for (const RubricCheck& check : rubric.checks) {
    CheckResult result;
    result.check = check;
    if (run.status == RunStatus::kRefused) {
      // The lab's report lists every finding; each check says why it did not run.
      const std::vector<std::string> lines = split_lines(lab.problem);
      std::string first = lines.size() > 1 ? lines[1] : "";
      first.erase(0, first.find_first_not_of(' '));
      result.feedback = fmt::format(
          "not run: the lab audit refused the lab's code, so none of it ran (the lab's report "
          "lists what){}",
          first.empty() ? "" : ":\n" + first);
    } else if (never_ran) {
      result.feedback = "not run: " + lab.problem;
    } else if (const auto it = run.tests.find(check.test); it == run.tests.end()) {
      // Only what arrived on the driver's channel counts: no result, no points.
      result.feedback = run.missing_result(check.test);
    } else {
      const TestOutcome& outcome = it->second;
      result.reported = true;
      result.seconds = outcome.seconds;
      result.notes = outcome.notes;
      switch (outcome.state) {
        case TestState::kPassed: result.passed = true; break;
        case TestState::kFailed: result.feedback = without_locations(outcome.failure); break;
        case TestState::kSkipped:
          result.feedback = "skipped: a skipped check checks nothing and earns nothing";
          if (!outcome.failure.empty())
            result.feedback += "\n" + without_locations(outcome.failure);
          break;
      }
      if (outcome.state == TestState::kFailed && result.feedback.empty())
        result.feedback = "failed (no message)";
    }
    if (const std::string contradiction = run.contradiction(); !contradiction.empty()) {
      // Results that arrived in order, from a run that did not end as a run that sent them
      // ends: forged, or the program broke after reporting; none of them counts.
      result.passed = false;
      result.feedback = fmt::format("{}: no result of this run counts", contradiction);
    }
    if (const std::string forged = run.out_of_order(); !forged.empty()) {
      // Someone besides the check program's reporter wrote to the channel with the token:
      // no result of this run can be told from a forged one.
      result.passed = false;
      result.feedback = fmt::format(
          "the results channel carried {}: something other than the check program's "
          "reporter wrote to it, so no result of this run counts",
          forged);
    }
    if (!run.sanitizer_report.empty()) {
      // A data race makes every result of the run suspect, passes included.
      result.passed = false;
      result.feedback = fmt::format(
          "ThreadSanitizer reported {} threading error(s) while the lab's checks ran, a data "
          "race for instance: the lab fails whatever its checks said. The first report:\n{}{}",
          run.sanitizer_reports, run.sanitizer_report,
          result.feedback.empty() ? "" : "\n\nThe check itself said:\n" + result.feedback);
    }
    result.earned = result.passed ? check.points : 0;
    lab.checks.push_back(std::move(result));
  }
  return lab;
}

std::vector<std::string> checks_the_rubric_leaves_out(const Rubric& rubric, const RunResult& run) {
  std::vector<std::string> unlisted;
  if (run.ranks.empty()) return unlisted;
  for (const auto& [test, runs] : run.ranks.front().registered) {
    // DISABLED_ is gtest's way of keeping a test out of every run: it needs no entry.
    const bool disabled =
        test.starts_with("DISABLED_") || test.find(".DISABLED_") != std::string::npos;
    const bool listed =
        std::any_of(rubric.checks.begin(), rubric.checks.end(),
                    [&test = test](const RubricCheck& check) { return check.test == test; });
    if (!disabled && !listed) unlisted.push_back(test);
  }
  return unlisted;
}

void refuse_an_incomplete_rubric(LabResult& lab, const RunResult& run) {
  const std::vector<std::string> unlisted = checks_the_rubric_leaves_out(lab.rubric, run);
  if (unlisted.empty()) return;
  const std::string mismatch = fmt::format(
      "the rubric does not match the check program: the program registers {} check(s) the "
      "rubric does not list ({}); a rubric must list every check of its program",
      unlisted.size(), fmt::join(unlisted, ", "));
  lab.problem = lab.problem.empty() ? mismatch : mismatch + "\n" + lab.problem;
  for (CheckResult& check : lab.checks) {
    check.passed = false;
    check.earned = 0;
    check.feedback = mismatch + ", so no result of this run counts";
  }
}

LabResult combine_runs(const std::vector<std::pair<std::string, LabResult>>& runs) {
  if (runs.empty()) throw Error("combine_runs: no run to combine");
  if (runs.size() == 1) return runs.front().second;
  LabResult lab = runs.front().second;
  lab.problem.clear();
  lab.notices.clear();
  lab.seconds = 0;
  for (const auto& [name, run] : runs) {
    if (!run.problem.empty()) {
      lab.problem += fmt::format("{}{}: {}", lab.problem.empty() ? "" : "; ", name, run.problem);
      if (lab.output_tail.empty()) lab.output_tail = run.output_tail;
    }
    for (const std::string& notice : run.notices)
      lab.notices.push_back(fmt::format("{}: {}", name, notice));
    if (lab.sanitizer_report.empty()) lab.sanitizer_report = run.sanitizer_report;
    lab.seconds += run.seconds;
  }
  for (std::size_t i = 0; i < lab.checks.size(); ++i) {
    CheckResult& check = lab.checks[i];
    std::vector<std::string> failures;
    check.passed = true;
    check.reported = true;
    check.seconds = 0;
    for (const auto& [name, run] : runs) {
      const CheckResult& in_run = run.checks.at(i);
      check.passed = check.passed && in_run.passed;
      check.reported = check.reported && in_run.reported;
      check.seconds += in_run.seconds;
      if (!in_run.passed) failures.push_back(fmt::format("{}: {}", name, in_run.feedback));
    }
    check.feedback = fmt::format("{}", fmt::join(failures, "\n"));
    check.earned = check.passed ? check.check.points : 0;
  }
  return lab;
}

std::string seed_line(std::uint64_t seed) {
  return fmt::format("grading seed {0} (repeat this run with --seed {0})", seed);
}

std::string format_table(const GradeReport& report, int feedback_lines) {
  std::string out;
  if (report.seed) out += seed_line(*report.seed) + "\n";
  out += fmt::format("dplab grade: {}, {} backend{}\n", report.implementation, report.backend,
                     report.devices.empty() ? "" : ", " + report.devices);
  for (const LabResult& lab : report.labs) {
    out += fmt::format("\nlab {}: {}\n", lab.rubric.lab, lab.rubric.title);
    if (!lab.problem.empty()) {
      out += fmt::format("  lab {}: {}", lab.rubric.lab, lab.problem);
      if (!lab.output_tail.empty()) {
        out += " — last output:\n";
        for (const std::string& line : split_lines(last_lines(lab.output_tail, 12)))
          out += "    | " + line + "\n";
      } else {
        out += "\n";
      }
    }
    for (const std::string& notice : lab.notices) out += fmt::format("  note: {}\n", notice);
    if (!lab.sanitizer_report.empty()) {
      out +=
          fmt::format("  lab {}: ThreadSanitizer reported a threading error; every check fails:\n",
                      lab.rubric.lab);
      const std::vector<std::string> lines = split_lines(lab.sanitizer_report);
      constexpr std::size_t kShown = 24;  // the two stacks' top frames say where to look
      for (std::size_t i = 0; i < lines.size() && i < kShown; ++i)
        out += "    | " + lines[i] + "\n";
      if (lines.size() > kShown)
        out += fmt::format("    | ... ({} more lines in --json/--junit output)\n",
                           lines.size() - kShown);
    }
    // Width of the points column: "10/10" aligned for every check of the lab.
    std::size_t width = 0;
    for (const CheckResult& check : lab.checks)
      width = std::max(width, (points(check.earned) + "/" + points(check.check.points)).size());
    for (const CheckResult& check : lab.checks) {
      const std::string score = points(check.earned) + "/" + points(check.check.points);
      out += fmt::format("  {} {:>{}}  {}  ({})\n", check.passed ? "PASS" : "FAIL", score, width,
                         check.check.test, check.check.description);
      if (check.passed) {
        // What the check measured: on a pass, this is the lab's lesson made visible.
        for (const std::string& line : split_lines(notes_text(check)))
          out += fmt::format("  {:{}}       {}\n", "", width, line);
        continue;
      }
      if (!lab.sanitizer_report.empty()) continue;  // the report is shown once, above
      const std::vector<std::string> lines = split_lines(check.feedback);
      const int shown = std::min<int>(feedback_lines, static_cast<int>(lines.size()));
      for (int i = 0; i < shown; ++i) out += fmt::format("  {:{}}     > {}\n", "", width, lines[i]);
      if (static_cast<int>(lines.size()) > shown)
        out += fmt::format("  {:{}}     > ... ({} more lines in --json/--junit output)\n", "",
                           width, lines.size() - shown);
    }
    out += fmt::format("  lab {} total: {}/{} points\n", lab.rubric.lab, points(lab.earned()),
                       points(lab.possible()));
  }
  out += fmt::format("\ntotal: {}/{} points{}\n", points(report.earned()),
                     points(report.possible()), report.full_marks() ? " (full marks)" : "");
  return out;
}

std::string to_gradescope_json(const GradeReport& report) {
  json tests = json::array();
  std::string overall;
  if (report.seed) overall += seed_line(*report.seed) + "\n";
  for (const LabResult& lab : report.labs) {
    overall += fmt::format("lab {} ({}): {}/{} points\n", lab.rubric.lab, lab.rubric.title,
                           points(lab.earned()), points(lab.possible()));
    if (!lab.problem.empty()) {
      overall += fmt::format("  {}\n", lab.problem);
      if (!lab.output_tail.empty()) overall += "  last output:\n" + lab.output_tail + "\n";
    }
    for (const std::string& notice : lab.notices) overall += fmt::format("  note: {}\n", notice);
    if (!lab.sanitizer_report.empty())
      overall += "  ThreadSanitizer reported a threading error: every check fails\n";
    for (const std::string& draw : lab.rubric.draws) overall += fmt::format("  draws: {}\n", draw);
    for (std::size_t i = 0; i < lab.checks.size(); ++i) {
      const CheckResult& check = lab.checks[i];
      std::string output = check.check.description;
      if (!check.notes.empty()) output += "\n\n" + notes_text(check);
      if (!check.passed) output += "\n\n" + full_feedback(lab, check);
      tests.push_back({
          {"name", fmt::format("lab {}: {}", lab.rubric.lab, check.check.test)},
          {"number", fmt::format("{}.{}", lab.rubric.lab, i + 1)},
          {"score", check.earned},
          {"max_score", check.check.points},
          {"status", check_status_word(check)},
          {"output", output},
          {"visibility", std::string(to_string(check.check.visibility))},
          {"tags", json::array({fmt::format("lab{}", lab.rubric.lab)})},
      });
    }
  }
  json results = {
      {"score", report.earned()},
      {"max_score", report.possible()},
      {"execution_time", report.seconds},
      {"output", overall},
      {"visibility", "visible"},
      {"stdout_visibility", "hidden"},
      {"tests", tests},
  };
  // Check output may hold bytes that are not UTF-8 (a crashed program's last words).
  return results.dump(2, ' ', false, json::error_handler_t::replace) + "\n";
}

std::string xml_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    if (byte >= 0x80) {
      // Keep a well-formed UTF-8 sequence; a stray byte would make the whole file invalid.
      const std::size_t length = byte >= 0xF0 ? 4 : byte >= 0xE0 ? 3 : byte >= 0xC2 ? 2 : 0;
      bool valid = length > 0 && byte < 0xF5 && i + length <= text.size();
      for (std::size_t k = 1; valid && k < length; ++k)
        valid = (static_cast<unsigned char>(text[i + k]) & 0xC0) == 0x80;
      if (!valid) {
        out += '?';
        continue;
      }
      out.append(text.substr(i, length));
      i += length - 1;
      continue;
    }
    switch (byte) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      case '\t':
      case '\n':
      case '\r': out += static_cast<char>(byte); break;
      default:
        // XML 1.0 allows no other character below 0x20.
        out += byte < 0x20 ? '?' : static_cast<char>(byte);
    }
  }
  return out;
}

std::string to_junit_xml(const GradeReport& report) {
  int tests = 0, failures = 0, errors = 0;
  std::string suites;
  for (const LabResult& lab : report.labs) {
    int lab_failures = 0, lab_errors = 0;
    std::string cases;
    for (const CheckResult& check : lab.checks) {
      // gtest suite names never contain '.', so the first '.' splits suite from test.
      const std::size_t dot = check.check.test.find('.');
      const std::string suite = check.check.test.substr(0, dot);
      const std::string name =
          dot == std::string::npos ? check.check.test : check.check.test.substr(dot + 1);
      cases += fmt::format("    <testcase name=\"{}\" classname=\"lab{}.{}\" time=\"{:.3f}\"",
                           xml_escape(name), lab.rubric.lab, xml_escape(suite), check.seconds);
      if (check.passed && check.notes.empty()) {
        cases += "/>\n";
        continue;
      }
      cases += ">\n";
      if (!check.passed) {
        // A check that never reported is the program's error, not a failed assertion.
        const bool error = !check.reported;
        const std::string text = full_feedback(lab, check);
        const std::string message = split_lines(text).empty() ? "" : split_lines(text).front();
        cases += fmt::format("      <{0} message=\"{1}\" type=\"{2}\">{3}</{0}>\n",
                             error ? "error" : "failure", xml_escape(message),
                             error ? "CheckProgramError" : "CheckFailed", xml_escape(text));
        ++(error ? lab_errors : lab_failures);
      }
      if (!check.notes.empty())
        cases += fmt::format("      <system-out>{}</system-out>\n", xml_escape(notes_text(check)));
      cases += "    </testcase>\n";
    }
    const std::string properties =
        report.seed ? fmt::format(
                          "    <properties>\n      <property name=\"grading_seed\" "
                          "value=\"{}\"/>\n    </properties>\n",
                          *report.seed)
                    : "";
    suites += fmt::format(
        "  <testsuite name=\"lab{} {}\" tests=\"{}\" failures=\"{}\" errors=\"{}\" "
        "skipped=\"0\" time=\"{:.3f}\">\n{}{}  </testsuite>\n",
        lab.rubric.lab, xml_escape(lab.rubric.title), lab.checks.size(), lab_failures, lab_errors,
        lab.seconds, properties, cases);
    tests += static_cast<int>(lab.checks.size());
    failures += lab_failures;
    errors += lab_errors;
  }
  return fmt::format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<testsuites name=\"dplab grade\" tests=\"{}\" failures=\"{}\" errors=\"{}\" "
      "time=\"{:.3f}\">\n{}</testsuites>\n",
      tests, failures, errors, report.seconds, suites);
}

void write_text_file(const std::filesystem::path& file, const std::string& text) {
  write_file_atomically(file, text);
}

}  // namespace dp::grader
