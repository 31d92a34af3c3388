// Mixed-precision training (dp::TrainOptions::precision): replicas bitwise each other and
// the one-process emulation of their 16-bit arithmetic (the reduce type's rounding and fp16's
// skipped steps included), 16 bytes per parameter with AdamW, the emulated device bitwise the
// host, a reduce type of neither kind refused, and the distance to the same run in float32
// within the tolerance `dplab train --verify` checks.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "dp/error.h"
#include "dp/launch.h"
#include "dp/memory.h"
#include "dp/trainer.h"
#include "test_support.h"

namespace {

std::string error_message(const std::function<void()>& action) {
  return dp::testing::message_of<dp::Error>(action);
}

// --- mixed-precision training ------------------------------------------------------------

dp::Dataset small_data() {
  dp::SyntheticOptions synthetic;
  synthetic.samples = 256;
  synthetic.features = 16;
  synthetic.classes = 4;
  synthetic.seed = 4;
  return dp::make_synthetic_classification(synthetic);
}

dp::TrainOptions mixed_options(dp::DataType precision, const char* optimizer) {
  dp::TrainOptions options;
  options.model = "16-32-32-4";
  options.dataset = "synthetic:256";
  options.global_batch = 48;  // a multiple of 1 to 4 ranks
  options.steps = 25;
  options.optimizer = optimizer;
  options.lr = std::string(optimizer) == "adamw" ? 0.01f : 0.05f;
  options.momentum = std::string(optimizer) == "adamw" ? 0.0f : 0.9f;
  options.weight_decay = 0.01f;
  options.seed = 6;
  options.precision = precision;
  return options;
}

struct RanksResult {
  std::vector<std::vector<float>> replicas;
  std::vector<std::int64_t> skipped;
  std::vector<std::int64_t> optimizer_steps;
};

RanksResult train_on_ranks(const dp::TrainOptions& options, const dp::Dataset& data, int world) {
  RanksResult out;
  out.replicas.resize(world);
  out.skipped.resize(world);
  out.optimizer_steps.resize(world);
  dp::launch({.world_size = world}, [&](dp::Communicator& comm) {
    const dp::TrainResult result = dp::train_data_parallel(options, data, comm);
    const auto r = static_cast<std::size_t>(comm.rank());
    out.replicas[r] = result.model.flat_parameters();
    out.skipped[r] = result.skipped_steps;
    out.optimizer_steps[r] = result.optimizer->step_count();
  });
  return out;
}

void expect_bitwise(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << what;
}

struct MixedCase {
  dp::DataType precision;
  bool float32_reduce;
  const char* optimizer;
  int world;
};

class MixedPrecisionTraining : public ::testing::TestWithParam<MixedCase> {};

// Every replica bitwise the same, and bitwise the one-process emulation of their arithmetic
// (the reduce type's rounding included): what `dplab train --verify` checks.
TEST_P(MixedPrecisionTraining, ReplicasAreBitwiseTheOneProcessEmulation) {
  const MixedCase setup = GetParam();
  dp::TrainOptions options = mixed_options(setup.precision, setup.optimizer);
  if (setup.float32_reduce) options.reduce_dtype = dp::DataType::kFloat32;
  const dp::Dataset data = small_data();
  const RanksResult ranks = train_on_ranks(options, data, setup.world);
  for (int r = 1; r < setup.world; ++r)
    expect_bitwise(ranks.replicas[r], ranks.replicas[0], "replica");
  const dp::TrainResult emulated = dp::train_emulating_data_parallel(options, data, setup.world);
  expect_bitwise(emulated.model.flat_parameters(), ranks.replicas[0], "emulation");
  EXPECT_EQ(emulated.skipped_steps, ranks.skipped[0]);
  // It trained: the parameters moved from the initial ones.
  dp::TrainOptions none = options;
  none.steps = 0;
  EXPECT_NE(dp::train_emulating_data_parallel(none, data, setup.world).model.flat_parameters(),
            ranks.replicas[0]);
}

std::string mixed_case_name(const ::testing::TestParamInfo<MixedCase>& info) {
  const MixedCase& setup = info.param;
  return std::string(setup.precision == dp::DataType::kBFloat16 ? "bf16" : "fp16") +
         (setup.float32_reduce ? "_fp32reduce_" : "_") + setup.optimizer + "_ranks" +
         std::to_string(setup.world);
}

INSTANTIATE_TEST_SUITE_P(PrecisionsReduceTypesOptimizersAndRanks, MixedPrecisionTraining,
                         ::testing::Values(MixedCase{dp::DataType::kBFloat16, false, "adamw", 1},
                                           MixedCase{dp::DataType::kBFloat16, false, "adamw", 4},
                                           MixedCase{dp::DataType::kBFloat16, true, "adamw", 4},
                                           MixedCase{dp::DataType::kBFloat16, false, "sgd", 3},
                                           MixedCase{dp::DataType::kFloat16, false, "adamw", 1},
                                           MixedCase{dp::DataType::kFloat16, false, "adamw", 4},
                                           MixedCase{dp::DataType::kFloat16, true, "sgd", 4}),
                         mixed_case_name);

TEST(MixedPrecisionTraining, TheEmulationSeesTheReduceType) {
  // A float32 reduce rounds once, a bf16 one after every addition: over 4 ranks they differ,
  // so an emulation of the wrong reduce type is not the ranks' bits (the check can fail).
  dp::TrainOptions options = mixed_options(dp::DataType::kBFloat16, "adamw");
  const dp::Dataset data = small_data();
  const RanksResult ranks = train_on_ranks(options, data, 4);
  options.reduce_dtype = dp::DataType::kFloat32;
  const std::vector<float> other =
      dp::train_emulating_data_parallel(options, data, 4).model.flat_parameters();
  EXPECT_NE(std::memcmp(other.data(), ranks.replicas[0].data(), other.size() * sizeof(float)), 0);
}

TEST(MixedPrecisionTraining, Float16OverflowsSkipTheSameStepsOnEveryRank) {
  // A loss scale of 2^40 overflows float16 at once: the first steps are skipped, the scale
  // halves each time until the gradients fit, then training goes on.
  dp::TrainOptions options = mixed_options(dp::DataType::kFloat16, "adamw");
  options.loss_scaling.initial_scale = 0x1.0p40f;
  options.loss_scaling.growth_interval = 5;  // and it grows into overflows again
  options.steps = 40;
  const dp::Dataset data = small_data();
  const RanksResult ranks = train_on_ranks(options, data, 4);
  EXPECT_GE(ranks.skipped[0], 10);
  EXPECT_LT(ranks.skipped[0], options.steps);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(ranks.skipped[r], ranks.skipped[0]) << "rank " << r;
    // A skipped step does not advance the optimizer (AdamW's bias correction).
    EXPECT_EQ(ranks.optimizer_steps[r], options.steps - ranks.skipped[0]) << "rank " << r;
    expect_bitwise(ranks.replicas[r], ranks.replicas[0], "replica");
  }
  const dp::TrainResult emulated = dp::train_emulating_data_parallel(options, data, 4);
  EXPECT_EQ(emulated.skipped_steps, ranks.skipped[0]);
  expect_bitwise(emulated.model.flat_parameters(), ranks.replicas[0], "emulation");
}

