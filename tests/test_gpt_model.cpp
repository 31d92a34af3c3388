// Unit tests of the GPT model (dp::Model::gpt, dp::parse_gpt_spec): the spec's grammar and
// errors, GPT-2's parameter names in order, and a small GPT that learns a task only
// attention can solve (each token repeats the one two places before it).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dp/error.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "dp/rng.h"
#include "test_support.h"

namespace {

std::string error_message(const std::function<void()>& action) {
  return dp::testing::message_of<dp::Error>(action);
}

TEST(GptSpec, ParsesKeysInAnyOrderWithDefaults) {
  const dp::GptSpec full = dp::parse_gpt_spec("gpt:layers=2,dim=32,heads=8,context=16");
  EXPECT_EQ(full.layers, 2);
  EXPECT_EQ(full.dim, 32);
  EXPECT_EQ(full.heads, 8);
  EXPECT_EQ(full.context, 16);
  const dp::GptSpec some = dp::parse_gpt_spec("gpt:context=32,layers=1");
  EXPECT_EQ(some.layers, 1);
  EXPECT_EQ(some.dim, 128);
  EXPECT_EQ(some.heads, 4);
  EXPECT_EQ(some.context, 32);
  const dp::GptSpec defaults = dp::parse_gpt_spec("gpt");
  EXPECT_EQ(defaults.layers, 4);
  EXPECT_EQ(defaults.context, 64);
  EXPECT_TRUE(dp::is_gpt_spec("gpt"));
  EXPECT_TRUE(dp::is_gpt_spec("gpt:dim=8"));
  EXPECT_FALSE(dp::is_gpt_spec("64-256-10"));
  EXPECT_FALSE(dp::is_gpt_spec("gpt2"));
}

TEST(GptSpec, RejectsBadSpecsSayingWhy) {
  const auto expect_refused = [](const std::string& spec, const std::string& why) {
    const std::string message = error_message([&] { dp::parse_gpt_spec(spec); });
    EXPECT_TRUE(dp::testing::contains(message, "GPT spec \"" + spec + "\" is invalid: " + why))
        << message;
    EXPECT_TRUE(dp::testing::contains(message, "e.g. \"gpt:layers=4,dim=128,heads=4,context=64\""))
        << message;
  };
  expect_refused("64-256-10", "it does not start with \"gpt:\"");
  expect_refused("gpt:", "\"\" is not key=value");
  expect_refused("gpt:layers=2,", "\"\" is not key=value");
  expect_refused("gpt:depth=2", "unknown key \"depth\"");
  expect_refused("gpt:dim=8,dim=16", "key \"dim\" is given twice");
  expect_refused("gpt:dim=12x", "dim is \"12x\", not a whole number");
  expect_refused("gpt:heads=", "heads is \"\", not a whole number");
  expect_refused("gpt:layers=0", "layers is 0, not positive");
  expect_refused("gpt:dim=10,heads=4", "4 heads do not divide dim = 10 into equal heads");
  expect_refused("gpt:dim=1073741824,heads=1",
                 "its parameters come to more than 1152921504606846976 (2^60)");
}

TEST(GptModel, HasGpt2sParametersInOrder) {
  dp::Model model = dp::Model::gpt({.layers = 2, .dim = 8, .heads = 2, .context = 4}, 11);
  std::vector<std::string> names;
  for (const dp::Parameter* parameter : model.parameters()) names.push_back(parameter->name);
  std::vector<std::string> expected = {"wte.weight", "wpe.weight"};
  for (const char* block : {"h.0", "h.1"})
    for (const char* role :
         {"ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
          "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight",
          "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"})
      expected.push_back(std::string(block) + "." + role);
  for (const char* name : {"ln_f.weight", "ln_f.bias", "lm_head.weight"}) expected.push_back(name);
  EXPECT_EQ(names, expected);
  // V C + T C + L (12 C^2 + 13 C) + 2 C + V C
  EXPECT_EQ(model.num_parameters(), 11u * 8 + 4 * 8 + 2 * (12 * 64 + 13 * 8) + 2 * 8 + 11 * 8);
  EXPECT_EQ(model.parameter("lm_head.weight").value.shape(), (std::vector<std::int64_t>{11, 8}));
  EXPECT_EQ(model.parameter("wpe.weight").value.shape(), (std::vector<std::int64_t>{4, 8}));
  // Drawn, not left at zero; LayerNorm at the identity.
  EXPECT_NE(model.parameter("wte.weight").value[0], 0.0f);
  EXPECT_EQ(model.parameter("h.1.ln_2.weight").value[3], 1.0f);
  // The same seed draws the same model.
  dp::Model twin = dp::Model::gpt({.layers = 2, .dim = 8, .heads = 2, .context = 4}, 11);
  EXPECT_EQ(twin.flat_parameters(), model.flat_parameters());

  const std::string vocab =
      error_message([] { dp::Model::gpt({.layers = 1, .dim = 8, .heads = 2, .context = 4}, 0); });
  EXPECT_TRUE(dp::testing::contains(vocab, "at least one token, got 0")) << vocab;
  const std::string heads =
      error_message([] { dp::Model::gpt({.layers = 1, .dim = 8, .heads = 3, .context = 4}, 5); });
  EXPECT_TRUE(dp::testing::contains(heads, "3 heads do not divide dim = 8")) << heads;
}

TEST(GptModel, LearnsToRepeatTheTokenTwoPlacesBack) {
  // Sequences a b a b a b ...: from position 1 on, the next token is the one two places
  // back, which only attention can see; position 0's successor (b) is a free draw. A model
  // that has learnt the rule pays log(V) at position 0 and nearly nothing elsewhere: mean
  // loss near log(5) / 8 = 0.2, against log(5) = 1.61 for a uniform guess.
  constexpr std::int64_t kVocab = 5, kTime = 8, kBatch = 16;
  dp::Model model =
      dp::Model::gpt({.layers = 1, .dim = 16, .heads = 2, .context = kTime}, kVocab, {.seed = 3});
  dp::AdamW optimizer(model.num_parameters(), {.lr = 1e-2f, .weight_decay = 0.0f});
  dp::CounterRng data(5, 0);
  float first_loss = 0.0f, last_loss = 0.0f;
  for (int step = 0; step < 150; ++step) {
    dp::Tensor ids({kBatch, kTime});
    std::vector<int> labels(static_cast<std::size_t>(kBatch * kTime));
    for (std::int64_t b = 0; b < kBatch; ++b) {
      const auto pair = std::array<std::uint64_t, 2>{data.below(kVocab), data.below(kVocab)};
      for (std::int64_t t = 0; t <= kTime; ++t) {
        const auto token = static_cast<int>(pair[static_cast<std::size_t>(t % 2)]);
        if (t < kTime) ids.at(b, t) = static_cast<float>(token);
        if (t > 0) labels[static_cast<std::size_t>(b * kTime + t - 1)] = token;  // next token
      }
    }
    const dp::Tensor logits = model.forward(ids);
    ASSERT_EQ(logits.shape(), (std::vector<std::int64_t>{kBatch * kTime, kVocab}));
    const float loss = model.backward(logits, labels);
    optimizer.step(model);
    model.zero_grad();
    if (step == 0) first_loss = loss;
    last_loss = loss;
  }
  EXPECT_NEAR(first_loss, std::log(5.0f), 0.2f);
  EXPECT_LT(last_loss, 0.4f) << "first loss " << first_loss;
}

}  // namespace
