// Unit tests of the optimizers: hand-computed steps (momentum, weight decay, AdamW bias
// correction), updates of a slice, memory accounting, frozen parameters and bad input.
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "dp/error.h"
#include "dp/memory.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "dp/rng.h"
#include "test_support.h"

namespace {

// The message of the dp::Error that `action` throws (a test failure if it throws none).
std::string error_message(const std::function<void()>& action) {
  return dp::testing::message_of<dp::Error>(action);
}

std::vector<float> random_values(std::size_t count, std::uint64_t stream) {
  dp::CounterRng rng(11, stream);
  std::vector<float> values(count);
  for (float& value : values) value = rng.uniform(-1.0f, 1.0f);
  return values;
}

// Runs one step of `optimizer` on all of `params`.
void step(dp::Optimizer& optimizer, std::vector<float>& params, const std::vector<float>& grads) {
  optimizer.begin_step();
  optimizer.update(0, params, grads);
}

TEST(Sgd, PlainStepIsParamMinusLrTimesGrad) {
  dp::Sgd sgd(2, {.lr = 0.1f});
  std::vector<float> params = {1.0f, -2.0f};
  step(sgd, params, {0.5f, 0.25f});
  EXPECT_FLOAT_EQ(params[0], 0.95f);
  EXPECT_FLOAT_EQ(params[1], -2.025f);
  EXPECT_EQ(sgd.step_count(), 1);
  EXPECT_EQ(sgd.name(), "sgd");
}

TEST(Sgd, MomentumAndWeightDecayMatchHandComputedSteps) {
  // p = 1, g = 0.5 each step, lr 0.1, momentum 0.9, weight decay 0.1:
  //   step 1: d = 0.5 + 0.1 * 1    = 0.6,     buf = 0.6,                 p = 0.94
  //   step 2: d = 0.5 + 0.1 * 0.94 = 0.594,   buf = 0.54 + 0.594 = 1.134, p = 0.8266
  //   step 3: d = 0.58266,         buf = 1.0206 + 0.58266 = 1.60326,    p = 0.666274
  dp::Sgd sgd(1, {.lr = 0.1f, .momentum = 0.9f, .weight_decay = 0.1f});
  std::vector<float> params = {1.0f};
  const std::vector<float> grads = {0.5f};
  step(sgd, params, grads);
  EXPECT_NEAR(params[0], 0.94, 1e-6);
  step(sgd, params, grads);
  EXPECT_NEAR(params[0], 0.8266, 1e-6);
  step(sgd, params, grads);
  EXPECT_NEAR(params[0], 0.666274, 1e-6);
  EXPECT_NEAR((*sgd.state()[0].tensor)[0], 1.60326, 1e-5);
}

TEST(AdamW, MatchesHandComputedStepsWithBiasCorrection) {
  // lr 0.1, betas (0.9, 0.999), eps 1e-8, weight decay 0.1.
  // Element 0: constant gradient 0.5. With bias correction mhat = 0.5 and vhat = 0.25
  // every step, so each step decays by 0.99 and then moves by exactly lr:
  //   0.99 - 0.1 = 0.89, 0.89 * 0.99 - 0.1 = 0.7811, 0.7811 * 0.99 - 0.1 = 0.673289.
  // (Without the correction the first step would move by 0.1 * 0.05 / sqrt(0.00025) = 0.32.)
  // Element 1: p = -0.5, gradients -1, 2, 0.25; worked out in double precision.
  dp::AdamW adam(2,
                 {.lr = 0.1f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.1f});
  std::vector<float> params = {1.0f, -0.5f};
  step(adam, params, {0.5f, -1.0f});
  EXPECT_NEAR(params[0], 0.89, 1e-6);
  EXPECT_NEAR(params[1], -0.395, 1e-6);
  step(adam, params, {0.5f, 2.0f});
  // Element 1, step 2: p = -0.395 * 0.99; m = 0.11; v = 0.004999;
  // mhat = 0.11 / 0.19, vhat = 0.004999 / 0.001999; p -= 0.1 * mhat / sqrt(vhat).
  EXPECT_NEAR(params[0], 0.7811, 1e-6);
  EXPECT_NEAR(params[1], -0.42766035, 1e-6);
  step(adam, params, {0.5f, 0.25f});
  EXPECT_NEAR(params[0], 0.673289, 1e-6);
  EXPECT_NEAR(params[1], -0.45861035, 1e-6);
  EXPECT_EQ(adam.step_count(), 3);
  EXPECT_EQ(adam.state().size(), 2u);
  EXPECT_EQ(adam.state()[0].name, "exp_avg");
}

// Updating a slice touches only that slice and gives what a full update gives there.
template <typename MakeOptimizer>
void check_slice_update(const MakeOptimizer& make) {
  const std::size_t size = 10;
  const std::vector<float> initial = random_values(size, 1);
  std::vector<float> full = initial;
  std::vector<float> sliced = initial;
  std::vector<float> pieces = initial;
  auto full_optimizer = make(size);
  auto slice_optimizer = make(size);
  auto pieces_optimizer = make(size);
  for (std::uint64_t s = 0; s < 3; ++s) {
    const std::vector<float> grads = random_values(size, 10 + s);
    step(*full_optimizer, full, grads);
    slice_optimizer->begin_step();
    slice_optimizer->update(3, std::span(sliced).subspan(3, 4), std::span(grads).subspan(3, 4));
    pieces_optimizer->begin_step();
    pieces_optimizer->update(0, std::span(pieces).first(3), std::span(grads).first(3));
    pieces_optimizer->update(3, std::span(pieces).subspan(3, 5), std::span(grads).subspan(3, 5));
    pieces_optimizer->update(8, std::span(pieces).subspan(8), std::span(grads).subspan(8));
  }
  for (std::size_t i = 0; i < size; ++i) {
    if (i >= 3 && i < 7)
      EXPECT_EQ(sliced[i], full[i]) << i;  // bitwise: same formula on the same state
    else
      EXPECT_EQ(sliced[i], initial[i]) << i;
    EXPECT_NE(full[i], initial[i]) << i;
  }
  EXPECT_EQ(pieces, full);
}

TEST(Optimizer, SliceUpdateMatchesTheSameSliceOfAFullUpdate) {
  check_slice_update([](std::size_t size) {
    return std::make_unique<dp::Sgd>(
        size, dp::SgdOptions{.lr = 0.1f, .momentum = 0.9f, .weight_decay = 0.01f});
  });
  check_slice_update([](std::size_t size) {
    return std::make_unique<dp::AdamW>(size, dp::AdamWOptions{.lr = 0.01f});
  });
}

TEST(Optimizer, StateIsChargedAsOptimizerState) {
  auto memory = std::make_shared<dp::RankMemory>();
  dp::ScopedRankMemory bind(memory);
  const auto state_bytes = [&] {
    return memory->tracker().current(dp::MemoryCategory::kOptimizerState);
  };
  {
    dp::AdamW adam(1000, {});
    EXPECT_EQ(state_bytes(), 2u * 4 * 1000);
  }
  EXPECT_EQ(state_bytes(), 0u);
  {
    dp::Sgd with_momentum(1000, {.momentum = 0.9f});
    EXPECT_EQ(state_bytes(), 4u * 1000);
    dp::Sgd plain(1000, {});
    EXPECT_EQ(state_bytes(), 4u * 1000);  // no buffer without momentum
    EXPECT_TRUE(plain.state().empty());
  }
}

TEST(Optimizer, RejectsBadRangesAndSizes) {
  dp::Sgd sgd(10, {});
  std::vector<float> params(5);
  std::vector<float> grads(5);
  EXPECT_NE(error_message([&] { sgd.update(0, params, grads); }).find("call begin_step() first"),
            std::string::npos);
  sgd.begin_step();
  EXPECT_EQ(error_message([&] { sgd.update(8, params, grads); }),
            "sgd update of elements [8, 13) is outside its state of 10 elements");
  std::vector<float> fewer(4);
  EXPECT_EQ(error_message([&] { sgd.update(0, params, fewer); }),
            "sgd update got 5 parameters but 4 gradients");
  sgd.update(5, params, grads);  // exactly at the end is fine
  EXPECT_THROW(dp::Sgd(1, {.lr = -0.1f}), dp::Error);
  EXPECT_THROW(dp::AdamW(1, {.beta1 = 1.0f}), dp::Error);
  EXPECT_THROW(dp::AdamW(1, {.eps = 0.0f}), dp::Error);
}

TEST(Optimizer, MakeOptimizerByName) {
  auto sgd = dp::make_optimizer("sgd", 4, 0.1f, 0.9f, 0.0f);
  EXPECT_EQ(sgd->name(), "sgd");
  EXPECT_EQ(sgd->state_size(), 4u);
  EXPECT_EQ(sgd->state().size(), 1u);  // momentum buffer
  auto adam = dp::make_optimizer("adamw", 4, 1e-3f, 0.0f, 0.01f);
  EXPECT_EQ(adam->name(), "adamw");
  EXPECT_EQ(error_message([] { dp::make_optimizer("adam", 4, 0.1f, 0.0f, 0.0f); }),
            "unknown optimizer \"adam\"; expected \"sgd\" or \"adamw\"");
}

TEST(Optimizer, StepUpdatesEveryTrainableParameterOfAModel) {
  dp::Model model = dp::Model::mlp("3-4-2", {.seed = 1});
  model.freeze("fc1.weight");
  const dp::Tensor input = [] {
    dp::Tensor x({2, 3});
    x.fill(0.5f);
    return x;
  }();
  const std::vector<int> labels = {0, 1};
  model.backward(model.forward(input), labels);
  // A gradient the optimizer must ignore: stepping a frozen parameter would move it.
  model.parameter("fc1.weight").grad.fill(1.0f);
  const std::vector<float> before = model.flat_parameters();
  const std::vector<float> grads = model.flat_gradients();

  dp::Sgd sgd(model.num_parameters(), {.lr = 0.5f});
  sgd.step(model);
  const std::vector<float> after = model.flat_parameters();
  const dp::Parameter& frozen = model.parameter("fc1.weight");
  std::size_t changed = 0;
  for (std::size_t i = 0; i < after.size(); ++i) {
    const bool is_frozen = i >= frozen.offset && i < frozen.offset + frozen.value.size();
    EXPECT_EQ(after[i], is_frozen ? before[i] : before[i] - 0.5f * grads[i]) << i;
    changed += after[i] != before[i] ? 1 : 0;
  }
  EXPECT_GT(changed, model.num_trainable_parameters() / 2);  // the step did move the rest
  EXPECT_EQ(sgd.step_count(), 1);
}

}  // namespace