TEST(MixedPrecisionTraining, HoldsSixteenBytesPerParameterWithAdamW) {
  auto memory = std::make_shared<dp::RankMemory>();
  const dp::ScopedRankMemory bind(memory);
  const dp::TrainOptions options = mixed_options(dp::DataType::kBFloat16, "adamw");
  const dp::TrainResult result = dp::train_single_process(options, small_data());
  const std::size_t psi = result.model.num_parameters();
  const dp::MemoryTracker& tracker = memory->tracker();
  EXPECT_EQ(tracker.current(dp::MemoryCategory::kParameters), 2 * psi);
  EXPECT_EQ(tracker.current(dp::MemoryCategory::kGradients), 2 * psi);
  EXPECT_EQ(tracker.current(dp::MemoryCategory::kOptimizerState), 12 * psi);
}

TEST(MixedPrecisionTraining, RefusesAReduceTypeOfNeitherKind) {
  // A GPT and LayerNorm / GELU MLPs have 16-bit paths now (tests/test_gpt_16bit.cpp).
  dp::TrainOptions gpt = mixed_options(dp::DataType::kBFloat16, "adamw");
  gpt.model = "gpt";
  gpt.dataset = "fortunes";
  EXPECT_NO_THROW(dp::check_train_options(gpt));
  dp::TrainOptions gelu = mixed_options(dp::DataType::kFloat16, "sgd");
  gelu.activation = "gelu";
  gelu.layer_norm = true;
  EXPECT_NO_THROW(dp::check_train_options(gelu));
  dp::TrainOptions reduce = mixed_options(dp::DataType::kFloat16, "sgd");
  reduce.reduce_dtype = dp::DataType::kBFloat16;
  EXPECT_NE(error_message([&] { dp::check_train_options(reduce); }).find("gradients' own type"),
            std::string::npos);
}

