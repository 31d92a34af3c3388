// speed_workload.h: what the speed checks of the sharded labs (5, 6 and 7) run on: one SGD
// step of an MLP of equal hidden layers (each layer's communication comparable to its
// compute, so that only a design that overlaps the two hides anything), on simulated ranks
// whose calls complete in the adversarial order; and what those timed runs must still
// compute: the contract's parameters, bitwise (a design could otherwise give up the
// arithmetic on the models that are only timed, since their checks read the clock alone).
//
// Example (lab 6's speed check):
//
//   const std::int64_t hidden = draws.integer("hidden", 512, 768);
//   const std::int64_t rows = draws.integer("rows per rank", 48, 64);
//   const TrainOptions options = grading::equal_layers_sgd_step(draws, hidden, 12, rows, 8);
//   grading::TimedRunNumbers numbers(grading::speed_workload_parameters(options, data, 8, 1));
//   launch(grading::simulated_launch(draws, 8, "10gbe", "cpu"), [&](Communicator& comm) {
//     ...the timed step with the student's optimizer, then, its timing read:
//     numbers.compare_parameters("ZeRO-2", comm.rank(), model, 1);
//   });
//   numbers.report(fmt::format("on 8 ranks, {}", options.model), draws);
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "dp/data.h"
#include "dp/launch.h"
#include "dp/model.h"
#include "dp/trainer.h"
#include "grading.h"

namespace dp::grading {

/// One SGD step (lr 0.01) of the MLP 64-h-...-h-10 with `layers` hidden ReLU layers of
/// `hidden` units, on a synthetic data set of `rows_per_rank` x `world` rows (the global
/// batch), its seed drawn from `draws` as "<prefix>seed".
TrainOptions equal_layers_sgd_step(Draws& draws, std::int64_t hidden, std::int64_t layers,
                                   std::int64_t rows_per_rank, int world,
                                   const std::string& prefix = "");

/// A device whose compute costs nothing: the alpha-beta model has no gamma, so a check that
/// fits or compares network formulas times the network alone (and its own copies cost no
/// simulated time).
DeviceModel free_compute_device();

/// `world` simulated local ranks on the network preset `network` and the device preset
/// `device`, their calls completing in the adversarial order of `draws`' completion seed.
LaunchOptions simulated_launch(const Draws& draws, int world, const char* network,
                               const char* device);

/// Lab 2's arithmetic on a speed workload, emulated in one process on the check device: the
/// flat parameters after each of `steps` steps of `options`' model (a fresh
/// `make_check_model`) and optimizer on `world` ranks, every step on every rank's batch 0
/// (`local_batch(data, options, 0, rank, world)`: what each speed check hands every rank at
/// every step it times), the local gradients summed in rank order as `ReduceOp::kSum` adds,
/// divided by N, then the optimizer's step. Element s holds the parameters after step s + 1:
/// what the timed runs of the same steps must leave, bitwise. Sets BLAS to one thread, as
/// `dp::launch` does for the ranks (a product's bits depend on how many threads share it).
/// One thread is cheaper here than as many as ranks: the cores are few, and the ranks would
/// take turns on them.
std::vector<std::vector<float>> speed_workload_parameters(const TrainOptions& options,
                                                          const Dataset& data, int world,
                                                          int steps);

/// The numbers of a speed check's timed runs. Every rank of every run compares what the
/// lab's code left with `after_step` (computed once per check, e.g. by
/// `speed_workload_parameters`) once the run's timing is read, from its own thread; the
/// check then reports every run whose numbers differ as one failure. Without it a design
/// could give up the arithmetic (skip a division, a copy, an update) on the models that are
/// only timed: the lab 4 student re-trial's cheat did, and scored full marks.
class TimedRunNumbers {
 public:
  /// `after_step[s]`: the flat parameters the contract gives after step s + 1.
  explicit TimedRunNumbers(std::vector<std::vector<float>> after_step);

  /// The flat parameters after step `step` (1-based).
  const std::vector<float>& after_step(int step) const;

  /// Records `finding` of rank `rank` in the run named `run` ("ZeroTwoOptimizer, kReduceOnce");
  /// an empty finding records nothing. Thread-safe.
  void record(std::string_view run, int rank, std::string finding);

  /// Compares `model`'s parameters bitwise with `after_step(step)` and records any
  /// difference (`compare_parameters`'s finding). Thread-safe.
  void compare_parameters(std::string_view run, int rank, const Model& model, int step);

  /// Fails the running test (one GoogleTest failure naming `where`, each run that differs
  /// with its lowest rank's finding, and `draws`) when a rank recorded a finding. Returns
  /// true when none did.
  bool report(std::string_view where, const Draws& draws) const;

 private:
  std::vector<std::vector<float>> after_step_;
  mutable std::mutex mutex_;
  struct Finding {
    std::string run;
    int rank = 0;
    std::string text;
  };
  std::vector<Finding> findings_;
};

}  // namespace dp::grading
