// Unit tests of mixed precision in the runtime: the master-weight optimizer against a hand
// emulation of its arithmetic (bit for bit), its memory (2 + 2 + 12 bytes per parameter with
// AdamW), the loss scaler's overflow test on 16-bit gradients, and the 16-bit MLP layers
// against their float32 arithmetic rounded. Training: test_mixed_training.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "comm_test_support.h"
#include "dp/error.h"
#include "dp/float16.h"
#include "dp/loss_scaler.h"
#include "dp/memory.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "dp/rng.h"
#include "dp/tensor_ops.h"
#include "dp/trainer.h"
#include "test_support.h"

namespace {

std::string error_message(const std::function<void()>& action) {
  return dp::testing::message_of<dp::Error>(action);
}

std::vector<float> random_values(std::size_t count, std::uint64_t stream, float bound = 1.0f) {
  dp::CounterRng rng(29, stream);
  std::vector<float> values(count);
  for (float& value : values) value = rng.uniform(-bound, bound);
  return values;
}

// `values` rounded to T (dp::BFloat16 or dp::Float16).
template <typename T>
std::vector<T> rounded(const std::vector<float>& values) {
  std::vector<T> out;
  for (float value : values) {
    if constexpr (std::is_same_v<T, dp::BFloat16>) {
      out.push_back(dp::to_bfloat16(value));
    } else {
      out.push_back(dp::to_float16(value));
    }
  }
  return out;
}

template <typename T>
T round_to(float value) {
  if constexpr (std::is_same_v<T, dp::BFloat16>) {
    return dp::to_bfloat16(value);
  } else {
    return dp::to_float16(value);
  }
}

// The hand emulation of MixedPrecisionOptimizer over SGD with momentum and weight decay:
// master = widen(p); each step g = widen(grad) * scale (scale 1: no product),
// g += wd * master, buf = momentum * buf + g, master -= lr * buf, p = round(master).
template <typename T>
void sgd_matches_hand_emulation(dp::DataType type, float gradient_scale) {
  constexpr std::size_t n = 1000;
  const dp::SgdOptions options{.lr = 0.05f, .momentum = 0.9f, .weight_decay = 0.01f};
  std::vector<T> params = rounded<T>(random_values(n, 1));
  dp::MixedPrecisionOptimizer optimizer(std::make_unique<dp::Sgd>(n, options), type);
  optimizer.load_master_weights(0, dp::ConstTensorView(std::span<const T>(params)));
  optimizer.set_gradient_scale(gradient_scale);

  std::vector<float> master(n), buffer(n, 0.0f);
  for (std::size_t i = 0; i < n; ++i) master[i] = dp::to_float(params[i]);
  std::vector<T> expected = params;
  for (int step = 0; step < 5; ++step) {
    const std::vector<T> grads = rounded<T>(random_values(n, 100 + step, 1.0f / gradient_scale));
    optimizer.begin_step();
    optimizer.update(0, dp::TensorView(std::span<T>(params)),
                     dp::ConstTensorView(std::span<const T>(grads)));
    for (std::size_t i = 0; i < n; ++i) {
      float g = dp::to_float(grads[i]);
      if (gradient_scale != 1.0f) g = gradient_scale * g;
      g = g + options.weight_decay * master[i];
      buffer[i] = options.momentum * buffer[i] + g;
      master[i] -= options.lr * buffer[i];
      expected[i] = round_to<T>(master[i]);
    }
    ASSERT_EQ(0, std::memcmp(params.data(), expected.data(), n * sizeof(T))) << "step " << step;
  }
  const std::span<const float> masters = optimizer.master_weights().span();
  EXPECT_EQ(0, std::memcmp(masters.data(), master.data(), n * sizeof(float)));
}

TEST(MixedPrecisionOptimizer, SgdOnBFloat16IsBitwiseTheHandEmulation) {
  sgd_matches_hand_emulation<dp::BFloat16>(dp::DataType::kBFloat16, 1.0f);
}

TEST(MixedPrecisionOptimizer, SgdOnFloat16UnscalesAndIsBitwiseTheHandEmulation) {
  sgd_matches_hand_emulation<dp::Float16>(dp::DataType::kFloat16, 1.0f / 1024.0f);
}

// AdamW by hand, PyTorch's arrangement as dp::AdamW computes it, on float32 masters.
template <typename T>
void adamw_matches_hand_emulation(dp::DataType type, float gradient_scale) {
  // More than the optimizer's 65536-element workspace, so the chunks are exercised.
  constexpr std::size_t n = 70000;
  const dp::AdamWOptions options{.lr = 1e-2f, .weight_decay = 0.1f};
  std::vector<T> params = rounded<T>(random_values(n, 2));
  dp::MixedPrecisionOptimizer optimizer(std::make_unique<dp::AdamW>(n, options), type);
  optimizer.load_master_weights(0, dp::ConstTensorView(std::span<const T>(params)));
  optimizer.set_gradient_scale(gradient_scale);

  std::vector<float> master(n), m(n, 0.0f), v(n, 0.0f);
  for (std::size_t i = 0; i < n; ++i) master[i] = dp::to_float(params[i]);
  std::vector<T> expected = params;
  for (int step = 1; step <= 4; ++step) {
    const std::vector<T> grads = rounded<T>(random_values(n, 200 + step, 1.0f / gradient_scale));
    optimizer.begin_step();
    // Two calls, as a model's parameters come: [0, 30000) and [30000, n).
    optimizer.update(0, dp::TensorView(std::span<T>(params).subspan(0, 30000)),
                     dp::ConstTensorView(std::span<const T>(grads).subspan(0, 30000)));
    optimizer.update(30000, dp::TensorView(std::span<T>(params).subspan(30000)),
                     dp::ConstTensorView(std::span<const T>(grads).subspan(30000)));
    const auto t = static_cast<double>(step);
    const auto step_size =
        static_cast<float>(options.lr / (1.0 - std::pow(double{options.beta1}, t)));
    const auto sqrt_correction2 =
        static_cast<float>(std::sqrt(1.0 - std::pow(double{options.beta2}, t)));
    const float decay = 1.0f - options.lr * options.weight_decay;
    for (std::size_t i = 0; i < n; ++i) {
      float g = dp::to_float(grads[i]);
      if (gradient_scale != 1.0f) g = gradient_scale * g;
      master[i] *= decay;
      m[i] = options.beta1 * m[i] + (1.0f - options.beta1) * g;
      v[i] = options.beta2 * v[i] + (1.0f - options.beta2) * g * g;
      const float denominator = std::sqrt(v[i]) / sqrt_correction2 + options.eps;
      master[i] -= step_size * m[i] / denominator;
      expected[i] = round_to<T>(master[i]);
    }
    ASSERT_EQ(0, std::memcmp(params.data(), expected.data(), n * sizeof(T))) << "step " << step;
  }
  EXPECT_EQ(optimizer.inner().step_count(), 4);
}

TEST(MixedPrecisionOptimizer, AdamWOnBFloat16IsBitwiseTheHandEmulation) {
  adamw_matches_hand_emulation<dp::BFloat16>(dp::DataType::kBFloat16, 1.0f);
}

TEST(MixedPrecisionOptimizer, AdamWOnFloat16IsBitwiseTheHandEmulation) {
  adamw_matches_hand_emulation<dp::Float16>(dp::DataType::kFloat16, 1.0f / 65536.0f);
}

TEST(MixedPrecisionOptimizer, MastersKeepUpdatesTheParametersCannotHold) {
  // A bf16 weight of 1 ignores a step of 1e-4 (its spacing there is 2^-7); the master
  // accumulates 100 of them, and the parameter moves once the sum is worth a bf16 step.
  std::vector<dp::BFloat16> params = {dp::to_bfloat16(1.0f)};
  const std::vector<dp::BFloat16> grads = {dp::to_bfloat16(1.0f)};
  dp::MixedPrecisionOptimizer optimizer(std::make_unique<dp::Sgd>(1, dp::SgdOptions{.lr = 1e-4f}),
                                        dp::DataType::kBFloat16);
  optimizer.load_master_weights(0, dp::ConstTensorView(std::span<const dp::BFloat16>(params)));
  for (int step = 0; step < 100; ++step) {
    optimizer.begin_step();
    optimizer.update(0, dp::TensorView(std::span<dp::BFloat16>(params)),
                     dp::ConstTensorView(std::span<const dp::BFloat16>(grads)));
  }
  EXPECT_NEAR(optimizer.master_weights().span()[0], 0.99f, 1e-5f);
  EXPECT_EQ(dp::to_float(params[0]),
            dp::to_float(dp::to_bfloat16(optimizer.master_weights().span()[0])));
  EXPECT_LT(dp::to_float(params[0]), 1.0f);
  // The same steps straight on a bf16 weight leave it at 1: each rounds back.
  float plain = 1.0f;
  for (int step = 0; step < 100; ++step) plain = dp::to_float(dp::to_bfloat16(plain - 1e-4f));
  EXPECT_EQ(plain, 1.0f);
}

TEST(MixedPrecisionOptimizer, MemoryIsTwoPlusTwoPlusTwelveBytesPerParameterWithAdamW) {
  auto memory = std::make_shared<dp::RankMemory>();
  const dp::ScopedRankMemory bind(memory);
  constexpr std::int64_t psi = 100000;
  dp::Tensor value({psi}, dp::DataType::kBFloat16, dp::MemoryCategory::kParameters);
  dp::Tensor grad({psi}, dp::DataType::kBFloat16, dp::MemoryCategory::kGradients);
  dp::MixedPrecisionOptimizer optimizer(std::make_unique<dp::AdamW>(psi, dp::AdamWOptions{}),
                                        dp::DataType::kBFloat16);
  const dp::MemoryTracker& tracker = memory->tracker();
  EXPECT_EQ(tracker.current(dp::MemoryCategory::kParameters), 2 * psi);
  EXPECT_EQ(tracker.current(dp::MemoryCategory::kGradients), 2 * psi);
  EXPECT_EQ(tracker.current(dp::MemoryCategory::kOptimizerState), 12 * psi);
  // The workspace that widens the gradients, bounded, apart from the 16.
  EXPECT_EQ(tracker.current(dp::MemoryCategory::kOther), 4 * 65536);
  // SGD with momentum: 4 bytes of masters and 4 of momentum.
  {
    dp::MixedPrecisionOptimizer sgd(
        std::make_unique<dp::Sgd>(psi, dp::SgdOptions{.momentum = 0.9f}), dp::DataType::kFloat16);
    EXPECT_EQ(tracker.current(dp::MemoryCategory::kOptimizerState), (12 + 8) * psi);
  }
  std::vector<std::string> names;
  for (const dp::OptimizerState& state : optimizer.state()) names.push_back(state.name);
  EXPECT_EQ(names, (std::vector<std::string>{"master_weights", "exp_avg", "exp_avg_sq"}));
}

TEST(MixedPrecisionOptimizer, RefusesWrongTypesAndUse) {
  EXPECT_NE(error_message([] {
              dp::MixedPrecisionOptimizer(std::make_unique<dp::Sgd>(4, dp::SgdOptions{}),
                                          dp::DataType::kFloat32);
            }).find("bfloat16 or float16"),
            std::string::npos);
  dp::MixedPrecisionOptimizer optimizer(std::make_unique<dp::Sgd>(4, dp::SgdOptions{}),
                                        dp::DataType::kBFloat16);
  std::vector<float> wide(4);
  std::vector<dp::Float16> half(4);
  std::vector<dp::BFloat16> brain(4);
  optimizer.begin_step();
  EXPECT_NE(error_message([&] { optimizer.update(0, wide, wide); }).find("float32 spans"),
            std::string::npos);
  EXPECT_NE(error_message([&] {
              optimizer.update(0, dp::TensorView(std::span<dp::Float16>(half)),
                               dp::ConstTensorView(std::span<const dp::Float16>(half)));
            }).find("expected both bfloat16"),
            std::string::npos);
  EXPECT_NE(error_message([&] {
              optimizer.update(2, dp::TensorView(std::span<dp::BFloat16>(brain)),
                               dp::ConstTensorView(std::span<const dp::BFloat16>(brain)));
            }).find("outside"),
            std::string::npos);
  EXPECT_NE(error_message([&] { optimizer.set_gradient_scale(0.0f); }).find("finite and positive"),
            std::string::npos);
}

TEST(DynamicLossScaler, FindsAnOverflowIn16BitGradientsWithoutChangingThem) {
  std::vector<dp::Float16> finite = {dp::to_float16(1.0f), dp::to_float16(-3.0f)};
  std::vector<dp::Float16> overflowed = {dp::to_float16(1e5f), dp::to_float16(2.0f)};
  const dp::ConstTensorView a{std::span<const dp::Float16>(finite)};
  const dp::ConstTensorView b{std::span<const dp::Float16>(overflowed)};
  EXPECT_FALSE(dp::DynamicLossScaler::found_overflow(std::vector{a}));
  EXPECT_TRUE(dp::DynamicLossScaler::found_overflow(std::vector{a, b}));
  EXPECT_EQ(dp::to_float(finite[1]), -3.0f);
  dp::DynamicLossScaler scaler;
  EXPECT_EQ(scaler.inverse_scale(), 1.0f / 65536.0f);
}

// --- the 16-bit layers ----------------------------------------------------------------------

// The float32 copy of a tensor (16-bit elements widened exactly).
dp::Tensor wide(const dp::Tensor& tensor) {
  return tensor.to(dp::DataType::kFloat32);
}

bool same_bits(const dp::Tensor& a, const dp::Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.view().raw_data(), b.view().raw_data(), a.bytes()) == 0;
}

