// speed_workload.h: what the speed checks of the sharded labs (5, 6 and 7) run on: one SGD
// step of an MLP of equal hidden layers (each layer's communication comparable to its
// compute, so that only a design that overlaps the two hides anything), on simulated ranks
// whose calls complete in the adversarial order.
//
// Example (lab 6's speed check):
//
//   const std::int64_t hidden = draws.integer("hidden", 512, 768);
//   const std::int64_t rows = draws.integer("rows per rank", 48, 64);
//   const TrainOptions options = grading::equal_layers_sgd_step(draws, hidden, 12, rows, 8);
//   launch(grading::simulated_launch(draws, 8, "10gbe", "cpu"), [&](Communicator& comm) {...});
#pragma once

#include <cstdint>
#include <string>

#include "dp/launch.h"
#include "dp/trainer.h"
#include "grading.h"

namespace dp::grading {

/// One SGD step (lr 0.01) of the MLP 64-h-...-h-10 with `layers` hidden ReLU layers of
/// `hidden` units, on a synthetic data set of `rows_per_rank` x `world` rows (the global
/// batch), its seed drawn from `draws` as "<prefix>seed".
TrainOptions equal_layers_sgd_step(Draws& draws, std::int64_t hidden, std::int64_t layers,
                                   std::int64_t rows_per_rank, int world,
                                   const std::string& prefix = "");

/// `world` simulated local ranks on the network preset `network` and the device preset
/// `device`, their calls completing in the adversarial order of `draws`' completion seed.
LaunchOptions simulated_launch(const Draws& draws, int world, const char* network,
                               const char* device);

}  // namespace dp::grading
