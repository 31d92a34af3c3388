// grading.h: what every lab's checks share, so that a check reads as the property it
// grades.
//
// A check runs the student's code on several world sizes, each rank records what it
// found in a `Verdict`, and `run_on_ranks` turns every rank's findings into GoogleTest
// failures that name the world size and the rank. The same check runs on the local
// backend (ranks are threads of the check program) and under mpirun (each process is
// one rank, and the grade driver merges the processes' reports).
//
// Equivalence checks compare with the ground truth: `single_process_trajectory` trains
// on the global batch in one process and keeps the parameters after every step, and
// `compare_parameters` says where a replica differs and by how much.
//
// Example (a lab 2 check):
//
//   for (int world : dp::grading::world_sizes()) {
//     dp::grading::run_on_ranks(world, [&](dp::Communicator& comm, dp::grading::Verdict& v) {
//       dp::Model model = dp::make_model(options);
//       ...train with the student's averaging...
//       v.expect_empty(dp::grading::compare_with_rank0(model, comm), "after step 5");
//     });
//   }
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "dp/comm.h"
#include "dp/data.h"
#include "dp/launch.h"
#include "dp/model.h"
#include "dp/trainer.h"

namespace dp::grading {

/// The backend the checks run on: $DPLAB_TEST_BACKEND ("local" when unset), which the
/// grade driver sets.
Backend check_backend();

/// The grading seed of this run: $DPLAB_GRADE_SEED, which `dplab grade` sets (and prints;
/// `dplab grade --seed S` repeats a run). A check program started by hand without it uses
/// seed 1. Every draw of every check derives from it, the same in every process of an mpi
/// run.
std::uint64_t grade_seed();

/// Records a sentence that says what a check measured, for the score table and the
/// Gradescope output of a passed check ("replicas differ by 3.1e-02 after one step").
/// Thread-safe; call it from any rank's thread. Under mpi the driver shows rank 0's.
void note_measured(std::string sentence);

/// The sentences `note_measured` recorded since the last call, in order (the check
/// program's main() collects them at the end of every test).
std::vector<std::string> take_measured_notes();

/// The world sizes a check loops over: 1 to `largest` on the local backend; under mpi
/// 1 to the number of processes (at most `largest`), so `dplab grade --backend mpi -n 4`
/// runs 1, 2, 3 and 4 ranks.
std::vector<int> world_sizes(int largest = 5);

/// What one rank found during a check: a list of failures, each a sentence that says
/// what was expected and what was seen.
class Verdict {
 public:
  /// Records a failure.
  void fail(std::string message) { failures_.push_back(std::move(message)); }
  /// Records `finding` as a failure, prefixed with `context`, unless it is empty (the
  /// comparison helpers below return "" when all is well).
  void expect_empty(const std::string& finding, std::string_view context);
  /// True when nothing failed.
  bool passed() const { return failures_.empty(); }
  /// The failures, in the order they were recorded.
  const std::vector<std::string>& failures() const { return failures_; }

 private:
  std::vector<std::string> failures_;
};

/// A check's body on one rank.
using RankCheck = std::function<void(Communicator& comm, Verdict& verdict)>;

/// Runs `check` on `world_size` ranks of the check backend and reports as GoogleTest
/// failures, prefixed "world size W, rank R: ", every failure a rank recorded and any
/// exception a rank threw (a `dp::NotImplemented` of the skeleton, a `dp::CommError` of
/// a deadlock or a mismatched collective). A rank blocked for `hang_timeout` ends the
/// check with the runtime's hang report instead of the grader's time limit. Returns true
/// when every rank passed. Under mpi only this process's rank is reported here.
bool run_on_ranks(int world_size, const RankCheck& check,
                  std::chrono::milliseconds hang_timeout = std::chrono::seconds(30));

/// The position of flat element `index` of a tensor of `shape`, e.g. "[17, 3]".
std::string position_in(const std::vector<std::int64_t>& shape, std::size_t index);

/// Compares every parameter of `model` with `expected_flat` (a `Model::flat_parameters()`
/// of the same architecture). Returns "" when every element differs by at most
/// `tolerance`, else the parameter with the largest difference: "parameter fc1.weight
/// differs: max abs diff 4.1e-02 at [17, 3] (seen 0.1234, expected 0.0834); expected <=
/// 2e-06". A tolerance of 0 asks for bitwise equality.
std::string compare_parameters(const Model& model, std::span<const float> expected_flat,
                               float tolerance);

/// Compares this rank's parameters bitwise with rank 0's (which it receives with the
/// runtime's broadcast, so call it on every rank, after reading the counters you grade).
/// Returns "" when they are identical, else the first parameter and element that differ.
std::string compare_with_rank0(const Model& model, Communicator& comm);

/// The ground truth of an equivalence check: one process trained on the global batch.
struct Trajectory {
  /// `Model::flat_parameters()` after step 1, 2, ..., steps.
  std::vector<std::vector<float>> parameters_after_step;
  /// The largest |gradient| met (for `dp::equivalence_tolerance`).
  float max_abs_gradient = 0;
};

/// Trains `make_model(options)` in one process for `options.steps` steps, each on the
/// global batch `global_batch_indices(..., step, options.seed)`, with `frozen`
/// parameters frozen, and keeps the parameters after every step.
Trajectory single_process_trajectory(const TrainOptions& options, const Dataset& data,
                                     std::span<const std::string> frozen = {});

/// Rank `rank`'s slice of the global batch of `step`: rows [rank B/N, (rank+1) B/N) of
/// `global_batch_indices` (B = options.global_batch, N = world_size), as a batch.
Batch local_batch(const Dataset& data, const TrainOptions& options, int step, int rank,
                  int world_size);

/// The bytes this rank sends when it all-reduces buffers of `element_counts` float32
/// elements, one all-reduce each, on `comm`'s backend: measured by doing exactly that on
/// scratch buffers (so it equals the backend's own formula) with the counters restored
/// to zero afterwards. Call it on every rank.
std::uint64_t allreduce_bytes_sent(Communicator& comm, std::span<const std::size_t> element_counts);

}  // namespace dp::grading