// A 16-bit Linear is its float32 arithmetic on the widened operands, each result rounded:
// forward, dX, and the gradients accumulated as round(widen(grad) + contribution).
void linear_is_float32_rounded(dp::DataType type) {
  constexpr std::int64_t batch = 7, in = 13, out = 5;
  dp::Linear narrow("fc", in, out, type);
  dp::Linear reference("fc", in, out);
  dp::CounterRng rng(3, 0);
  for (dp::Parameter* parameter : narrow.parameters()) narrow.initialize(*parameter, rng);
  for (std::size_t p = 0; p < 2; ++p) {
    dp::Parameter& from = *narrow.parameters()[p];
    dp::Parameter& to = *reference.parameters()[p];
    to.value = wide(from.value);
    // A gradient already holding something, so that the accumulation shows.
    from.grad.fill(0.375f);
    to.grad.fill(0.375f);
  }
  const dp::Tensor x32 = dp::Tensor::from(random_values(batch * in, 5));
  dp::Tensor x = x32.to(type);
  x.reshape({batch, in});
  dp::Tensor dy = dp::Tensor::from(random_values(batch * out, 6)).to(type);
  dy.reshape({batch, out});

  const dp::Tensor y = narrow.forward(x);
  ASSERT_EQ(y.dtype(), type);
  EXPECT_TRUE(same_bits(y, reference.forward(wide(x)).to(type)));
  const dp::Tensor dx = narrow.backward(dy);
  const dp::Tensor dx_reference = reference.backward(wide(dy));
  EXPECT_TRUE(same_bits(dx, dx_reference.to(type)));
  // The float32 layer added the contribution to 0.375 in float32: round that once.
  for (std::size_t p = 0; p < 2; ++p)
    EXPECT_TRUE(same_bits(narrow.parameters()[p]->grad, reference.parameters()[p]->grad.to(type)))
        << narrow.parameters()[p]->name;
  // A float32 input into a 16-bit layer is refused, naming both types.
  EXPECT_NE(error_message([&] { (void)narrow.forward(wide(x)); }).find("float32 elements"),
            std::string::npos);
}

