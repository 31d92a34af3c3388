#include "dp/trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <utility>

#include "dp/error.h"
#include "dp/output_file.h"

namespace dp {
namespace {

using Interval = std::pair<double, double>;  // [begin, end)

/// Sorts and merges `intervals` into disjoint ones; returns their total length.
double merge(std::vector<Interval>& intervals) {
  std::sort(intervals.begin(), intervals.end());
  std::vector<Interval> merged;
  for (const Interval& interval : intervals) {
    if (!merged.empty() && interval.first <= merged.back().second)
      merged.back().second = std::max(merged.back().second, interval.second);
    else
      merged.push_back(interval);
  }
  intervals = std::move(merged);
  double total = 0;
  for (const Interval& interval : intervals) total += interval.second - interval.first;
  return total;
}

/// Length of the intersection of two sorted lists of disjoint intervals.
double intersection(const std::vector<Interval>& a, const std::vector<Interval>& b) {
  double total = 0;
  std::size_t i = 0;
  std::size_t j = 0;
  while (i < a.size() && j < b.size()) {
    const double begin = std::max(a[i].first, b[j].first);
    const double end = std::min(a[i].second, b[j].second);
    if (end > begin) total += end - begin;
    if (a[i].second < b[j].second)
      ++i;
    else
      ++j;
  }
  return total;
}

const char* lane_name(TraceLane lane) {
  switch (lane) {
    case TraceLane::kCompute: return "compute";
    case TraceLane::kSend: return "communication (sends, collectives)";
    case TraceLane::kReceive: return "communication (receives)";
    case TraceLane::kInterNodeSend: return "communication (sends to other nodes)";
    case TraceLane::kInterNodeReceive: return "communication (receives from other nodes)";
  }
  return "unknown";
}

nlohmann::json summary_json(const StepSummary& s) {
  return {{"step", s.step},
          {"start_us", s.start * 1e6},
          {"total_us", s.total * 1e6},
          {"compute_us", s.compute * 1e6},
          {"communication_us", s.communication * 1e6},
          {"exposed_communication_us", s.exposed_communication * 1e6},
          {"overlap_fraction", s.overlap_fraction},
          {"link_bytes", s.link_bytes}};
}

}  // namespace

std::vector<StepSummary> summarize_steps(const RankTrace& trace) {
  std::vector<const TraceEvent*> events;
  events.reserve(trace.events.size());
  double longest = 0;
  for (const TraceEvent& event : trace.events) {
    events.push_back(&event);
    longest = std::max(longest, event.duration);
  }
  std::sort(events.begin(), events.end(),
            [](const TraceEvent* a, const TraceEvent* b) { return a->start < b->start; });

  std::vector<StepSummary> steps;
  for (std::size_t k = 0; k + 1 < trace.step_marks.size(); ++k) {
    const double begin = trace.step_marks[k];
    const double end = trace.step_marks[k + 1];
    StepSummary step;
    step.step = static_cast<int>(k) + 1;
    step.start = begin;
    step.total = end - begin;
    // Only events that start after begin - longest can reach into [begin, end).
    auto first = std::lower_bound(events.begin(), events.end(), begin - longest,
                                  [](const TraceEvent* e, double t) { return e->start < t; });
    std::vector<Interval> compute;
    std::vector<Interval> communication;
    for (auto it = first; it != events.end() && (*it)->start < end; ++it) {
      const TraceEvent& event = **it;
      const double from = std::max(event.start, begin);
      const double to = std::min(event.start + event.duration, end);
      if (event.lane != TraceLane::kCompute && event.start >= begin) step.link_bytes += event.bytes;
      if (to <= from) continue;
      (event.lane == TraceLane::kCompute ? compute : communication).emplace_back(from, to);
    }
    step.compute = merge(compute);
    step.communication = merge(communication);
    step.exposed_communication = step.communication - intersection(communication, compute);
    step.overlap_fraction =
        step.communication > 0 ? 1.0 - step.exposed_communication / step.communication : 0.0;
    steps.push_back(step);
  }
  return steps;
}

void add_step(StepSummary& sum, const StepSummary& step) {
  sum.step += 1;
  sum.total += step.total;
  sum.compute += step.compute;
  sum.communication += step.communication;
  sum.exposed_communication += step.exposed_communication;
  sum.overlap_fraction += step.overlap_fraction;
  sum.link_bytes += step.link_bytes;
}

namespace {

/// The mean of the sums in `sum` over its `sum.step` steps.
StepSummary mean_of_sum(const StepSummary& sum) {
  StepSummary mean = sum;
  mean.start = 0;
  if (sum.step == 0) return mean;
  const double n = static_cast<double>(sum.step);
  mean.total /= n;
  mean.compute /= n;
  mean.communication /= n;
  mean.exposed_communication /= n;
  mean.overlap_fraction /= n;
  mean.link_bytes = static_cast<std::uint64_t>(static_cast<double>(sum.link_bytes) / n + 0.5);
  return mean;
}

}  // namespace

StepSummary mean_of(std::span<const StepSummary> steps) {
  StepSummary sum;
  for (const StepSummary& step : steps) add_step(sum, step);
  return mean_of_sum(sum);
}

StepSummary mean_step(const RankTrace& trace) {
  StepSummary sum = trace.folded;
  for (const StepSummary& step : summarize_steps(trace)) add_step(sum, step);
  return mean_of_sum(sum);
}

std::string chrome_trace_json(std::span<const RankTrace> traces) {
  nlohmann::json events = nlohmann::json::array();
  nlohmann::json ranks = nlohmann::json::array();
  std::string clock = traces.empty() ? "" : traces.front().clock_description;
  bool simulated = !traces.empty() && traces.front().simulated;
  for (const RankTrace& trace : traces) {
    const int pid = trace.rank;
    events.push_back({{"name", "process_name"},
                      {"ph", "M"},
                      {"pid", pid},
                      {"tid", 0},
                      {"args", {{"name", fmt::format("rank {}", trace.rank)}}}});
    events.push_back({{"name", "process_sort_index"},
                      {"ph", "M"},
                      {"pid", pid},
                      {"tid", 0},
                      {"args", {{"sort_index", trace.rank}}}});
    bool two_level = false;
    for (const TraceEvent& event : trace.events)
      two_level = two_level || event.lane == TraceLane::kInterNodeSend ||
                  event.lane == TraceLane::kInterNodeReceive;
    std::vector<TraceLane> lanes = {TraceLane::kCompute, TraceLane::kSend, TraceLane::kReceive};
    if (two_level) {
      lanes.push_back(TraceLane::kInterNodeSend);
      lanes.push_back(TraceLane::kInterNodeReceive);
    }
    for (TraceLane lane : lanes)
      events.push_back({{"name", "thread_name"},
                        {"ph", "M"},
                        {"pid", pid},
                        {"tid", static_cast<int>(lane)},
                        {"args", {{"name", lane_name(lane)}}}});
    for (const TraceEvent& event : trace.events) {
      nlohmann::json args = {{"wall_ts_us", event.wall_start * 1e6},
                             {"wall_dur_us", event.wall_duration * 1e6},
                             {"bytes", event.bytes}};
      if (event.lane == TraceLane::kCompute) args["flops"] = event.flops;
      if (event.peer >= 0) args["peer"] = event.peer;
      events.push_back({{"name", event.name},
                        {"cat", event.lane == TraceLane::kCompute ? "compute" : "communication"},
                        {"ph", "X"},
                        {"ts", event.start * 1e6},
                        {"dur", event.duration * 1e6},
                        {"pid", pid},
                        {"tid", static_cast<int>(event.lane)},
                        {"args", std::move(args)}});
    }
    nlohmann::json steps = nlohmann::json::array();
    for (const StepSummary& step : summarize_steps(trace)) steps.push_back(summary_json(step));
    ranks.push_back({{"rank", trace.rank}, {"steps", std::move(steps)}});
  }
  nlohmann::json document = {{"traceEvents", std::move(events)},
                             {"displayTimeUnit", "ns"},
                             {"otherData",
                              {{"producer", "dplab"},
                               {"clock", clock},
                               {"simulated", simulated},
                               {"ranks", std::move(ranks)}}}};
  return document.dump();
}

void write_chrome_trace(const std::string& path, std::span<const RankTrace> traces) {
  write_file_atomically(path, chrome_trace_json(traces));
}

}  // namespace dp