class MixedPrecisionOnTheEmulatedDevice : public ::testing::Test {
 protected:
  void SetUp() override { dp::set_cuda_device_emulated(true); }
  void TearDown() override { dp::set_cuda_device_emulated(false); }
};

TEST_F(MixedPrecisionOnTheEmulatedDevice, TrainsBitwiseAsOnTheHost) {
  for (const dp::DataType precision : {dp::DataType::kBFloat16, dp::DataType::kFloat16}) {
    dp::TrainOptions options = mixed_options(precision, "adamw");
    options.steps = 10;
    const dp::Dataset data = small_data();
    const RanksResult host = train_on_ranks(options, data, 2);
    options.device = dp::Device::kCuda;
    const RanksResult device = train_on_ranks(options, data, 2);
    expect_bitwise(device.replicas[0], host.replicas[0], "device against host");
    expect_bitwise(device.replicas[1], host.replicas[0], "device replica");
    expect_bitwise(dp::train_emulating_data_parallel(options, data, 2).model.flat_parameters(),
                   host.replicas[0], "device emulation");
  }
}

// --- closeness to float32 (dplab train --verify) ------------------------------------------

/// The default MLP's options, shortened to 60 steps, with every step reported.
dp::TrainOptions close_options(dp::DataType precision, const char* optimizer) {
  dp::TrainOptions options;
  options.steps = 60;
  options.optimizer = optimizer;
  options.lr = std::string(optimizer) == "adamw" ? 0.003f : 0.1f;
  options.log_every = 1;
  options.precision = precision;
  return options;
}

// A correct mixed-precision run is within the tolerance of the same run in float32, on 1 and 4
// ranks, and float16 replays its skipped steps in float32.
TEST(MixedPrecisionCloseToFloat32, CorrectRunsAreWithinTheTolerance) {
  const dp::Dataset data = dp::load_dataset("synthetic", 0);
  for (const dp::DataType precision : {dp::DataType::kBFloat16, dp::DataType::kFloat16})
    for (const char* optimizer : {"sgd", "adamw"})
      for (const int world : {1, 4}) {
        const dp::TrainOptions options = close_options(precision, optimizer);
        const dp::TrainResult mixed = dp::train_emulating_data_parallel(options, data, world);
        const dp::Float32Comparison comparison =
            dp::compare_with_float32(options, data, world, mixed);
        EXPECT_TRUE(comparison.close())
            << dp::to_string(precision) << " " << optimizer << " on " << world << " ranks: gap "
            << comparison.relative_gap << ", tolerance " << comparison.tolerance;
        EXPECT_EQ(comparison.steps_compared, 15);
        EXPECT_EQ(comparison.unit_roundoff, dp::unit_roundoff_of(precision));
        EXPECT_GT(comparison.sensitivity, 0.0);  // the perturbed run moved
        EXPECT_GT(comparison.parameter_distance, 0.0);
      }
}

