// grading.h: what every lab's checks share, so that a check reads as the property it
// grades: the run's seed and each check's draws, running a check on several ranks, and a
// verdict per rank that says what was expected and what was seen.
//
// A check draws its parameters (world sizes, sizes, steps, seeds) from the run's grading
// seed, so that a hard-coded answer fails and `dplab grade --seed S` repeats a run; runs
// the student's code on every drawn world size in the adversarial completion mode (a
// missing `wait()` fails every time); each rank records what it found in a `Verdict`, and
// `run_on_ranks` turns every rank's findings into GoogleTest failures that name the world
// size and the rank. On a pass a check says what it measured (`Verdict::note`): the lesson
// made visible in the score table. The same check runs on the local backend (ranks are
// threads of the check program) and under mpirun (each process is one rank).
//
// Example (a lab 2 check):
//
//   TEST(Lab2Flat, OneCollectivePerStep) {
//     dp::grading::Draws draws("Lab2Flat.OneCollectivePerStep");
//     const int steps = draws.integer("steps", 2, 5);
//     for (int world : draws.world_sizes()) {
//       dp::grading::run_on_ranks(world, [&](dp::Communicator& comm, dp::grading::Verdict& v) {
//         ...train with the student's averaging, read comm.counters() around each step...
//         if (calls != 1) v.fail(fmt::format("step {}: {} collective calls; expected 1", ...));
//         v.note(fmt::format("one all-reduce of {} bytes per step", bytes));
//       }, draws);
//     }
//   }
#pragma once

#include <fmt/format.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dp/comm.h"
#include "dp/error.h"
#include "dp/launch.h"
#include "dp/rng.h"

namespace dp::grading {

/// The backend the checks run on: $DPLAB_TEST_BACKEND ("local" when unset), which the
/// grade driver sets.
Backend check_backend();

/// The device the checks put the lab code's models and tensors on: $DPLAB_TEST_DEVICE,
/// which `dplab grade --device` sets: "host" (also when unset), "cuda" or "emulated" (both
/// `Device::kCuda`; see `use_check_device`). Checks build every model and tensor they hand
/// to lab code on it, and read results back through host copies.
Device check_device();

/// Turns the emulated CUDA device on when $DPLAB_TEST_DEVICE is "emulated" (then a device
/// tensor's host memory is off limits to lab code, as on a GPU; dp/tensor.h). The check
/// program's main() calls it before any test; throws `dp::Error` for an unknown name.
void use_check_device();

/// The grading seed of this run: $DPLAB_GRADE_SEED, which `dplab grade` sets (and prints;
/// `dplab grade --seed S` repeats a run). A check program started by hand without it uses
/// seed 1. Every draw of every check derives from it, the same in every process of an mpi
/// run.
std::uint64_t grade_seed();

/// The draws a tolerance calibration test makes: $DPLAB_CALIBRATION_DRAWS when set (ctest
/// runs the calibrations on a few), else `full` (the number the tolerance was derived on).
int calibration_draws(int full);

/// Records a sentence that says what a check measured, for the score table and the
/// Gradescope output of a passed check ("replicas differ by 3.1e-02 after one step").
/// Thread-safe; call it from any rank's thread. Under mpi the driver shows rank 0's.
void note_measured(std::string sentence);

/// The sentences `note_measured` recorded since the last call, in order (the check
/// program's main() collects them at the end of every test).
std::vector<std::string> take_measured_notes();

/// The parameters one check draws in one grading run, from a random stream of its own:
/// (grading seed, check name). Every value drawn is recorded by name, so that a failure
/// can say exactly which configuration failed ("drawn: steps=4 k=3 world sizes 1, 3, 4").
/// The same seed gives the same draws in every process and on every machine.
class Draws {
 public:
  /// The draws of the check called `check_name` (its GoogleTest name, "Suite.Name").
  explicit Draws(std::string_view check_name);

  /// An integer uniformly distributed in [low, high], recorded as `name`.
  std::int64_t integer(std::string_view name, std::int64_t low, std::int64_t high);
  /// A float uniformly distributed in [low, high), recorded as `name`.
  float uniform(std::string_view name, float low, float high);
  /// True or false with equal probability, recorded as `name`.
  bool coin(std::string_view name);
  /// A seed for a data set, a model or a sampler, recorded as `name`.
  std::uint64_t seed(std::string_view name);
  /// One of `choices`, uniformly, recorded as `name` (with its value).
  template <typename T>
  const T& pick(std::string_view name, const std::vector<T>& choices) {
    DP_CHECK(!choices.empty(), "draw {} from no choices", name);
    const T& choice = choices[rng_.below(choices.size())];
    record(name, fmt::format("{}", choice));
    return choice;
  }

