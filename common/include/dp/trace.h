// trace.h: what a rank's clock records, the per-step summary, and Chrome trace output.
//
// Every compute op (a layer's forward or backward, the loss, an optimizer step) and every
// communication op (a message, a collective) of a rank is one `TraceEvent`, with its start
// and duration on the rank's clock (virtual seconds on the simulated clock, wall seconds on
// a wall clock) and in wall time. `summarize_steps` turns a rank's events into one
// `StepSummary` per training step: total time, compute, communication, the communication
// no compute hid (exposed), the overlap fraction and the bytes that crossed the rank's
// link. `chrome_trace_json` writes the Chrome Trace Event format that Perfetto
// (ui.perfetto.dev) and chrome://tracing open: one process per rank, one thread for
// compute and two for communication (sends and collectives; receives), two more for the
// inter-node port of a two-level network. Events of one thread never overlap.
//
// Example (inside `dp::launch`, after training; see `dplab train --trace`):
//
//   std::vector<dp::RankTrace> traces(world_size);
//   ... traces[comm.rank()] = comm.clock().trace();          // on every rank
//   dp::write_chrome_trace("run.json", traces);               // after launch returns
//   for (const dp::StepSummary& s : dp::summarize_steps(traces[0]))
//     fmt::print("step {} took {} s, {:.0f}% of communication hidden\n", s.step, s.total,
//                100 * s.overlap_fraction);
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace dp {

/// Which timeline of a rank an event belongs to.
enum class TraceLane {
  kCompute,           ///< the compute timeline: layers, loss, optimizer
  kSend,              ///< the link's send direction: messages sent, and every collective
  kReceive,           ///< the link's receive direction: messages received
  kInterNodeSend,     ///< two-level networks: messages sent to another node
  kInterNodeReceive,  ///< two-level networks: messages received from another node
};

/// One op on one rank.
struct TraceEvent {
  std::string name;                      ///< e.g. "fc1 forward", "allreduce", "send to 3"
  TraceLane lane = TraceLane::kCompute;  ///< the timeline it occupies
  double start = 0;                      ///< seconds since the launch began, on the rank's clock
  double duration = 0;                   ///< seconds on the rank's clock (a message: its
                                         ///< transfer, which holds the link; alpha follows)
  double wall_start = 0;                 ///< wall seconds since the launch began
  double wall_duration = 0;              ///< wall seconds (communication: from issue to completion)
  double flops = 0;                      ///< compute: floating-point operations charged
  std::uint64_t bytes = 0;               ///< compute: bytes of memory traffic; communication:
                                         ///< bytes sent plus received on this rank's link
  int peer = -1;                         ///< point-to-point: the other rank; else -1
};

/// The time a rank spent on one training step: the interval between two step marks.
struct StepSummary {
  int step = 0;                      ///< 1-based step number
  double start = 0;                  ///< the step's first mark, seconds
  double total = 0;                  ///< seconds between its two marks
  double compute = 0;                ///< seconds of compute ops in the step
  double communication = 0;          ///< seconds the link was busy in the step (union)
  double exposed_communication = 0;  ///< seconds the link was busy and compute was not
  double overlap_fraction = 0;       ///< 1 - exposed / communication (0 without communication)
  std::uint64_t link_bytes = 0;      ///< bytes sent plus received by communication ops
                                     ///< that started in the step
};

/// Everything one rank's clock recorded.
struct RankTrace {
  int rank = 0;            ///< the rank
  bool simulated = false;  ///< times are virtual (simulated clock) or wall
  std::string
      clock_description;  ///< e.g. "simulated: ib-ndr (alpha 2 us, 50 GB/s); device a100 ..."
  std::vector<TraceEvent> events;  ///< in the order they were recorded
  std::vector<double> step_marks;  ///< compute times at which `Clock::mark_step` was called
  /// Steps that were summarized and then dropped from `events` and `step_marks` because the
  /// clock keeps no trace (`SimulationOptions::record_trace` off), which keeps its memory
  /// constant over a long run: `step` counts them and every other field holds their sum
  /// (`start` is unused). `mean_step` includes them; `summarize_steps` cannot.
  StepSummary folded{};
};

/// One summary per pair of consecutive step marks of `trace`. Communication that spans a
/// mark is split at it.
std::vector<StepSummary> summarize_steps(const RankTrace& trace);

/// The mean over steps of each field of `steps` (`step` is the number of steps; `start` 0).
StepSummary mean_of(std::span<const StepSummary> steps);

/// The mean over every step of `trace`, its folded steps included: the same bits as
/// `mean_of(summarize_steps(trace))` would give had nothing been folded.
StepSummary mean_step(const RankTrace& trace);

/// Adds each field of `step` to `sum` (`sum.step` counts the steps added; `start` is left
/// alone): how `mean_of` and `RankTrace::folded` accumulate.
void add_step(StepSummary& sum, const StepSummary& step);

/// Chrome Trace Event JSON of every rank's events: {"traceEvents": [...], "displayTimeUnit":
/// "ns", "otherData": {...}} with one complete ("ph": "X") event per op (ts and dur in
/// microseconds of the rank's clock, relative to the launch), process_name and thread_name
/// metadata events, and each rank's step summaries under "otherData".
std::string chrome_trace_json(std::span<const RankTrace> traces);

/// Writes `chrome_trace_json(traces)` to `path` as dp/output_file.h describes (a whole file
/// or none; only a regular file is replaced); throws `dp::Error` if it cannot.
void write_chrome_trace(const std::string& path, std::span<const RankTrace> traces);

}  // namespace dp
