// result_collector.cpp: splits channel bytes into lines, checks the token, reads the events.
#include "result_collector.h"

#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "dp/error.h"
#include "result_channel.h"

namespace dp::grader {
namespace {

using nlohmann::json;

std::string string_field(const json& event, const char* name) {
  const auto it = event.find(name);
  return it != event.end() && it->is_string() ? it->get<std::string>() : "";
}

}  // namespace

ResultCollector::ResultCollector(std::string token, int ranks)
    : token_(std::move(token)),
      ranks_(static_cast<std::size_t>(ranks)),
      partial_lines_(static_cast<std::size_t>(ranks)),
      in_long_line_(static_cast<std::size_t>(ranks), false) {
  if (token_.empty()) throw Error("ResultCollector: the token must not be empty");
}

void ResultCollector::add(int rank, std::string_view bytes) {
  // The cap counts every byte, lines without the token too: it bounds the driver's memory.
  const std::size_t room = channel::kMaxResultBytes - accepted_bytes_;
  if (bytes.size() > room) {
    ignored_bytes_ += bytes.size() - room;
    bytes = bytes.substr(0, room);
  }
  accepted_bytes_ += bytes.size();

  const auto r = static_cast<std::size_t>(rank);
  std::string& partial = partial_lines_.at(r);
  while (!bytes.empty()) {
    const std::size_t newline = bytes.find('\n');
    const std::string_view piece = bytes.substr(0, newline);
    if (!in_long_line_[r]) partial.append(piece);
    if (partial.size() > channel::kMaxAcceptedLineBytes) {
      // Too long to be a line the check program sends: drop it (and the rest of it).
      ++(std::string_view(partial).starts_with(token_ + " ") ? malformed_lines_
                                                             : lines_without_token_);
      partial.clear();
      in_long_line_[r] = true;
    }
    if (newline == std::string_view::npos) break;
    if (!in_long_line_[r]) handle_line(rank, partial);
    partial.clear();
    in_long_line_[r] = false;
    bytes.remove_prefix(newline + 1);
  }
}

void ResultCollector::finish() {
  for (std::string& partial : partial_lines_) {
    if (!partial.empty()) ++malformed_lines_;
    partial.clear();
  }
}

void ResultCollector::handle_line(int rank, std::string_view line) {
  const std::string prefix = token_ + " ";
  if (!line.starts_with(prefix)) {
    ++lines_without_token_;
    return;
  }
  if (!handle_event(ranks_.at(static_cast<std::size_t>(rank)), line.substr(prefix.size())))
    ++malformed_lines_;
}

bool ResultCollector::handle_event(RankReport& report, std::string_view text) {
  const json event = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!event.is_object()) return false;
  const std::string kind = string_field(event, "event");
  const std::string test = string_field(event, "test");
  // The check program sends registered*, (start end)*, program_end, in that order, once
  // each; anything else on a line with the token means someone else wrote to the channel.
  const auto violation = [&](std::string what) {
    if (report.out_of_order.empty()) report.out_of_order = std::move(what);
  };
  if (report.program_ended) violation(fmt::format("a \"{}\" event after the program's end", kind));
  if (kind == "program_end") {
    if (!report.running.empty())
      violation(fmt::format("the program's end while {} was running", report.running));
    report.program_ended = true;
    report.running.clear();
    return true;
  }
  if (test.empty()) return false;
  if (kind == "registered") {
    const auto runs = event.find("runs");
    report.registered[test] = runs == event.end() || !runs->is_boolean() || runs->get<bool>();
    return true;
  }
  if (kind == "start") {
    if (!report.running.empty())
      violation(fmt::format("a start of {} while {} was running", test, report.running));
    if (report.finished.contains(test)) violation(fmt::format("a second start of {}", test));
    report.running = test;
    return true;
  }
  if (kind != "end") return false;

  TestOutcome outcome;
  outcome.name = test;
  const std::string result = string_field(event, "result");
  if (result == "passed")
    outcome.state = TestState::kPassed;
  else if (result == "skipped")
    outcome.state = TestState::kSkipped;
  else if (result == "failed")
    outcome.state = TestState::kFailed;
  else
    return false;
  outcome.failure = string_field(event, "failure");
  if (const auto notes = event.find("notes"); notes != event.end() && notes->is_array())
    for (const json& note : *notes)
      if (note.is_string()) outcome.notes.push_back(note.get<std::string>());
  if (const auto seconds = event.find("seconds"); seconds != event.end() && seconds->is_number())
    outcome.seconds = std::max(0.0, seconds->get<double>());
  if (report.finished.contains(test))
    violation(fmt::format("a second result for {}", test));
  else if (report.running != test)
    violation(fmt::format("a result for {} that was never started", test));
  if (report.running == test) report.running.clear();
  report.finished.try_emplace(test, std::move(outcome));
  return true;
}

}  // namespace dp::grader