  /// The world sizes a check runs on. On the local backend: 1, one of the sizes 3, 5 or 6
  /// that is at most `largest` (not a power of two: where g/N and g*(1/N) differ), and one
  /// more from 2..largest; under mpi every size from 1 to the number of processes (at most
  /// `largest`), since every process takes part in every launch anyway.
  std::vector<int> world_sizes(int largest = 6);

  /// Every value drawn so far, e.g. "seed 42: steps=4 k=3 lr=0.05".
  std::string describe() const;
  /// Opens a part of the description, e.g. "then SGD:" (shown as "[then SGD:]"): for a
  /// check that draws two set-ups one after the other. Draws nothing.
  void section(std::string_view title);
  /// Replaces the description of the last value drawn as `name` with `text`, for a value
  /// the check then set itself (e.g. "momentum=0.9 (set by the check)"), so that the
  /// description says what ran. Draws nothing; `name` must have been drawn.
  void overrule(std::string_view name, const std::string& text);
  /// The seed of the adversarial completion mode for runs of this check.
  std::uint64_t completion_seed() const { return completion_seed_; }
  /// Makes this check's `run_on_ranks` launches hold point-to-point calls and launch them in
  /// groups, one group after another, as nccl does (CommOptions::point_to_point_in_groups):
  /// code that hangs on nccl because its groups wait on each other deadlocks there too.
  void launch_point_to_point_in_groups() { point_to_point_in_groups_ = true; }
  /// Whether `launch_point_to_point_in_groups` was called.
  bool point_to_point_in_groups() const { return point_to_point_in_groups_; }

 private:
  void record(std::string_view name, const std::string& value);

  CounterRng rng_;
  std::uint64_t completion_seed_;
  bool point_to_point_in_groups_ = false;
  std::vector<std::string> drawn_;
};

/// What one rank found during a check: failures, each a sentence that says what was
/// expected and what was seen, and notes that say what was measured.
class Verdict {
 public:
  /// Records a failure.
  void fail(std::string message) { failures_.push_back(std::move(message)); }
  /// Records `finding` as a failure, prefixed with `context`, unless it is empty (the
  /// comparison helpers return "" when all is well).
  void expect_empty(const std::string& finding, std::string_view context);
  /// Records what was measured; rank 0's notes reach the score table.
  void note(std::string sentence) { notes_.push_back(std::move(sentence)); }
  /// True when nothing failed.
  bool passed() const { return failures_.empty(); }
  /// The failures, in the order they were recorded.
  const std::vector<std::string>& failures() const { return failures_; }
  /// The notes, in the order they were recorded.
  const std::vector<std::string>& notes() const { return notes_; }

 private:
  std::vector<std::string> failures_;
  std::vector<std::string> notes_;
};

/// A check's body on one rank.
using RankCheck = std::function<void(Communicator& comm, Verdict& verdict)>;

/// Runs `check` on `world_size` ranks of the check backend, in the adversarial completion
/// mode seeded by `draws`, and reports as GoogleTest failures, prefixed "world size W, rank
/// R: " and followed by the draws, every failure a rank recorded and any exception a rank
/// threw (a `dp::NotImplemented` of the skeleton, a `dp::CommError` of a deadlock or a
/// mismatched collective), with its type demangled. Rank 0's notes go to `note_measured`.
/// A rank blocked for `hang_timeout` ends the check with the runtime's hang report instead
/// of the grader's time limit. Returns true when every rank passed. Under mpi only this
/// process's rank is reported here. `backend` overrides the check backend: a check whose
/// lesson needs several ranks runs them as local threads in a one-process mpi job.
bool run_on_ranks(int world_size, const RankCheck& check, const Draws& draws,
                  std::chrono::milliseconds hang_timeout = std::chrono::seconds(30),
                  Backend backend = check_backend());

/// The bytes this rank sends when it all-reduces buffers of `element_counts` float32
/// elements, one call each, on `comm`: measured by doing exactly that on scratch buffers
/// (so it is the backend's own count, whatever its formula). Call it on every rank.
std::uint64_t allreduce_bytes_sent(Communicator& comm, std::span<const std::size_t> element_counts);

/// The readable name of the dynamic type of `error`, e.g. "dp::CommError".
std::string type_name(const std::exception& error);

}  // namespace dp::grading
