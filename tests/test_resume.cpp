// Resumable training: a run stopped at step k and resumed from its checkpoint ends bitwise
// where the uninterrupted run ends, parameters and optimizer state alike. These tests run
// on the local backend (dp_unit_tests) and under mpiexec (dp_mpi_tests); under mpi rank 0
// writes the checkpoint and every process reads it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "comm_test_support.h"
#include "dp/launch.h"
#include "dp/trainer.h"

namespace dp {
namespace {

struct ResumeCase {
  const char* optimizer;
  float lr;
  float momentum;
  int world_size;
};

/// What a run leaves on one rank: parameters, then every optimizer state, as raw floats.
std::vector<float> final_state(const TrainResult& result) {
  std::vector<float> state = result.model.flat_parameters();
  for (const OptimizerState& entry : result.optimizer->state())
    state.insert(state.end(), entry.tensor->span().begin(), entry.tensor->span().end());
  state.push_back(static_cast<float>(result.optimizer->step_count()));
  return state;
}

class ResumedTraining : public ::testing::TestWithParam<ResumeCase> {};

TEST_P(ResumedTraining, EndsBitwiseWhereTheUninterruptedRunEnds) {
  const ResumeCase setup = GetParam();
  TrainOptions options;
  options.model = "16-32-32-4";
  options.dataset = "synthetic:300";
  options.global_batch = 60;  // 5 steps per epoch: the resumed part crosses an epoch
  options.steps = 13;
  options.optimizer = setup.optimizer;
  options.lr = setup.lr;
  options.momentum = setup.momentum;
  options.seed = 5;
  const Dataset data =
      make_synthetic_classification({.samples = 300, .features = 16, .classes = 4, .seed = 5});
  // The same path on every process; only rank 0 writes it.
  std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
  std::replace(name.begin(), name.end(), '/', '_');
  const std::string file =
      (std::filesystem::path(::testing::TempDir()) / ("dplab_resume_" + name + ".safetensors"))
          .string();

  if (mpi_world_rank() == 0) std::filesystem::remove(file);  // no stale file can pass for ours
  // One slot per rank (ranks are threads on the local backend); under mpi only this
  // process's rank is filled.
  const auto slots = static_cast<std::size_t>(setup.world_size);
  std::vector<std::vector<float>> uninterrupted(slots);
  launch(testing::test_launch(setup.world_size), [&](Communicator& comm) {
    uninterrupted[comm.rank()] = final_state(train_data_parallel(options, data, comm));
  });

  // The first part: checkpoints after steps 4 and 8; the run "dies" after step 8.
  TrainOptions first_part = options;
  first_part.steps = 9;
  TrainCheckpointing saving;
  saving.every = 4;
  saving.save = [&](int step, const Model& model, Optimizer& optimizer) {
    save_training_checkpoint(file, options, model, optimizer, step, data.size(),
                             {.world_size = setup.world_size});
  };
  launch(testing::test_launch(setup.world_size),
         [&](Communicator& comm) { train_data_parallel(first_part, data, comm, {}, saving); });

  // Under mpi, processes outside the launch did not wait for rank 0 to write the file.
  launch(testing::test_launch(mpi_world_size()), [](Communicator& comm) { comm.barrier(); });
  const TrainingCheckpoint checkpoint = load_training_checkpoint(file, options, data.size());
  EXPECT_EQ(checkpoint.step, 8);
  EXPECT_EQ(checkpoint.info.at("epoch"), "1");
  EXPECT_EQ(checkpoint.info.at("batch_in_epoch"), "3");
  TrainCheckpointing resuming;
  resuming.resume_from = &checkpoint;
  std::vector<std::vector<float>> resumed(slots);
  launch(testing::test_launch(setup.world_size), [&](Communicator& comm) {
    resumed[comm.rank()] = final_state(train_data_parallel(options, data, comm, {}, resuming));
  });

  for (std::size_t rank = 0; rank < slots; ++rank) {
    const std::vector<float>& expected = uninterrupted[rank];
    const std::vector<float>& seen = resumed[rank];
    ASSERT_EQ(seen.size(), expected.size()) << "rank " << rank;
    std::size_t first_difference = 0;
    while (first_difference < seen.size() &&
           std::memcmp(&seen[first_difference], &expected[first_difference], sizeof(float)) == 0)
      ++first_difference;
    EXPECT_EQ(first_difference, seen.size())
        << "rank " << rank << ": the resumed run differs from the uninterrupted one at state "
        << "element " << first_difference << " of " << seen.size();
  }
}

std::string resume_case_name(const ::testing::TestParamInfo<ResumeCase>& info) {
  return std::string(info.param.optimizer) + (info.param.momentum > 0 ? "_momentum" : "") +
         "_ranks" + std::to_string(info.param.world_size);
}

INSTANTIATE_TEST_SUITE_P(OptimizersAndWorldSizes, ResumedTraining,
                         ::testing::Values(ResumeCase{"sgd", 0.1f, 0.0f, 1},
                                           ResumeCase{"sgd", 0.05f, 0.9f, 2},
                                           ResumeCase{"adamw", 0.01f, 0.0f, 3},
                                           ResumeCase{"adamw", 0.01f, 0.0f, 4}),
                         resume_case_name);

}  // namespace
}  // namespace dp
