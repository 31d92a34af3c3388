// Unit tests of the GPT model (dp::Model::gpt, dp::parse_gpt_spec): the spec's grammar and
// errors, GPT-2's parameter names in order, and a small GPT that learns a task only
// attention can solve (each token repeats the one two places before it).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "dp/checkpoint.h"
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

// The ids, labels (next tokens) of `batch` random sequences of `time` tokens.
struct TokenBatch {
  dp::Tensor ids;
  std::vector<int> labels;
};
TokenBatch random_tokens(std::int64_t batch, std::int64_t time, std::int64_t vocab,
                         std::uint64_t stream) {
  dp::CounterRng rng(9, stream);
  TokenBatch result{dp::Tensor({batch, time}), {}};
  for (float& id : result.ids.span()) id = static_cast<float>(rng.below(vocab));
  for (std::int64_t i = 0; i < batch * time; ++i)
    result.labels.push_back(static_cast<int>(rng.below(vocab)));
  return result;
}

TEST(GptModel, BlocksReadTheirParametersWhenTheyRunAsZero3Needs) {
  // ZeRO-3 frees a layer's parameters after its forward and gathers them again before its
  // backward: a block must not keep pointers to them across the two.
  const dp::GptSpec spec{.layers = 2, .dim = 8, .heads = 2, .context = 4};
  dp::Model plain = dp::Model::gpt(spec, 7, {.seed = 1});
  dp::Model sharded = dp::Model::gpt(spec, 7, {.seed = 1});
  // What a gather brings back: a copy in new memory (the old block is freed, and reused), so a
  // layer that kept a pointer across the two would read another tensor's bytes.
  std::map<std::string, dp::Tensor> stash;
  sharded.on_post_forward([&](dp::Layer& layer) {
    for (dp::Parameter* parameter : layer.parameters()) {
      stash[parameter->name] = parameter->value.clone();
      parameter->value = dp::Tensor();
    }
  });
  sharded.on_pre_backward([&](dp::Layer& layer) {
    for (dp::Parameter* parameter : layer.parameters())
      parameter->value = std::move(stash.at(parameter->name));
  });
  const TokenBatch batch = random_tokens(3, 4, 7, 1);
  const float plain_loss = plain.backward(plain.forward(batch.ids), batch.labels);
  const float sharded_loss = sharded.backward(sharded.forward(batch.ids), batch.labels);
  EXPECT_EQ(sharded_loss, plain_loss);
  EXPECT_EQ(sharded.flat_gradients(), plain.flat_gradients());

  // A block that runs while its parameters are freed says which one is missing.
  sharded.clear_hooks();
  for (dp::Parameter* parameter : sharded.layers()[1]->parameters())
    parameter->value = dp::Tensor();
  const std::string message = error_message([&] { sharded.forward(batch.ids); });
  EXPECT_TRUE(dp::testing::contains(message, "parameter h.0.ln_1.weight holds a value of shape ()"))
      << message;
}

TEST(GptModel, ACheckpointOfItsParametersLoadsByGpt2Names) {
  const dp::GptSpec spec{.layers = 1, .dim = 8, .heads = 2, .context = 4};
  dp::Model trained = dp::Model::gpt(spec, 6, {.seed = 1});
  std::vector<dp::NamedTensor> state;
  for (dp::Parameter* parameter : trained.parameters())
    state.push_back({parameter->name, &parameter->value});
  const std::filesystem::path file = dp::testing::test_directory() / "gpt.safetensors";
  dp::save_safetensors(file, state, {});
  const dp::Checkpoint loaded = dp::load_safetensors(file);
  EXPECT_EQ(loaded.tensors.at("h.0.attn.c_attn.weight").shape(),
            (std::vector<std::int64_t>{24, 8}));
  EXPECT_EQ(loaded.tensors.at("lm_head.weight").shape(), (std::vector<std::int64_t>{6, 8}));

  dp::Model fresh = dp::Model::gpt(spec, 6, {.seed = 2});
  ASSERT_NE(fresh.flat_parameters(), trained.flat_parameters());
  for (dp::Parameter* parameter : fresh.parameters()) {
    const dp::Tensor& value = loaded.tensors.at(parameter->name);
    ASSERT_EQ(value.shape(), parameter->value.shape()) << parameter->name;
    std::copy(value.span().begin(), value.span().end(), parameter->value.span().begin());
  }
  const TokenBatch batch = random_tokens(2, 4, 6, 2);
  const dp::Tensor expected = trained.forward(batch.ids);
  const dp::Tensor logits = fresh.forward(batch.ids);
  EXPECT_TRUE(std::equal(logits.span().begin(), logits.span().end(), expected.span().begin()));
}

}  // namespace
