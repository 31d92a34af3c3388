// Tests of rubric parsing: a good rubric is read as written; every kind of malformed
// rubric is a dp::Error that names the file and says what is wrong.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "dp/error.h"
#include "rubric.h"

namespace dp::grader {
namespace {

constexpr const char* kGood = R"({
  "lab": 2, "title": "Gradient averaging",
  "checks": [
    {"test": "Lab2.Sgd", "points": 10, "visibility": "visible", "description": "SGD matches"},
    {"test": "WorldSizes/Lab2Equivalence.AdamW/ranks3", "points": 2.5,
     "visibility": "after_due_date", "description": "AdamW on 3 ranks"}
  ],
  "tolerance": "4 ulp per step",
  "draws": ["world sizes 1 to 5", "micro-batches 1 to 4"]
})";

/// The message of the dp::Error that parsing `text` throws ("" and a failure if none).
std::string error_of(const std::string& text) {
  try {
    parse_rubric(text, "grader/labX/rubric.json");
  } catch (const Error& error) {
    return error.what();
  }
  ADD_FAILURE() << "expected a dp::Error for:\n" << text;
  return "";
}

TEST(Rubric, ReadsEveryField) {
  const Rubric rubric = parse_rubric(kGood, "good.json");
  EXPECT_EQ(rubric.lab, 2);
  EXPECT_EQ(rubric.title, "Gradient averaging");
  EXPECT_EQ(rubric.tolerance, "4 ulp per step");
  ASSERT_EQ(rubric.checks.size(), 2u);
  EXPECT_EQ(rubric.checks[1].test, "WorldSizes/Lab2Equivalence.AdamW/ranks3");
  EXPECT_DOUBLE_EQ(rubric.checks[1].points, 2.5);
  EXPECT_EQ(rubric.checks[1].visibility, Visibility::kAfterDueDate);
  EXPECT_EQ(rubric.checks[0].description, "SGD matches");
  EXPECT_DOUBLE_EQ(rubric.max_points(), 12.5);
  EXPECT_EQ(rubric.draws, (std::vector<std::string>{"world sizes 1 to 5", "micro-batches 1 to 4"}));
}

TEST(Rubric, DrawsMayBeOneStringOrAbsent) {
  const std::string checks =
      R"("checks": [{"test": "A.B", "points": 1, "visibility": "visible", "description": "d"}])";
  EXPECT_EQ(parse_rubric(R"({"lab": 1, "title": "x", "draws": "seeds 0 to 2^32", )" + checks + "}",
                         "one.json")
                .draws,
            std::vector<std::string>{"seeds 0 to 2^32"});
  EXPECT_TRUE(
      parse_rubric(R"({"lab": 1, "title": "x", )" + checks + "}", "none.json").draws.empty());
}

TEST(Rubric, DrawsOfAnotherTypeAreAnError) {
  const std::string checks =
      R"("checks": [{"test": "A.B", "points": 1, "visibility": "visible", "description": "d"}])";
  const std::string number = error_of(R"({"lab": 1, "title": "x", "draws": 5, )" + checks + "}");
  EXPECT_NE(number.find("\"draws\" must be a string or an array of strings, got the number 5"),
            std::string::npos)
      << number;
  const std::string mixed =
      error_of(R"({"lab": 1, "title": "x", "draws": ["a", true], )" + checks + "}");
  EXPECT_NE(mixed.find("\"draws\" must be a string or an array of strings, got true at draws[1]"),
            std::string::npos)
      << mixed;
}

TEST(Rubric, SyntaxErrorGivesTheByteOffset) {
  const std::string message = error_of(R"({"lab": 1, "title": "x",, "checks": []})");
  EXPECT_NE(message.find("grader/labX/rubric.json"), std::string::npos) << message;
  EXPECT_NE(message.find("not valid JSON at byte 25"), std::string::npos) << message;
}

