// DynamicLossScaler: PyTorch GradScaler's defaults and update rule, the unscaling, and the
// overflow decision agreed across ranks when each rank sees only its own gradients.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "dp/error.h"
#include "dp/launch.h"
#include "dp/loss_scaler.h"
#include "dp/tensor_ops.h"

namespace dp {
namespace {

constexpr float kInfinity = std::numeric_limits<float>::infinity();

TEST(LossScaler, DefaultsAreGradScalers) {
  // torch.amp.GradScaler(init_scale=2.**16, growth_factor=2.0, backoff_factor=0.5,
  // growth_interval=2000).
  DynamicLossScaler scaler;
  EXPECT_EQ(scaler.scale(), 65536.0f);
  EXPECT_EQ(scaler.options().growth_factor, 2.0f);
  EXPECT_EQ(scaler.options().backoff_factor, 0.5f);
  EXPECT_EQ(scaler.options().growth_interval, 2000);
  EXPECT_EQ(scaler.growth_tracker(), 0);
  EXPECT_EQ(scaler.skipped_steps(), 0);
}

TEST(LossScaler, GrowsAfterTheIntervalAndBacksOffOnAnOverflow) {
  DynamicLossScaler scaler({.initial_scale = 8.0f, .growth_interval = 3});
  scaler.update(false);
  scaler.update(false);
  EXPECT_EQ(scaler.scale(), 8.0f);
  EXPECT_EQ(scaler.growth_tracker(), 2);
  scaler.update(false);  // the third clean step in a row: S doubles, the count restarts
  EXPECT_EQ(scaler.scale(), 16.0f);
  EXPECT_EQ(scaler.growth_tracker(), 0);
  scaler.update(false);
  scaler.update(true);  // an overflow halves S and restarts the count
  EXPECT_EQ(scaler.scale(), 8.0f);
  EXPECT_EQ(scaler.growth_tracker(), 0);
  EXPECT_EQ(scaler.skipped_steps(), 1);
  scaler.update(false);
  scaler.update(false);
  EXPECT_EQ(scaler.scale(), 8.0f);  // two clean steps since the overflow: not yet
}

TEST(LossScaler, NeverGrowsToInfinity) {
  DynamicLossScaler scaler({.initial_scale = std::ldexp(1.0f, 127), .growth_interval = 1});
  scaler.update(false);  // 2^128 is not a float: PyTorch keeps the scale
  EXPECT_EQ(scaler.scale(), std::ldexp(1.0f, 127));
  EXPECT_EQ(scaler.growth_tracker(), 0);
}

TEST(LossScaler, AScaleThatCollapsesIsAnErrorNotAnEndlessSkip) {
  DynamicLossScaler scaler({.initial_scale = 4.0f});
  for (int step = 0; step < 128; ++step)
    scaler.update(true);  // 4 / 2^128 = 2^-126, the smallest normal
  try {
    scaler.update(true);
    ADD_FAILURE() << "a scale below the smallest normal float was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("not finite at any scale"), std::string::npos)
        << error.what();
  }
}

TEST(LossScaler, RefusesSettingsOutOfRange) {
  EXPECT_THROW(DynamicLossScaler({.initial_scale = 0.0f}), Error);
  EXPECT_THROW(DynamicLossScaler({.initial_scale = kInfinity}), Error);
  EXPECT_THROW(DynamicLossScaler({.growth_factor = 1.0f}), Error);
  EXPECT_THROW(DynamicLossScaler({.backoff_factor = 1.0f}), Error);
  EXPECT_THROW(DynamicLossScaler({.backoff_factor = 0.0f}), Error);
  EXPECT_THROW(DynamicLossScaler({.growth_interval = 0}), Error);
  DynamicLossScaler scaler({.growth_interval = 10});
  EXPECT_THROW(scaler.restore(-1.0f, 0, 0), Error);
  EXPECT_THROW(scaler.restore(1.0f, 10, 0), Error);
  EXPECT_THROW(scaler.restore(1.0f, 0, -1), Error);
  scaler.restore(1024.0f, 9, 3);
  EXPECT_EQ(scaler.scale(), 1024.0f);
  EXPECT_EQ(scaler.growth_tracker(), 9);
  EXPECT_EQ(scaler.skipped_steps(), 3);
}

TEST(LossScaler, UnscalesByTheReciprocalAndFindsNonFiniteValues) {
  DynamicLossScaler scaler({.initial_scale = 1024.0f});
  Tensor first = Tensor::from(std::vector<float>{2048.0f, -512.0f, 3.0f});
  Tensor second = Tensor::from(std::vector<float>{1.0f});
  std::vector<TensorView> gradients{first.view(), second.view()};
  EXPECT_FALSE(scaler.unscale(gradients));
  EXPECT_EQ(first[0], 2.0f);
  EXPECT_EQ(first[1], -0.5f);
  EXPECT_EQ(first[2], 3.0f / 1024.0f);  // a power of two: exact
  EXPECT_EQ(second[0], 1.0f / 1024.0f);

  second[0] = std::nanf("");
  EXPECT_TRUE(scaler.unscale(gradients));
  first[1] = kInfinity;
  second[0] = 1.0f;
  EXPECT_TRUE(scaler.unscale(gradients));
}

// Each rank holds a shard of the gradients, as under ZeRO-2: only `overflowing_rank` has a
// non-finite value; every rank must still skip.
void expect_every_rank_agrees(int overflowing_rank) {
  constexpr int kRanks = 4;
  std::vector<int> answers(kRanks, -1);
  launch({.world_size = kRanks}, [&](Communicator& comm) {
    DynamicLossScaler scaler({.initial_scale = 4.0f});
    Tensor shard = Tensor::from(std::vector<float>{4.0f, 8.0f});
    if (comm.rank() == overflowing_rank) shard[1] = kInfinity;
    std::vector<TensorView> gradients{shard.view()};
    const bool overflow = scaler.unscale_and_check(comm, gradients);
    answers[static_cast<std::size_t>(comm.rank())] = overflow ? 1 : 0;
    EXPECT_EQ(shard[0], 1.0f);  // unscaled whatever the decision
  });
  const int expected = overflowing_rank >= 0 ? 1 : 0;
  for (int rank = 0; rank < kRanks; ++rank) {
    EXPECT_EQ(answers[static_cast<std::size_t>(rank)], expected)
        << "rank " << rank << ", overflow on rank " << overflowing_rank;
  }
}

TEST(LossScaler, EveryRankSkipsWhenAnyRankOverflows) {
  expect_every_rank_agrees(-1);  // none
  expect_every_rank_agrees(0);
  expect_every_rank_agrees(3);
}

TEST(LossScaler, TheFlagTravelsOnTheGradientsDevice) {
  set_cuda_device_emulated(true);
  std::vector<int> answers(2, -1);
  try {
    launch({.world_size = 2}, [&](Communicator& comm) {
      DynamicLossScaler scaler({.initial_scale = 2.0f});
      std::vector<float> values{2.0f, comm.rank() == 1 ? std::nanf("") : 6.0f};
      Tensor shard = Tensor::from(values, MemoryCategory::kGradients, Device::kCuda);
      std::vector<TensorView> gradients{shard.view()};
      const bool overflow = scaler.unscale_and_check(comm, gradients, Device::kCuda);
      answers[static_cast<std::size_t>(comm.rank())] = overflow ? 1 : 0;
    });
  } catch (...) {
    set_cuda_device_emulated(false);
    throw;
  }
  set_cuda_device_emulated(false);
  EXPECT_EQ(answers, (std::vector<int>{1, 1}));
}

}  // namespace
}  // namespace dp
