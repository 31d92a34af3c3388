// rubric.cpp: reads and validates rubric.json files.
#include "rubric.h"

#include <fmt/format.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "dp/error.h"

namespace dp::grader {
namespace {

using nlohmann::json;

/// The JSON type name a rubric author would recognise ("a string", "a number", ...).
std::string describe(const json& value) {
  switch (value.type()) {
    case json::value_t::null: return "null";
    case json::value_t::object: return "an object";
    case json::value_t::array: return "an array";
    case json::value_t::string: return fmt::format("the string \"{}\"", value.get<std::string>());
    case json::value_t::boolean: return value.get<bool>() ? "true" : "false";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
    case json::value_t::number_float: return fmt::format("the number {}", value.dump());
    default: return value.type_name();
  }
}

/// Reports a malformed rubric: the file, where in it, and what was expected and seen.
[[noreturn]] void malformed(const std::string& source, const std::string& where,
                            const std::string& problem) {
  throw Error(fmt::format("malformed rubric {}: {}: {}", source, where, problem));
}

const json& required_field(const json& object, const char* name, const std::string& source,
                           const std::string& where) {
  const auto it = object.find(name);
  if (it == object.end()) malformed(source, where, fmt::format("missing field \"{}\"", name));
  return *it;
}

std::string required_string(const json& object, const char* name, const std::string& source,
                            const std::string& where) {
  const json& value = required_field(object, name, source, where);
  if (!value.is_string() || value.get<std::string>().empty())
    malformed(source, where,
              fmt::format("\"{}\" must be a non-empty string, got {}", name, describe(value)));
  return value.get<std::string>();
}

RubricCheck parse_check(const json& entry, std::size_t index, const std::string& source) {
  const std::string where = fmt::format("checks[{}]", index);
  if (!entry.is_object())
    malformed(source, where, fmt::format("expected an object, got {}", describe(entry)));
  RubricCheck check;
  check.test = required_string(entry, "test", source, where);
  const std::string named = fmt::format("{} (\"{}\")", where, check.test);
  const json& points = required_field(entry, "points", source, named);
  // Bounded so that no sum of a lab's points or of every lab's can overflow to infinity.
  if (!points.is_number() || !std::isfinite(points.get<double>()) || points.get<double>() < 0 ||
      points.get<double>() > kMaxCheckPoints)
    malformed(source, named,
              fmt::format("\"points\" must be a number from 0 to {}, got {}", kMaxCheckPoints,
                          describe(points)));
  check.points = points.get<double>();
  const std::string visibility = required_string(entry, "visibility", source, named);
  try {
    check.visibility = parse_visibility(visibility);
  } catch (const Error& error) {
    malformed(source, named, error.what());
  }
  check.description = required_string(entry, "description", source, named);
  return check;
}

}  // namespace

std::string_view to_string(Visibility visibility) {
  switch (visibility) {
    case Visibility::kVisible: return "visible";
    case Visibility::kHidden: return "hidden";
    case Visibility::kAfterDueDate: return "after_due_date";
    case Visibility::kAfterPublished: return "after_published";
  }
  return "visible";
}

Visibility parse_visibility(std::string_view text) {
  for (Visibility visibility : {Visibility::kVisible, Visibility::kHidden,
                                Visibility::kAfterDueDate, Visibility::kAfterPublished})
    if (text == to_string(visibility)) return visibility;
  throw Error(fmt::format(
      "unknown visibility \"{}\": expected visible, hidden, after_due_date or after_published",
      text));
}

double Rubric::max_points() const {
  double total = 0;
  for (const RubricCheck& check : checks) total += check.points;
  return total;
}

Rubric parse_rubric(std::string_view text, const std::string& source) {
  json document;
  try {
    document = json::parse(text);
  } catch (const json::parse_error& error) {
    // nlohmann's message already says "at line L, column C"; add the byte offset, which
    // editors can jump to.
    throw Error(fmt::format("malformed rubric {}: not valid JSON at byte {}: {}", source,
                            error.byte, error.what()));
  } catch (const json::exception& error) {
    // Valid syntax the parser still refuses, e.g. a number beyond any double (found by
    // tests/fuzz/fuzz_rubric).
    throw Error(fmt::format("malformed rubric {}: not valid JSON: {}", source, error.what()));
  }
  if (!document.is_object())
    malformed(source, "top level", fmt::format("expected an object, got {}", describe(document)));

  Rubric rubric;
  rubric.source = source;
  const json& lab = required_field(document, "lab", source, "top level");
  if (!lab.is_number_integer() || lab.get<long long>() < 0)
    malformed(source, "top level",
              fmt::format("\"lab\" must be a whole number >= 0, got {}", describe(lab)));
  rubric.lab = lab.get<int>();
  rubric.title = required_string(document, "title", source, "top level");
  if (const auto tolerance = document.find("tolerance"); tolerance != document.end()) {
    if (!tolerance->is_string())
      malformed(source, "top level",
                fmt::format("\"tolerance\" must be a string, got {}", describe(*tolerance)));
    rubric.tolerance = tolerance->get<std::string>();
  }
  if (const auto draws = document.find("draws"); draws != document.end()) {
    const std::string expected = "\"draws\" must be a string or an array of strings";
    if (draws->is_string()) {
      rubric.draws.push_back(draws->get<std::string>());
    } else if (draws->is_array()) {
      for (std::size_t i = 0; i < draws->size(); ++i) {
        if (!(*draws)[i].is_string())
          malformed(source, "top level",
                    fmt::format("{}, got {} at draws[{}]", expected, describe((*draws)[i]), i));
        rubric.draws.push_back((*draws)[i].get<std::string>());
      }
    } else {
      malformed(source, "top level", fmt::format("{}, got {}", expected, describe(*draws)));
    }
  }
  const json& checks = required_field(document, "checks", source, "top level");
  if (!checks.is_array() || checks.empty())
    malformed(source, "top level",
              fmt::format("\"checks\" must be a non-empty array, got {}", describe(checks)));

  std::set<std::string> seen;
  for (std::size_t i = 0; i < checks.size(); ++i) {
    RubricCheck check = parse_check(checks[i], i, source);
    if (!seen.insert(check.test).second)
      malformed(
          source, fmt::format("checks[{}]", i),
          fmt::format("test \"{}\" is listed twice (each check earns points once)", check.test));
    rubric.checks.push_back(std::move(check));
  }
  return rubric;
}

Rubric load_rubric(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in)
    throw Error(fmt::format("cannot read the rubric {}: no such readable file", file.string()));
  std::ostringstream text;
  text << in.rdbuf();
  return parse_rubric(text.str(), file.string());
}

}  // namespace dp::grader
