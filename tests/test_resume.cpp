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

/// Trains the first 9 steps of `options` on `world_size` ranks, saving `file` after steps 4
/// and 8: the run "dies" after step 8, and the caller resumes from the step-8 checkpoint.
/// Every process waits for rank 0's file (under mpi, processes outside the launch did not).
void train_saving_at_4_and_8(const TrainOptions& options, const Dataset& data, int world_size,
                             const std::string& file) {
  TrainOptions first_part = options;
  first_part.steps = 9;
  TrainCheckpointing saving;
  saving.every = 4;
  saving.save = [&](int step, const Model& model, Optimizer& optimizer,
                    const DynamicLossScaler* loss_scaler) {
    save_training_checkpoint(file, options, model, optimizer, step, data.size(),
                             {.world_size = world_size, .loss_scaler = loss_scaler});
  };
  launch(testing::test_launch(world_size),
         [&](Communicator& comm) { train_data_parallel(first_part, data, comm, {}, saving); });
  launch(testing::test_launch(mpi_world_size()), [](Communicator& comm) { comm.barrier(); });
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

  // Checkpoints after steps 4 and 8; the run "dies" after step 8.
  train_saving_at_4_and_8(options, data, setup.world_size, file);
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

// --- mixed precision ------------------------------------------------------------------------

struct MixedResumeCase {
  DataType precision;
  int world_size;
};

/// A mixed-precision run's state on one rank: the 16-bit parameters (widened exactly), the
/// float32 masters and the inner optimizer's state, both step counters, and fp16's scaler.
std::vector<float> mixed_state(const TrainResult& result) {
  std::vector<float> state = final_state(result);
  auto& mixed = dynamic_cast<MixedPrecisionOptimizer&>(*result.optimizer);
  state.push_back(static_cast<float>(mixed.inner().step_count()));
  if (result.loss_scaler) {
    state.push_back(result.loss_scaler->scale());
    state.push_back(static_cast<float>(result.loss_scaler->growth_tracker()));
    state.push_back(static_cast<float>(result.loss_scaler->skipped_steps()));
  }
  return state;
}

/// The index of the first element where `a` and `b` differ bitwise (their size if none).
std::size_t first_difference(const std::vector<float>& a, const std::vector<float>& b) {
  std::size_t i = 0;
  while (i < a.size() && i < b.size() && std::memcmp(&a[i], &b[i], sizeof(float)) == 0) ++i;
  return i;
}

class MixedPrecisionCheckpoint : public ::testing::Test {
 protected:
  /// AdamW on an MLP; fp16 starts at a loss scale of 2^40 that overflows, so the steps
  /// before the checkpoint include skipped ones, and grows every 3 clean steps, so the
  /// checkpoint falls in the middle of a growth interval.
  static TrainOptions mixed_options(DataType precision) {
    TrainOptions options;
    options.model = "16-32-32-4";
    options.dataset = "synthetic:300";
    options.global_batch = 60;
    options.steps = 13;
    options.optimizer = "adamw";
    options.lr = 0.01f;
    options.seed = 5;
    options.precision = precision;
    options.loss_scaling = {.initial_scale = 0x1.0p40f,
                            .growth_factor = 2.0f,
                            .backoff_factor = 0x1.0p-8f,
                            .growth_interval = 3};
    return options;
  }
  static Dataset data() {
    return make_synthetic_classification({.samples = 300, .features = 16, .classes = 4, .seed = 5});
  }
  static std::string file_for_test() {
    std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::replace(name.begin(), name.end(), '/', '_');
    return (std::filesystem::path(::testing::TempDir()) /
            ("dplab_resume_mixed_" + name + ".safetensors"))
        .string();
  }
  /// Each rank's state after training `options` (from `checkpointing`).
  static std::vector<std::vector<float>> run(const TrainOptions& options, const Dataset& data,
                                             int world_size,
                                             const TrainCheckpointing& checkpointing = {}) {
    std::vector<std::vector<float>> states(static_cast<std::size_t>(world_size));
    launch(testing::test_launch(world_size), [&](Communicator& comm) {
      states[comm.rank()] =
          mixed_state(train_data_parallel(options, data, comm, {}, checkpointing));
    });
    return states;
  }
};

class ResumedMixedPrecision : public MixedPrecisionCheckpoint,
                              public ::testing::WithParamInterface<MixedResumeCase> {};

TEST_P(ResumedMixedPrecision, EndsBitwiseWhereTheUninterruptedRunEnds) {
  const MixedResumeCase setup = GetParam();
  const TrainOptions options = mixed_options(setup.precision);
  const Dataset samples = data();
  const std::string file = file_for_test();
  if (mpi_world_rank() == 0) std::filesystem::remove(file);
  const std::vector<std::vector<float>> uninterrupted = run(options, samples, setup.world_size);

  // Checkpoints after steps 4 and 8; the run "dies" after step 8.
  train_saving_at_4_and_8(options, samples, setup.world_size, file);

  TrainingCheckpoint checkpoint = load_training_checkpoint(file, options, samples.size());
  EXPECT_EQ(checkpoint.step, 8);
  EXPECT_EQ(checkpoint.info.at("precision"), to_string(setup.precision));
  // The 16-bit parameters are saved as they are, the masters in float32.
  EXPECT_EQ(checkpoint.tensors.at("fc1.weight").dtype(), setup.precision);
  EXPECT_EQ(checkpoint.tensors.at("optimizer.master_weights").dtype(), DataType::kFloat32);
  if (setup.precision == DataType::kFloat16) {
    ASSERT_TRUE(checkpoint.loss_scaler.has_value());
    // The test is only worth something if steps were skipped before the checkpoint.
    EXPECT_GT(checkpoint.loss_scaler->skipped_steps(), 0);
    EXPECT_LT(checkpoint.optimizer_steps, checkpoint.step);
  } else {
    EXPECT_FALSE(checkpoint.loss_scaler.has_value());
  }
  TrainCheckpointing resuming;
  resuming.resume_from = &checkpoint;
  const std::vector<std::vector<float>> resumed = run(options, samples, setup.world_size, resuming);
  for (std::size_t rank = 0; rank < resumed.size(); ++rank) {
    ASSERT_EQ(resumed[rank].size(), uninterrupted[rank].size()) << "rank " << rank;
    EXPECT_EQ(first_difference(resumed[rank], uninterrupted[rank]), resumed[rank].size())
        << "rank " << rank << ": the resumed run differs from the uninterrupted one";
  }

  // The masters matter: resumed from masters that are only the widened 16-bit parameters
  // (what a checkpoint without them would give), the run ends elsewhere.
  Tensor& masters = checkpoint.tensors.at("optimizer.master_weights");
  {
    Model model = make_model(options);
    for (const Parameter* parameter : model.parameters()) {
      const Tensor widened = checkpoint.tensors.at(parameter->name).to(DataType::kFloat32);
      std::copy_n(widened.data(), widened.size(), masters.data() + parameter->offset);
    }
  }
  const std::vector<std::vector<float>> from_parameters =
      run(options, samples, setup.world_size, resuming);
  // (Under mpi only this process's rank has a state; the other slots stay empty.)
  for (std::size_t rank = 0; rank < resumed.size(); ++rank) {
    if (from_parameters[rank].empty()) continue;
    EXPECT_LT(first_difference(from_parameters[rank], uninterrupted[rank]), resumed[rank].size())
        << "rank " << rank << ": resuming without the masters ended where the run ends";
  }
}

TEST_F(MixedPrecisionCheckpoint, RefusesAnotherPrecisionNamingBoth) {
  for (const DataType precision : {DataType::kBFloat16, DataType::kFloat16}) {
    SCOPED_TRACE(to_string(precision));
    const MixedResumeCase setup{precision, 1};
    const TrainOptions options = mixed_options(setup.precision);
    const Dataset samples = data();
    const std::string file = file_for_test() + std::string(to_string(precision));
    if (mpi_world_rank() == 0) {
      const TrainResult result = train_single_process(options, samples);
      save_training_checkpoint(
          file, options, result.model, *result.optimizer, options.steps, samples.size(),
          {.loss_scaler = result.loss_scaler ? &*result.loss_scaler : nullptr});
    }
    launch(testing::test_launch(mpi_world_size()), [](Communicator& comm) { comm.barrier(); });
    for (const DataType other : {DataType::kFloat32, DataType::kBFloat16, DataType::kFloat16}) {
      if (other == setup.precision) continue;
      TrainOptions resumed = options;
      resumed.precision = other;
      try {
        load_training_checkpoint(file, resumed, samples.size());
        ADD_FAILURE() << "a " << to_string(setup.precision) << " checkpoint resumed in "
                      << to_string(other);
      } catch (const Error& error) {
        const std::string message = error.what();
        EXPECT_NE(message.find(std::string(to_string(setup.precision)) + " run"), std::string::npos)
            << message;
        EXPECT_NE(message.find(std::string("trains in ") + std::string(to_string(other))),
                  std::string::npos)
            << message;
      }
    }
    // A float32 checkpoint is not resumed in mixed precision either.
    TrainOptions float32 = options;
    float32.precision = DataType::kFloat32;
    const std::string float32_file = file + ".float32";
    if (mpi_world_rank() == 0) {
      const TrainResult result = train_single_process(float32, samples);
      save_training_checkpoint(float32_file, float32, result.model, *result.optimizer,
                               float32.steps, samples.size(), {});
    }
    launch(testing::test_launch(mpi_world_size()), [](Communicator& comm) { comm.barrier(); });
    try {
      load_training_checkpoint(float32_file, options, samples.size());
      ADD_FAILURE() << "a float32 checkpoint resumed in " << to_string(setup.precision);
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find("float32 run"), std::string::npos) << error.what();
    }
  }
}

std::string mixed_case_name(const ::testing::TestParamInfo<MixedResumeCase>& info) {
  return std::string(info.param.precision == DataType::kBFloat16 ? "bf16" : "fp16") + "_ranks" +
         std::to_string(info.param.world_size);
}

INSTANTIATE_TEST_SUITE_P(PrecisionsAndWorldSizes, ResumedMixedPrecision,
                         ::testing::Values(MixedResumeCase{DataType::kBFloat16, 1},
                                           MixedResumeCase{DataType::kBFloat16, 4},
                                           MixedResumeCase{DataType::kFloat16, 1},
                                           MixedResumeCase{DataType::kFloat16, 4}),
                         mixed_case_name);

}  // namespace
}  // namespace dp