// The check can fail: a run whose update is wrong by the factor a forgotten average (8 ranks'
// gradients summed, not averaged) or a forgotten unscaling (float16's gradients still times
// S = 65536) gives is outside the tolerance, and a NaN loss is never close.
TEST(MixedPrecisionCloseToFloat32, AWrongUpdateIsNotClose) {
  const dp::Dataset data = dp::load_dataset("synthetic", 0);
  for (const dp::DataType precision : {dp::DataType::kBFloat16, dp::DataType::kFloat16}) {
    const dp::TrainOptions options = close_options(precision, "sgd");
    dp::TrainOptions summed = options;  // SGD at 8 times its rate
    summed.lr *= 8;
    const dp::Float32Comparison comparison = dp::compare_with_float32(
        options, data, 8, dp::train_emulating_data_parallel(summed, data, 8));
    EXPECT_FALSE(comparison.close())
        << dp::to_string(precision) << ": gap " << comparison.relative_gap << ", tolerance "
        << comparison.tolerance;
    dp::TrainResult broken = dp::train_emulating_data_parallel(options, data, 1);
    broken.reports.back().loss = std::numeric_limits<float>::quiet_NaN();
    EXPECT_FALSE(dp::compare_with_float32(options, data, 1, broken).close());
  }
  const dp::TrainOptions options = close_options(dp::DataType::kFloat16, "sgd");
  dp::TrainOptions not_unscaled = options;
  not_unscaled.lr *= 65536;
  EXPECT_FALSE(dp::compare_with_float32(options, data, 1,
                                        dp::train_emulating_data_parallel(not_unscaled, data, 1))
                   .close());
}

TEST(MixedPrecisionCloseToFloat32, NeedsEveryStepReported) {
  const dp::Dataset data = dp::load_dataset("synthetic", 0);
  dp::TrainOptions options = close_options(dp::DataType::kBFloat16, "sgd");
  options.log_every = 10;
  const dp::TrainResult mixed = dp::train_emulating_data_parallel(options, data, 1);
  const std::string message =
      error_message([&] { dp::compare_with_float32(options, data, 1, mixed); });
  EXPECT_NE(message.find("report every step (log_every 1), got 6 reports"), std::string::npos)
      << message;
  EXPECT_NE(error_message([] {
              dp::unit_roundoff_of(dp::DataType::kFloat32);
            }).find("expected bfloat16 or float16, got float32"),
            std::string::npos);
}

// steps_to_skip leaves out exactly those optimizer steps, as float16's overflows do.
TEST(MixedPrecisionCloseToFloat32, SkippedStepsReplayInFloat32) {
  const dp::Dataset data = small_data();
  dp::TrainOptions options = mixed_options(dp::DataType::kFloat32, "adamw");
  options.steps_to_skip = {2, 5};
  const dp::TrainResult skipping = dp::train_emulating_data_parallel(options, data, 2);
  EXPECT_EQ(skipping.optimizer->step_count(), options.steps - 2);
  options.steps_to_skip.clear();
  EXPECT_NE(dp::train_emulating_data_parallel(options, data, 2).model.flat_parameters(),
            skipping.model.flat_parameters());
  options.steps_to_skip = {0};
  EXPECT_NE(error_message([&] {
              dp::train_emulating_data_parallel(options, data, 2);
            }).find("steps_to_skip: step 0 is not a step of the run; expected 1 to 25"),
            std::string::npos);
}