TEST(MixedPrecisionLayers, BFloat16LinearIsItsFloat32ArithmeticRounded) {
  linear_is_float32_rounded(dp::DataType::kBFloat16);
}

TEST(MixedPrecisionLayers, Float16LinearIsItsFloat32ArithmeticRounded) {
  linear_is_float32_rounded(dp::DataType::kFloat16);
}

TEST(MixedPrecisionLayers, ReluKeepsTheTypeAndIsTheFloat32RuleRounded) {
  dp::ReLU relu("relu", 8);
  dp::Tensor x = dp::Tensor::from(random_values(32, 7)).to(dp::DataType::kFloat16);
  x.reshape({4, 8});
  dp::Tensor dy = dp::Tensor::from(random_values(32, 8)).to(dp::DataType::kFloat16);
  dy.reshape({4, 8});
  dp::ReLU reference("relu", 8);
  const dp::Tensor y = relu.forward(x);
  EXPECT_TRUE(same_bits(y, reference.forward(wide(x)).to(dp::DataType::kFloat16)));
  EXPECT_TRUE(
      same_bits(relu.backward(dy), reference.backward(wide(dy)).to(dp::DataType::kFloat16)));
}

TEST(MixedPrecisionModel, ABFloat16MlpIsItsFloat32TwinRoundedAndHoldsTwoBytesPerValue) {
  auto memory = std::make_shared<dp::RankMemory>();
  const dp::ScopedRankMemory bind(memory);
  const dp::Model wide_model = dp::Model::mlp("16-32-4", {.seed = 3});
  const std::size_t psi = wide_model.num_parameters();
  const std::size_t float32_bytes = memory->tracker().current(dp::MemoryCategory::kParameters);
  dp::Model model = dp::Model::mlp("16-32-4", {.seed = 3, .dtype = dp::DataType::kBFloat16});
  EXPECT_EQ(memory->tracker().current(dp::MemoryCategory::kParameters), float32_bytes + 2 * psi);
  EXPECT_EQ(model.dtype(), dp::DataType::kBFloat16);
  const std::vector<float> values = model.flat_parameters();
  const std::vector<float> twin = wide_model.flat_parameters();
  for (std::size_t i = 0; i < psi; ++i)
    ASSERT_EQ(values[i], dp::to_float(dp::to_bfloat16(twin[i]))) << "element " << i;
  // Forward takes float32 data and gives 16-bit logits; backward gives 16-bit gradients.
  dp::Tensor x = dp::Tensor::from(random_values(8 * 16, 9));
  x.reshape({8, 16});
  const dp::Tensor logits = model.forward(x);
  EXPECT_EQ(logits.dtype(), dp::DataType::kBFloat16);
  const std::vector<int> labels = {0, 1, 2, 3, 0, 1, 2, 3};
  const float loss = model.backward(logits, labels);
  EXPECT_TRUE(std::isfinite(loss));
  EXPECT_EQ(model.parameter("fc1.weight").grad.dtype(), dp::DataType::kBFloat16);
  EXPECT_GT(dp::norm(wide(model.parameter("fc1.weight").grad).view()), 0.0);
  // LayerNorm and GELU have 16-bit paths too (tests/test_gpt_16bit.cpp): such an MLP is
  // 16-bit throughout.
  dp::Model normed = dp::Model::mlp(
      "16-32-4", {.activation = "gelu", .layer_norm = true, .dtype = dp::DataType::kFloat16});
  EXPECT_EQ(normed.parameter("ln1.weight").value.dtype(), dp::DataType::kFloat16);
  const dp::Tensor normed_logits = normed.forward(x);
  EXPECT_EQ(normed_logits.dtype(), dp::DataType::kFloat16);
  EXPECT_TRUE(std::isfinite(normed.backward(normed_logits, labels)));
  EXPECT_GT(dp::norm(wide(normed.parameter("ln1.weight").grad).view()), 0.0);
}

}  // namespace
