// Data-parallel training with the native all-reduce equals single-process training on
// the global batch, within the tolerance `equivalence_tolerance` derives, and leaves every
// replica bitwise identical.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <vector>

#include "comm_test_support.h"
#include "dp/error.h"
#include "dp/launch.h"
#include "dp/trainer.h"

namespace dp {
namespace {

float max_abs_difference(const std::vector<float>& a, const std::vector<float>& b) {
  float largest = 0;
  for (std::size_t i = 0; i < a.size(); ++i) largest = std::max(largest, std::abs(a[i] - b[i]));
  return largest;
}

struct EquivalenceCase {
  const char* optimizer;
  float lr;
  float momentum;
};

class DataParallelEquivalence : public ::testing::TestWithParam<std::tuple<int, EquivalenceCase>> {
};

TEST_P(DataParallelEquivalence, MatchesSingleProcessOnTheGlobalBatch) {
  const auto [world_size, setup] = GetParam();
  TrainOptions options;
  options.model = "16-32-32-4";
  options.dataset = "synthetic:600";
  options.global_batch = 60;  // divisible by 1, 2, 3, 4 and 5
  options.steps = 12;
  options.optimizer = setup.optimizer;
  options.lr = setup.lr;
  options.momentum = setup.momentum;
  options.seed = 3;
  SyntheticOptions synthetic;
  synthetic.samples = 600;
  synthetic.features = 16;
  synthetic.classes = 4;
  synthetic.seed = 3;
  const Dataset data = make_synthetic_classification(synthetic);

  const TrainResult baseline = train_single_process(options, data);
  const std::vector<float> expected = baseline.model.flat_parameters();
  std::vector<std::vector<float>> replicas(static_cast<std::size_t>(world_size));
  std::vector<float> max_gradients(static_cast<std::size_t>(world_size));
  launch(testing::test_launch(world_size), [&](Communicator& comm) {
    TrainResult result = train_data_parallel(options, data, comm);
    replicas[comm.rank()] = result.model.flat_parameters();
    max_gradients[comm.rank()] = result.max_abs_gradient;
  });
  if (testing::test_backend() == Backend::kMpi) return;  // other processes' replicas are not here

  const float tolerance = equivalence_tolerance(options, max_gradients[0]);
  const float difference = max_abs_difference(replicas[0], expected);
  EXPECT_LE(difference, tolerance) << world_size << " ranks differ from 1 rank by " << difference;
  // A tolerance this loose would hide nothing if training did not move the weights.
  const float moved = max_abs_difference(expected, make_model(options).flat_parameters());
  EXPECT_GT(moved, 100 * tolerance) << "training barely changed the parameters";
  for (int r = 1; r < world_size; ++r)
    EXPECT_EQ(std::memcmp(replicas[r].data(), replicas[0].data(), expected.size() * sizeof(float)),
              0)
        << "rank " << r << " is not bitwise identical to rank 0";
}

std::string case_name(const ::testing::TestParamInfo<std::tuple<int, EquivalenceCase>>& info) {
  const EquivalenceCase& setup = std::get<1>(info.param);
  return std::string(setup.optimizer) + (setup.momentum > 0 ? "_momentum" : "") + "_ranks" +
         std::to_string(std::get<0>(info.param));
}

INSTANTIATE_TEST_SUITE_P(WorldSizesAndOptimizers, DataParallelEquivalence,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 5),
                                            ::testing::Values(EquivalenceCase{"sgd", 0.1f, 0.0f},
                                                              EquivalenceCase{"sgd", 0.05f, 0.9f},
                                                              EquivalenceCase{"adamw", 0.01f,
                                                                              0.0f})),
                         case_name);

TEST(DataParallelTraining, WithoutAveragingTheReplicasWouldDiverge) {
  // The tolerance must be able to fail: summing instead of averaging (a missing divide by
  // the world size) is far outside it.
  TrainOptions options;
  options.model = "16-32-4";
  options.global_batch = 32;
  options.steps = 3;
  SyntheticOptions synthetic;
  synthetic.samples = 256;
  synthetic.features = 16;
  synthetic.classes = 4;
  const Dataset data = make_synthetic_classification(synthetic);
  const TrainResult baseline = train_single_process(options, data);
  TrainOptions doubled = options;
  doubled.lr *= 2;  // what summing over 2 ranks does to an SGD step
  const TrainResult wrong = train_single_process(doubled, data);
  EXPECT_GT(max_abs_difference(wrong.model.flat_parameters(), baseline.model.flat_parameters()),
            equivalence_tolerance(options, baseline.max_abs_gradient));
}

TEST(DataParallelTraining, GlobalBatchMustDivideAmongRanks) {
  TrainOptions options;
  options.global_batch = 10;
  options.steps = 1;
  const Dataset data = load_dataset("synthetic:100");
  try {
    launch(testing::test_launch(3),
           [&](Communicator& comm) { train_data_parallel(options, data, comm); });
    FAIL() << "expected dp::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of the world size 3"), std::string::npos)
        << e.what();
  }
}

TEST(DataParallelTraining, NanGradientIsReportedWithParameterRankAndStep) {
  SyntheticOptions synthetic;
  synthetic.samples = 64;
  Dataset data = make_synthetic_classification(synthetic);
  data.features.at(5, 3) = std::numeric_limits<float>::quiet_NaN();
  TrainOptions options;
  options.global_batch = 64;  // every sample, so the NaN is in step 1
  options.steps = 2;
  try {
    train_single_process(options, data);
    FAIL() << "expected dp::Error";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("step 1: the gradient of"), std::string::npos) << message;
    EXPECT_NE(message.find("nan"), std::string::npos) << message;
    EXPECT_NE(message.find("rank 0"), std::string::npos) << message;
  }
}

TEST(GlobalBatchIndices, EachEpochIsAPermutationAndTheOrderChangesPerEpoch) {
  constexpr std::size_t kSize = 100;
  constexpr std::int64_t kBatch = 30;  // 3 batches per epoch, 10 samples dropped
  std::set<std::size_t> seen;
  for (int step = 0; step < 3; ++step)
    for (std::size_t index : global_batch_indices(kSize, kBatch, step, 1)) {
      EXPECT_LT(index, kSize);
      EXPECT_TRUE(seen.insert(index).second) << "index " << index << " repeats within an epoch";
    }
  EXPECT_EQ(seen.size(), 90u);
  EXPECT_NE(global_batch_indices(kSize, kBatch, 0, 1), global_batch_indices(kSize, kBatch, 3, 1));
  EXPECT_EQ(global_batch_indices(kSize, kBatch, 4, 1), global_batch_indices(kSize, kBatch, 4, 1));
  EXPECT_NE(global_batch_indices(kSize, kBatch, 0, 1), global_batch_indices(kSize, kBatch, 0, 2));
  EXPECT_THROW(global_batch_indices(10, 11, 0, 1), Error);
}

}  // namespace
}  // namespace dp
