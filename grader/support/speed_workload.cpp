// speed_workload.cpp: see speed_workload.h.
#include "speed_workload.h"

#include <fmt/format.h>

namespace dp::grading {

TrainOptions equal_layers_sgd_step(Draws& draws, std::int64_t hidden, std::int64_t layers,
                                   std::int64_t rows_per_rank, int world,
                                   const std::string& prefix) {
  std::string spec = "64";
  for (std::int64_t layer = 0; layer < layers; ++layer) spec += fmt::format("-{}", hidden);
  TrainOptions options;
  options.model = spec + "-10";
  options.activation = "relu";
  options.global_batch = rows_per_rank * world;
  options.dataset = fmt::format("synthetic:{}", options.global_batch);
  options.seed = draws.seed(prefix + "seed");
  options.steps = 1;
  options.optimizer = "sgd";
  options.lr = 0.01f;
  return options;
}

LaunchOptions simulated_launch(const Draws& draws, int world, const char* network,
                               const char* device) {
  LaunchOptions launch_options;
  launch_options.world_size = world;
  launch_options.backend = Backend::kLocal;
  launch_options.comm.completion = Completion::kAdversarial;
  launch_options.comm.completion_seed = draws.completion_seed();
  launch_options.simulation.enabled = true;
  launch_options.simulation.network = NetworkModel::preset(network);
  launch_options.simulation.device = DeviceModel::preset(device);
  return launch_options;
}

}  // namespace dp::grading