TEST(Rubric, ANumberBeyondAnyDoubleIsAnErrorNotACrash) {
  // Found by tests/fuzz/fuzz_rubric's sibling: nlohmann's out_of_range escaped the parser.
  const std::string message = error_of(R"({"lab": 1, "title": "x", "checks": [], "p": 4e60149})");
  EXPECT_NE(message.find("not valid JSON"), std::string::npos) << message;
  EXPECT_NE(message.find("number overflow"), std::string::npos) << message;
}

TEST(Rubric, MissingFieldIsNamed) {
  EXPECT_NE(error_of(R"({"title": "x", "checks": []})").find("missing field \"lab\""),
            std::string::npos);
  const std::string message = error_of(
      R"({"lab": 1, "title": "x", "checks": [{"test": "A.B", "visibility": "visible", "description": "d"}]})");
  EXPECT_NE(message.find("checks[0] (\"A.B\"): missing field \"points\""), std::string::npos)
      << message;
}

TEST(Rubric, PointsMustBeANumberFrom0To1000) {
  const std::string negative = error_of(
      R"({"lab": 1, "title": "x", "checks": [{"test": "A.B", "points": -1, "visibility": "visible", "description": "d"}]})");
  EXPECT_NE(negative.find("\"points\" must be a number from 0 to 1000, got the number -1"),
            std::string::npos)
      << negative;
  // Issue 32: 1e308 points made the lab's total inf ("inf/inf (full marks)", "score": null).
  const std::string huge = error_of(
      R"({"lab": 1, "title": "x", "checks": [{"test": "A.B", "points": 1e308, "visibility": "visible", "description": "d"}]})");
  EXPECT_NE(huge.find("\"points\" must be a number from 0 to 1000, got the number 1e+308"),
            std::string::npos)
      << huge;
  const std::string text = error_of(
      R"({"lab": 1, "title": "x", "checks": [{"test": "A.B", "points": "10", "visibility": "visible", "description": "d"}]})");
  EXPECT_NE(text.find("got the string \"10\""), std::string::npos) << text;
}

TEST(Rubric, BadVisibilityListsTheAcceptedValues) {
  const std::string message = error_of(
      R"({"lab": 1, "title": "x", "checks": [{"test": "A.B", "points": 1, "visibility": "public", "description": "d"}]})");
  EXPECT_NE(message.find("unknown visibility \"public\": expected visible, hidden, "
                         "after_due_date or after_published"),
            std::string::npos)
      << message;
}

TEST(Rubric, DuplicateTestIsAnError) {
  const std::string message = error_of(
      R"({"lab": 1, "title": "x", "checks": [
        {"test": "A.B", "points": 1, "visibility": "visible", "description": "d"},
        {"test": "A.B", "points": 2, "visibility": "hidden", "description": "e"}]})");
  EXPECT_NE(message.find("checks[1]: test \"A.B\" is listed twice"), std::string::npos) << message;
}

TEST(Rubric, LabMustBeAWholeNumberAndChecksNonEmpty) {
  EXPECT_NE(error_of(R"({"lab": "one", "title": "x", "checks": []})")
                .find("\"lab\" must be a whole number >= 0, got the string \"one\""),
            std::string::npos);
  EXPECT_NE(error_of(R"({"lab": -1, "title": "x", "checks": []})")
                .find("\"lab\" must be a whole number >= 0"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"lab": 1, "title": "x", "checks": []})")
                .find("\"checks\" must be a non-empty array, got an array"),
            std::string::npos);
  EXPECT_NE(error_of(R"([1, 2])").find("top level: expected an object, got an array"),
            std::string::npos);
}

TEST(Rubric, LoadNamesAFileThatCannotBeRead) {
  try {
    load_rubric("/nonexistent/rubric.json");
    FAIL() << "expected a dp::Error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("cannot read the rubric /nonexistent/rubric.json"),
              std::string::npos)
        << error.what();
  }
}

TEST(Rubric, LoadReadsAFile) {
  const auto file = std::filesystem::path(::testing::TempDir()) / "dp_grader_rubric_test.json";
  std::ofstream(file) << kGood;
  EXPECT_EQ(load_rubric(file).source, file.string());
  EXPECT_EQ(load_rubric(file).checks.size(), 2u);
  std::filesystem::remove(file);
}

}  // namespace
}  // namespace dp::grader
