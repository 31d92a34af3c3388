// rubric.h: a lab's rubric, the file that turns GoogleTest checks into points.
//
// Every lab has grader/<lab>/rubric.json. It names the lab, and for each graded check
// the GoogleTest test (Suite.Name, as gtest prints it), its points, its Gradescope
// visibility and a one-line description:
//
//   {"lab": 1, "title": "Replicated training",
//    "checks": [{"test": "Lab1Sampler.CoversEveryIndexExactlyOnce", "points": 10,
//                "visibility": "visible", "description": "every index once per epoch"}],
//    "tolerance": "how equivalence tolerances were derived (optional)",
//    "draws": ["world sizes 1 to 5", "global batch 8 to 64, a multiple of the world size"]}
//
// "draws" (optional, a string or an array of strings) documents the ranges the checks draw
// their parameters from at grade time; the Gradescope output shows it. Tests of the check
// program that the rubric does not list earn nothing. A malformed rubric is a `dp::Error`
// naming the file and what is wrong with it.
//
// Example:
//
//   const dp::grader::Rubric rubric =
//       dp::grader::load_rubric("grader/lab1_replicated/rubric.json");
//   fmt::print("lab {}: {} checks, {} points\n", rubric.lab, rubric.checks.size(),
//              rubric.max_points());
#pragma once

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace dp::grader {

/// Who sees a check's result on Gradescope (the values of its results.json).
enum class Visibility {
  kVisible,         ///< "visible": always
  kHidden,          ///< "hidden": never to students
  kAfterDueDate,    ///< "after_due_date"
  kAfterPublished,  ///< "after_published": once grades are published
};

/// The Gradescope spelling: "visible", "hidden", "after_due_date" or "after_published".
std::string_view to_string(Visibility visibility);
/// Parses the Gradescope spelling; throws `dp::Error` listing the accepted values.
Visibility parse_visibility(std::string_view text);

/// The most points one check may carry: far more than any rubric gives, and small enough
/// that the sums of every check of every lab stay exact.
inline constexpr double kMaxCheckPoints = 1000;

/// One graded check: a GoogleTest test and what it is worth.
struct RubricCheck {
  std::string test;   ///< full gtest name, e.g. "WorldSizes/Lab2Equivalence.Sgd/ranks3"
  double points = 0;  ///< points for passing it, 0 to kMaxCheckPoints
  Visibility visibility = Visibility::kVisible;  ///< who sees the result on Gradescope
  std::string description;                       ///< one line for the score table
};

/// A lab's rubric: its number, title and graded checks.
struct Rubric {
  int lab = 0;                      ///< lab number (1, 2, ...)
  std::string title;                ///< e.g. "Replicated training"
  std::vector<RubricCheck> checks;  ///< in the order of the file (and of the table)
  std::string tolerance;            ///< how equivalence tolerances were derived; may be empty
  std::vector<std::string> draws;   ///< the ranges the checks draw parameters from; may be empty
  std::string source;               ///< the file it was read from, for messages

  /// Sum of the points of every check.
  double max_points() const;
};

/// Parses a rubric from JSON text; `source` names it in error messages. Throws
/// `dp::Error` for a JSON syntax error (with its byte offset), a missing or mistyped
/// field ("draws" that is neither a string nor an array of strings, too), negative points,
/// an unknown visibility, or a test listed twice.
Rubric parse_rubric(std::string_view text, const std::string& source);

/// Reads and parses a rubric file; throws `dp::Error` when it cannot be read or is
/// malformed.
Rubric load_rubric(const std::filesystem::path& file);

}  // namespace dp::grader
