// Tests of scoring and of the three report formats: the table shows points and
// feedback, results.json parses back with Gradescope's fields, and the JUnit XML is
// well-formed (checked by Python's XML parser, as a CI viewer would read it).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "report.h"

namespace dp::grader {
namespace {

Rubric two_check_rubric() {
  Rubric rubric;
  rubric.lab = 1;
  rubric.title = "Replicated <training> & co";
  rubric.checks = {{"Lab1.Good", 10, Visibility::kVisible, "passes"},
                   {"WorldSizes/Lab1.Bad/ranks3", 5, Visibility::kHidden, "fails"},
                   {"Lab1.Missing", 2, Visibility::kAfterPublished, "not in the program"}};
  return rubric;
}

RunResult finished_run() {
  RunResult run;
  run.status = RunStatus::kFinished;
  run.exit_code = 1;  // GoogleTest's, with a failed test
  run.program = "bin/grade_lab1";
  run.tests["Lab1.Good"] = {
      "Lab1.Good", TestState::kPassed, "", {"replicas differ by 3.1e-02"}, 0.25};
  run.tests["WorldSizes/Lab1.Bad/ranks3"] = {
      "WorldSizes/Lab1.Bad/ranks3",
      TestState::kFailed,
      "/src/grader/lab1/checks.cpp:42\nrank 2 weights differ: expected <= 2e-6, saw 4.1e-2\n"
      "unknown file\nC++ exception \"<oops>\" & \x01 thrown",
      {},
      0.5};
  run.tests["Lab1.Ungraded"] = {"Lab1.Ungraded", TestState::kFailed, "x", {}, 0};
  // The program's own list of its tests: Lab1.Missing is not among them.
  run.ranks.resize(1);
  run.ranks[0].program_ended = true;
  for (const auto& [name, outcome] : run.tests) run.ranks[0].registered[name] = true;
  return run;
}

GradeReport report_of(const LabResult& lab) {
  GradeReport report;
  report.implementation = "your code (labs/)";
  report.labs.push_back(lab);
  report.seconds = 1.5;
  return report;
}

TEST(Score, ARubricThatLeavesOutAProgramsCheckIsRefused) {
  // Issue 32: a rubric listing 1 of lab 1's 7 checks scored "10/10 (full marks)".
  Rubric rubric;
  rubric.lab = 1;
  rubric.title = "one of three";
  rubric.checks = {{"Lab1.Good", 10, Visibility::kVisible, "passes"}};
  RunResult run = finished_run();
  run.ranks[0].registered["DISABLED_Lab1.Later"] = false;  // gtest keeps it out: no entry
  run.ranks[0].registered["Lab1.DISABLED_Later"] = false;
  EXPECT_EQ(checks_the_rubric_leaves_out(rubric, run),
            (std::vector<std::string>{"Lab1.Ungraded", "WorldSizes/Lab1.Bad/ranks3"}));
  LabResult lab = score_lab(rubric, run);
  ASSERT_TRUE(lab.checks[0].passed);
  refuse_an_incomplete_rubric(lab, run);
  EXPECT_FALSE(lab.checks[0].passed);
  EXPECT_DOUBLE_EQ(lab.checks[0].earned, 0);
  EXPECT_NE(lab.problem.find("the program registers 2 check(s) the rubric does not list "
                             "(Lab1.Ungraded, WorldSizes/Lab1.Bad/ranks3)"),
            std::string::npos)
      << lab.problem;
  // Every check listed (Lab1.Missing, listed but not in the program, fails on its own).
  rubric = two_check_rubric();
  rubric.checks.push_back({"Lab1.Ungraded", 1, Visibility::kVisible, ""});
  lab = score_lab(rubric, run);
  refuse_an_incomplete_rubric(lab, run);
  EXPECT_TRUE(lab.checks[0].passed) << lab.problem;
}

TEST(Score, EachCheckEarnsItsPointsOnlyWhenItPassed) {
  const LabResult lab = score_lab(two_check_rubric(), finished_run());
  ASSERT_EQ(lab.checks.size(), 3u);
  EXPECT_TRUE(lab.checks[0].passed);
  EXPECT_DOUBLE_EQ(lab.checks[0].earned, 10);
  EXPECT_FALSE(lab.checks[1].passed);
  EXPECT_DOUBLE_EQ(lab.checks[1].earned, 0);
  // gtest's location lines are dropped: the feedback is what was expected and seen.
  EXPECT_EQ(lab.checks[1].feedback.find("checks.cpp"), std::string::npos) << lab.checks[1].feedback;
  EXPECT_EQ(lab.checks[1].feedback.find("unknown file"), std::string::npos);
  EXPECT_NE(lab.checks[1].feedback.find("expected <= 2e-6, saw 4.1e-2"), std::string::npos);
  EXPECT_NE(lab.checks[2].feedback.find("not found in the check program bin/grade_lab1"),
            std::string::npos)
      << lab.checks[2].feedback;
  EXPECT_DOUBLE_EQ(lab.earned(), 10);
  EXPECT_DOUBLE_EQ(lab.possible(), 17);
  EXPECT_FALSE(report_of(lab).full_marks());
}

TEST(Score, ACrashedLabEarnsNothingAndSaysWhy) {
  RunResult run;
  run.status = RunStatus::kCrashed;
  run.signal = 11;
  run.output_tail = "[ RUN      ] Lab1.Good\nSegmentation fault";
  const LabResult lab = score_lab(two_check_rubric(), run);
  EXPECT_DOUBLE_EQ(lab.earned(), 0);
  EXPECT_NE(lab.problem.find("check program crashed (signal 11"), std::string::npos);
  EXPECT_EQ(lab.checks[0].feedback,
            "did not report a result: the check program crashed (signal 11: Segmentation fault) "
            "before running it (it sent no result at all)");
  EXPECT_FALSE(lab.checks[0].reported);
  const std::string table = format_table(report_of(lab));
  EXPECT_NE(table.find("lab 1: check program crashed (signal 11"), std::string::npos) << table;
  EXPECT_NE(table.find("last output:"), std::string::npos) << table;
  EXPECT_NE(table.find("| Segmentation fault"), std::string::npos) << table;
  EXPECT_NE(table.find("> did not report a result: the check program crashed"), std::string::npos)
      << table;
  EXPECT_NE(table.find("lab 1 total: 0/17 points"), std::string::npos) << table;
}

TEST(Score, AMissingProgramSaysSoOnEveryCheck) {
  RunResult run;
  run.status = RunStatus::kMissing;
  run.start_error = "check program bin/grade_lab1 not found (build it: cmake --build <build dir>)";
  const LabResult lab = score_lab(two_check_rubric(), run);
  EXPECT_EQ(lab.checks[1].feedback, "not run: " + run.start_error);
}

TEST(Score, SkippedChecksEarnNothing) {
  RunResult run = finished_run();
  run.tests["Lab1.Good"].state = TestState::kSkipped;
  const LabResult lab = score_lab(two_check_rubric(), run);
  EXPECT_FALSE(lab.checks[0].passed);
  EXPECT_NE(lab.checks[0].feedback.find("skipped"), std::string::npos);
}

TEST(Table, ShowsPointsFeedbackAndTotals) {
  const std::string table = format_table(report_of(score_lab(two_check_rubric(), finished_run())));
  EXPECT_NE(table.find("lab 1: Replicated <training> & co"), std::string::npos) << table;
  EXPECT_NE(table.find("PASS 10/10  Lab1.Good  (passes)"), std::string::npos) << table;
  EXPECT_NE(table.find("FAIL   0/5  WorldSizes/Lab1.Bad/ranks3  (fails)"), std::string::npos)
      << table;
  EXPECT_NE(table.find("> rank 2 weights differ: expected <= 2e-6, saw 4.1e-2"), std::string::npos)
      << table;
  EXPECT_NE(table.find("total: 10/17 points\n"), std::string::npos) << table;
  EXPECT_EQ(table.find("grading seed"), std::string::npos) << "no seed, no line";
}

TEST(Table, APassShowsWhatItMeasured) {
  const std::string table = format_table(report_of(score_lab(two_check_rubric(), finished_run())));
  EXPECT_NE(table.find("PASS 10/10  Lab1.Good  (passes)\n"
                       "              measured: replicas differ by 3.1e-02\n"),
            std::string::npos)
      << table;
}

TEST(Table, OpensWithTheSeedAndShowsNotices) {
  RunResult run = finished_run();
  run.lines_without_token = 2;
  GradeReport report = report_of(score_lab(two_check_rubric(), run));
  report.seed = 18446744073709551615u;
  const std::string table = format_table(report);
  EXPECT_TRUE(
      table.starts_with("grading seed 18446744073709551615 (repeat this run with --seed "
                        "18446744073709551615)\n"))
      << table;
  EXPECT_NE(table.find("  note: ignored 2 line(s) on the results channel without this run's token"),
            std::string::npos)
      << table;
}

TEST(Table, FullMarksAreNamed) {
  Rubric rubric = two_check_rubric();
  rubric.checks.resize(1);
  const GradeReport report = report_of(score_lab(rubric, finished_run()));
  EXPECT_TRUE(report.full_marks());
  EXPECT_NE(format_table(report).find("total: 10/10 points (full marks)"), std::string::npos);
}

TEST(Gradescope, ResultsJsonHasTheSpecifiedFields) {
  const std::string text =
      to_gradescope_json(report_of(score_lab(two_check_rubric(), finished_run())));
  const nlohmann::json results = nlohmann::json::parse(text);
  EXPECT_DOUBLE_EQ(results.at("score").get<double>(), 10);
  EXPECT_DOUBLE_EQ(results.at("max_score").get<double>(), 17);
  EXPECT_DOUBLE_EQ(results.at("execution_time").get<double>(), 1.5);
  EXPECT_TRUE(results.at("output").is_string());
  EXPECT_EQ(results.at("visibility"), "visible");
  const nlohmann::json& tests = results.at("tests");
  ASSERT_EQ(tests.size(), 3u);
  EXPECT_EQ(tests[0].at("name"), "lab 1: Lab1.Good");
  EXPECT_EQ(tests[0].at("number"), "1.1");
  EXPECT_DOUBLE_EQ(tests[0].at("score").get<double>(), 10);
  EXPECT_DOUBLE_EQ(tests[0].at("max_score").get<double>(), 10);
  EXPECT_EQ(tests[0].at("status"), "passed");
  EXPECT_EQ(tests[0].at("tags"), nlohmann::json::array({"lab1"}));
  EXPECT_EQ(tests[1].at("visibility"), "hidden");
  EXPECT_EQ(tests[1].at("status"), "failed");
  EXPECT_NE(tests[1].at("output").get<std::string>().find("saw 4.1e-2"), std::string::npos);
  EXPECT_EQ(tests[2].at("visibility"), "after_published");
  EXPECT_NE(tests[2].at("output").get<std::string>().find("\"Lab1.Missing\" not found in the check "
                                                          "program bin/grade_lab1"),
            std::string::npos)
      << tests[2].at("output");
}

TEST(Gradescope, OutputHasTheSeedTheDrawsAndTheNotes) {
  Rubric rubric = two_check_rubric();
  rubric.draws = {"world sizes 1 to 5", "global batch 8 to 64"};
  GradeReport report = report_of(score_lab(rubric, finished_run()));
  report.seed = 42;
  const nlohmann::json results = nlohmann::json::parse(to_gradescope_json(report));
  const std::string output = results.at("output");
  EXPECT_TRUE(output.starts_with("grading seed 42 (repeat this run with --seed 42)\n")) << output;
  EXPECT_NE(output.find("  draws: world sizes 1 to 5\n  draws: global batch 8 to 64\n"),
            std::string::npos)
      << output;
  EXPECT_EQ(results.at("tests")[0].at("output"), "passes\n\nmeasured: replicas differ by 3.1e-02");
}

TEST(Gradescope, InvalidUtf8InOutputStillGivesValidJson) {
  RunResult run;
  run.status = RunStatus::kCrashed;
  run.signal = 6;
  run.output_tail = "bytes \xff\xfe end";
  const std::string text = to_gradescope_json(report_of(score_lab(two_check_rubric(), run)));
  const nlohmann::json results = nlohmann::json::parse(text);  // throws if invalid
  EXPECT_NE(results.at("output").get<std::string>().find("signal 6"), std::string::npos);
}

/// True when Python's XML parser reads `xml` without error.
bool python_parses_xml(const std::string& xml, const std::string& name) {
  const auto file = std::filesystem::path(::testing::TempDir()) / (name + ".xml");
  write_text_file(file, xml);
  const std::string command =
      "python3 -c 'import sys, xml.dom.minidom; xml.dom.minidom.parse(sys.argv[1])' '" +
      file.string() + "'";
  return std::system(command.c_str()) == 0;
}

TEST(Junit, IsWellFormedWithCountsAndEscapedFeedback) {
  const std::string xml = to_junit_xml(report_of(score_lab(two_check_rubric(), finished_run())));
  EXPECT_TRUE(python_parses_xml(xml, "dp_grader_junit")) << xml;
  // Lab1.Bad reported a failure; Lab1.Missing never reported (the program has no such test).
  EXPECT_NE(xml.find("<testsuites name=\"dplab grade\" tests=\"3\" failures=\"1\" errors=\"1\""),
            std::string::npos)
      << xml;
  EXPECT_NE(xml.find("<testsuite name=\"lab1 Replicated &lt;training&gt; &amp; co\" tests=\"3\" "
                     "failures=\"1\" errors=\"1\""),
            std::string::npos)
      << xml;
  EXPECT_NE(xml.find("<testcase name=\"Bad/ranks3\" classname=\"lab1.WorldSizes/Lab1\" "
                     "time=\"0.500\">"),
            std::string::npos)
      << xml;
  EXPECT_NE(xml.find("<failure message=\"rank 2 weights differ: expected &lt;= 2e-6, saw 4.1e-2\""),
            std::string::npos)
      << xml;
  EXPECT_NE(xml.find("C++ exception &quot;&lt;oops&gt;&quot; &amp; ? thrown"), std::string::npos)
      << xml;
}

TEST(Junit, ALabWithoutResultsGivesErrors) {
  RunResult run;
  run.status = RunStatus::kTimedOut;
  run.time_limit_seconds = 300;
  run.output_tail = "dplab: timeout: rank 0 waited \xff 60 s";
  const std::string xml = to_junit_xml(report_of(score_lab(two_check_rubric(), run)));
  EXPECT_TRUE(python_parses_xml(xml, "dp_grader_junit_errors")) << xml;
  EXPECT_NE(xml.find("errors=\"3\""), std::string::npos) << xml;
  EXPECT_NE(xml.find("<error message=\"did not report a result: the check program timed out "
                     "before running it (it sent no result at all)\""),
            std::string::npos)
      << xml;
  EXPECT_NE(xml.find("last output of the check program:\ndplab: timeout: rank 0 waited ? 60 s"),
            std::string::npos)
      << xml;
}

TEST(Junit, HasTheSeedAndTheNotes) {
  GradeReport report = report_of(score_lab(two_check_rubric(), finished_run()));
  report.seed = 7;
  const std::string xml = to_junit_xml(report);
  EXPECT_TRUE(python_parses_xml(xml, "dp_grader_junit_seed")) << xml;
  EXPECT_NE(xml.find("<property name=\"grading_seed\" value=\"7\"/>"), std::string::npos) << xml;
  EXPECT_NE(xml.find("<system-out>measured: replicas differ by 3.1e-02</system-out>"),
            std::string::npos)
      << xml;
}

TEST(Xml, EscapesAndReplacesWhatXmlForbids) {
  EXPECT_EQ(xml_escape("a<b>&\"'"), "a&lt;b&gt;&amp;&quot;&apos;");
  EXPECT_EQ(xml_escape("tab\tnl\n\x02"), "tab\tnl\n?");
  EXPECT_EQ(xml_escape("caf\xc3\xa9 \xff"), "caf\xc3\xa9 ?");
}

}  // namespace
}  // namespace dp::grader