/// The default model's runs the tolerance of `mixed_precision_loss_tolerance` is measured on.
struct LossGapCase {
  const char* optimizer;
  float lr;
  float momentum;
  int world;
};

constexpr LossGapCase kLossGapCases[] = {
    {"sgd", 0.1f, 0.0f, 1},    {"sgd", 0.1f, 0.0f, 4},     {"sgd", 0.05f, 0.9f, 1},
    {"sgd", 0.05f, 0.9f, 4},   {"adamw", 0.003f, 0.0f, 1}, {"adamw", 0.003f, 0.0f, 4},
    {"adamw", 0.01f, 0.0f, 1}, {"adamw", 0.01f, 0.0f, 4},
};

/// The seeds the calibration draws: DPLAB_CALIBRATION_DRAWS of them (ctest: one), else 10.
int calibration_seeds() {
  const char* text = std::getenv("DPLAB_CALIBRATION_DRAWS");
  return text != nullptr ? std::max(1, std::atoi(text)) : 10;
}

/// Measures the relative loss gap behind `mixed_precision_loss_tolerance`: the default MLP on
/// the synthetic set, 100 steps, SGD (with and without momentum) and AdamW at two learning
/// rates, 1 and 4 ranks, 16-bit and float32 reduction, each seed's mixed run against the same
/// run in float32, as `dplab train --verify` compares them. Fails when the worst gap exceeds
/// the worst the tolerance was derived from.
///
/// Why disabled: it measures the tolerance, not the code under test, and takes a minute. It
/// is not skipped: ctest runs it as mixed_precision_tolerance_calibration on a few seeds
/// (tests/CMakeLists.txt), so CI fails when a change makes mixed precision drift farther.
TEST(MixedPrecisionTraining, DISABLED_LossGapCalibration) {
  const int seeds = calibration_seeds();
  for (const dp::DataType precision : {dp::DataType::kBFloat16, dp::DataType::kFloat16}) {
    double worst = 0;  // of gap / (u + s)
    std::string worst_case;
    for (int seed = 0; seed < seeds; ++seed) {
      const dp::Dataset data = dp::load_dataset("synthetic", static_cast<std::uint64_t>(seed));
      for (const LossGapCase& c : kLossGapCases) {
        dp::TrainOptions options;
        options.optimizer = c.optimizer;
        options.lr = c.lr;
        options.momentum = c.momentum;
        options.seed = static_cast<std::uint64_t>(seed);
        options.log_every = 1;
        for (const bool float32_reduce : {false, true}) {
          dp::TrainOptions mixed = options;
          mixed.precision = precision;
          if (float32_reduce) mixed.reduce_dtype = dp::DataType::kFloat32;
          const dp::Float32Comparison comparison = dp::compare_with_float32(
              mixed, data, c.world, dp::train_emulating_data_parallel(mixed, data, c.world));
          const double ratio =
              comparison.relative_gap / (comparison.unit_roundoff + comparison.sensitivity);
          if (!(ratio <= worst)) {
            worst = ratio;
            worst_case = fmt::format(
                "{} lr {} momentum {}, {} ranks, seed {}, reduced in {}: gap {:.3g}, u {:.3g}, "
                "s {:.3g}",
                c.optimizer, c.lr, c.momentum, c.world, seed,
                float32_reduce ? "float32" : dp::to_string(precision), comparison.relative_gap,
                comparison.unit_roundoff, comparison.sensitivity);
          }
        }
      }
    }
    fmt::print("{}: worst gap / (u + s) = {:.3f} ({}); the tolerance allows {:.3f}\n",
               dp::to_string(precision), worst, worst_case,
               2 * dp::mixed_precision_worst_measured_ratio(precision));
    EXPECT_LE(worst, dp::mixed_precision_worst_measured_ratio(precision))
        << dp::to_string(precision)
        << ": mixed precision ends farther from float32 than the worst the tolerance was "
           "derived from: the headroom of dplab train --verify is shrinking";
  }
}

}  // namespace
