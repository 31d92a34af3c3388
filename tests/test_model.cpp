// Unit tests of dp::Model: MLP construction, initialisation, forward and backward
// (against finite differences), gradient accumulation, hooks, frozen parameters and the
// flat parameter space.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dp/error.h"
#include "dp/memory.h"
#include "dp/model.h"
#include "dp/rng.h"
#include "test_support.h"

namespace {

// The message of the dp::Error that `action` throws (a test failure if it throws none).
std::string error_message(const std::function<void()>& action) {
  return dp::testing::message_of<dp::Error>(action);
}

// A (batch, features) input with uniform values in [-1, 1).
dp::Tensor random_input(std::int64_t batch, std::int64_t features, std::uint64_t stream = 1) {
  dp::Tensor input({batch, features});
  dp::CounterRng rng(3, stream);
  for (float& value : input.span()) value = rng.uniform(-1.0f, 1.0f);
  return input;
}

std::vector<std::string> parameter_names(const dp::Model& model) {
  std::vector<std::string> names;
  for (const dp::Parameter* parameter : model.parameters()) names.push_back(parameter->name);
  return names;
}

std::vector<std::string> layer_names(dp::Model& model) {
  std::vector<std::string> names;
  for (dp::Layer* layer : model.layers()) names.push_back(layer->name());
  return names;
}

// ---- Construction -------------------------------------------------------------------------

TEST(Model, MlpBuildsNamedLayersAndParameters) {
  dp::Model model = dp::Model::mlp("4-8-6-3");
  EXPECT_EQ(layer_names(model), (std::vector<std::string>{"fc1", "relu1", "fc2", "relu2", "fc3"}));
  EXPECT_EQ(parameter_names(model),
            (std::vector<std::string>{"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias",
                                      "fc3.weight", "fc3.bias"}));
  EXPECT_EQ(model.num_parameters(), 4u * 8 + 8 + 8 * 6 + 6 + 6 * 3 + 3);
  EXPECT_EQ(model.num_trainable_parameters(), model.num_parameters());
  EXPECT_EQ(model.parameter("fc2.weight").value.shape(), (std::vector<std::int64_t>{6, 8}));

  // Indices and offsets follow definition order and tile the flat space.
  std::size_t offset = 0;
  for (std::size_t i = 0; i < model.parameters().size(); ++i) {
    const dp::Parameter& parameter = *model.parameters()[i];
    EXPECT_EQ(parameter.index, i);
    EXPECT_EQ(parameter.offset, offset) << parameter.name;
    offset += parameter.value.size();
  }
}

TEST(Model, MlpWithLayerNormAndGelu) {
  dp::Model model = dp::Model::mlp("4-8-3", {.activation = "gelu", .layer_norm = true});
  EXPECT_EQ(layer_names(model), (std::vector<std::string>{"fc1", "ln1", "gelu1", "fc2"}));
  EXPECT_EQ(model.layers()[1]->kind(), "layer_norm");
  EXPECT_EQ(model.layers()[2]->kind(), "gelu");
  EXPECT_EQ(model.parameter("ln1.weight").value[0], 1.0f);
  EXPECT_EQ(model.parameter("ln1.bias").value[0], 0.0f);
}

TEST(Model, BadSpecsAreRejectedWithClearMessages) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"64--10", "width 2 is empty"},
      {"64", "it has 1 width"},
      {"a-b", "width 1 is \"a\", not a whole number"},
      {"64-0-10", "width 2 is 0, not positive"},
      {"", "width 1 is empty"},
      {"64-10-", "width 3 is empty"},
      {"64-1x-10", "width 2 is \"1x\""},
      {"64-+5-10", "width 2 is \"+5\""},
  };
  for (const auto& [spec, reason] : cases) {
    // (Clang 14, the sanitize build's compiler, cannot capture a structured binding.)
    const std::string message = error_message([&spec = spec] { dp::Model::mlp(spec); });
    EXPECT_NE(message.find("\"" + spec + "\""), std::string::npos) << message;
    EXPECT_NE(message.find(reason), std::string::npos) << message;
    EXPECT_NE(message.find("expected two or more positive layer widths"), std::string::npos)
        << message;
  }
  EXPECT_EQ(dp::parse_mlp_spec("64-256-10"), (std::vector<std::int64_t>{64, 256, 10}));
  const std::string activation =
      error_message([] { dp::Model::mlp("4-3", {.activation = "tanh"}); });
  EXPECT_NE(activation.find("\"tanh\""), std::string::npos) << activation;
  EXPECT_NE(activation.find("\"relu\" or \"gelu\""), std::string::npos) << activation;
}

TEST(Model, ASpecWhoseParametersOverflowIsRefusedBeforeAnyAllocation) {
  // Issue 32: 64 x (2^63 - 1) wrapped around and Parameter::zeros wrote past a small buffer.
  for (const std::string spec : {"64-9223372036854775807-10", "9223372036854775807-2",
                                 "4294967296-4294967296", "1073741824-1073741824-1073741824"}) {
    const std::string message = error_message([&] { dp::Model::mlp(spec); });
    EXPECT_NE(message.find("brings the parameters to more than 1152921504606846976 (2^60)"),
              std::string::npos)
        << spec << ": " << message;
  }
  // A shape built elsewhere is checked where its element count is taken, without overflow:
  // 2^32 x 2^32 wraps to 0 in 64 bits and would have been an empty tensor.
  for (const std::vector<std::int64_t>& shape : {std::vector<std::int64_t>{4294967296, 4294967296},
                                                 {64, 9223372036854775807},
                                                 {4, 2, 288230376151711744}}) {
    const std::string message = error_message([&] { dp::element_count(shape); });
    EXPECT_NE(message.find("more than 1152921504606846976 elements"), std::string::npos) << message;
  }
  EXPECT_EQ(dp::element_count({9223372036854775807, 0}), 0u) << "a zero extent is 0 elements";
  EXPECT_EQ(dp::element_count({1073741824, 1073741824}), std::size_t{1} << 60);
}

TEST(Model, AddRejectsDuplicateNames) {
  dp::Model model;
  model.add(std::make_unique<dp::Linear>("fc1", 2, 2));
  EXPECT_NE(error_message([&] {
              model.add(std::make_unique<dp::ReLU>("fc1", 2));
            }).find("layer called \"fc1\""),
            std::string::npos);
  EXPECT_THROW(model.add(nullptr), dp::Error);
}

TEST(Model, UnknownParameterListsTheValidNames) {
  dp::Model model = dp::Model::mlp("4-3");
  const std::string message = error_message([&] { model.parameter("fc2.weight"); });
  EXPECT_EQ(message, "no parameter called \"fc2.weight\"; the model has: fc1.weight, fc1.bias");
  EXPECT_THROW(model.freeze("nope"), dp::Error);
}

TEST(Model, ForwardChecksTheInputShape) {
  dp::Model model = dp::Model::mlp("64-16-10");
  EXPECT_EQ(error_message([&] {
              model.forward(dp::Tensor({32, 63}));
            }),
            "fc1 expects input of shape (B, 64), got (32, 63)");
  const dp::Tensor logits = model.forward(random_input(32, 64));
  EXPECT_EQ(logits.shape(), (std::vector<std::int64_t>{32, 10}));
  dp::Model empty;
  EXPECT_THROW(empty.forward(dp::Tensor({1, 1})), dp::Error);
}

TEST(Model, MovedModelKeepsWorking) {
  dp::Model original = dp::Model::mlp("4-5-3", {.seed = 9});
  const std::vector<float> values = original.flat_parameters();
  dp::Model moved = std::move(original);
  EXPECT_EQ(moved.flat_parameters(), values);
  EXPECT_EQ(moved.forward(random_input(2, 4)).shape(), (std::vector<std::int64_t>{2, 3}));
}

// ---- Initialisation -----------------------------------------------------------------------

TEST(Model, InitIsDeterministicPerSeed) {
  const dp::Model a = dp::Model::mlp("16-32-10", {.seed = 5});
  const dp::Model b = dp::Model::mlp("16-32-10", {.seed = 5});
  const dp::Model c = dp::Model::mlp("16-32-10", {.seed = 6});
  EXPECT_EQ(a.flat_parameters(), b.flat_parameters());  // bitwise
  const std::vector<float> pa = a.flat_parameters();
  const std::vector<float> pc = c.flat_parameters();
  std::size_t differing = 0;
  for (std::size_t i = 0; i < pa.size(); ++i) differing += pa[i] != pc[i] ? 1 : 0;
  EXPECT_GT(differing, pa.size() * 9 / 10);
}

TEST(Model, InitFollowsPyTorchLinearBounds) {
  dp::Model model = dp::Model::mlp("16-32-10", {.seed = 1});
  for (const auto& [name, fan_in] : std::vector<std::pair<std::string, int>>{
           {"fc1.weight", 16}, {"fc1.bias", 16}, {"fc2.weight", 32}, {"fc2.bias", 32}}) {
    const float bound = 1.0f / std::sqrt(static_cast<float>(fan_in));
    float low = bound;
    float high = -bound;
    for (float value : model.parameter(name).value.span()) {
      EXPECT_LE(std::abs(value), bound) << name;
      low = std::min(low, value);
      high = std::max(high, value);
    }
    if (model.parameter(name).value.size() >= 32) {  // enough draws to span the interval
      EXPECT_LT(low, -0.5f * bound) << name;
      EXPECT_GT(high, 0.5f * bound) << name;
    }
  }
}

TEST(Model, ParameterStreamsDoNotDependOnOtherParameters) {
  // Parameter i is drawn from stream i, so fc1.weight is the same whatever follows it.
  const dp::Model small = dp::Model::mlp("4-8-2", {.seed = 3});
  const dp::Model large = dp::Model::mlp("4-8-50-7", {.seed = 3});
  const auto first = small.parameter("fc1.weight").value.span();
  const auto second = large.parameter("fc1.weight").value.span();
  EXPECT_TRUE(std::equal(first.begin(), first.end(), second.begin()));
}

// ---- Backward -----------------------------------------------------------------------------

// Checks model.backward's parameter gradients against central differences of the loss.
void check_model_gradients(dp::Model& model, float step) {
  const dp::Tensor input = random_input(4, 3);
  const std::vector<int> labels = {0, 2, 1, 2};
  model.zero_grad();
  model.backward(model.forward(input), labels);
  const std::vector<float> analytic = model.flat_gradients();

  std::vector<float> values = model.flat_parameters();
  dp::SoftmaxCrossEntropy loss;
  for (std::size_t i = 0; i < values.size(); ++i) {
    const float original = values[i];
    values[i] = original + step;
    model.set_flat_parameters(values);
    const double plus = loss.forward(model.forward(input), labels);
    values[i] = original - step;
    model.set_flat_parameters(values);
    const double minus = loss.forward(model.forward(input), labels);
    values[i] = original;
    const double numeric = (plus - minus) / (2.0 * step);
    EXPECT_NEAR(analytic[i], numeric, 1e-3 + 1e-2 * std::abs(numeric)) << "element " << i;
  }
  model.set_flat_parameters(values);
}

TEST(Model, MlpBackwardMatchesFiniteDifferences) {
  dp::Model smooth =
      dp::Model::mlp("3-5-4-3", {.activation = "gelu", .layer_norm = true, .seed = 2});
  check_model_gradients(smooth, 1e-2f);
  // ReLU: a smaller step makes crossing a kink unlikely (and this seed crosses none).
  dp::Model relu = dp::Model::mlp("3-5-4-3", {.seed = 2});
  check_model_gradients(relu, 1e-3f);
}

TEST(Model, BackwardReturnsTheMeanLoss) {
  dp::Model model = dp::Model::mlp("3-4-3", {.seed = 1});
  const dp::Tensor input = random_input(4, 3);
  const std::vector<int> labels = {0, 1, 2, 0};
  dp::SoftmaxCrossEntropy reference;
  const dp::Tensor logits = model.forward(input);
  const float expected = reference.forward(logits, labels);
  EXPECT_EQ(model.backward(logits, labels, 0.25f), expected);  // unscaled
}

TEST(Model, BackwardAccumulatesAndZeroGradResets) {
  dp::Model model = dp::Model::mlp("3-4-3", {.seed = 1});
  const dp::Tensor input = random_input(4, 3);
  const std::vector<int> labels = {0, 1, 2, 0};
  model.backward(model.forward(input), labels);
  const std::vector<float> once = model.flat_gradients();
  model.backward(model.forward(input), labels);
  const std::vector<float> twice = model.flat_gradients();
  std::size_t nonzero = 0;
  for (std::size_t i = 0; i < once.size(); ++i) {
    EXPECT_NEAR(twice[i], 2.0f * once[i], 1e-6f * (1.0f + std::abs(once[i]))) << i;
    nonzero += once[i] != 0.0f ? 1 : 0;
  }
  EXPECT_GT(nonzero, once.size() / 2);

  model.zero_grad();
  for (float g : model.flat_gradients()) EXPECT_EQ(g, 0.0f);

  // Two half-scaled micro-batches give the gradient of the whole.
  model.backward(model.forward(input), labels, 0.5f);
  model.backward(model.forward(input), labels, 0.5f);
  const std::vector<float> halves = model.flat_gradients();
  for (std::size_t i = 0; i < once.size(); ++i)
    EXPECT_NEAR(halves[i], once[i], 1e-6f * (1.0f + std::abs(once[i]))) << i;
}

// ---- Hooks --------------------------------------------------------------------------------

TEST(Model, HooksFireInOrderAndGradientsAreFinalWhenReady) {
  dp::Model model = dp::Model::mlp("3-4-4-2", {.seed = 1});
  std::vector<std::string> events;
  std::vector<std::pair<std::string, std::vector<float>>> ready_grads;
  model.on_pre_forward([&](dp::Layer& layer) { events.push_back("pre_forward " + layer.name()); });
  model.on_post_forward(
      [&](dp::Layer& layer) { events.push_back("post_forward " + layer.name()); });
  model.on_pre_backward(
      [&](dp::Layer& layer) { events.push_back("pre_backward " + layer.name()); });
  model.on_post_backward(
      [&](dp::Layer& layer) { events.push_back("post_backward " + layer.name()); });
  model.on_gradient_ready([&](dp::Parameter& parameter) {
    events.push_back("ready " + parameter.name);
    ready_grads.emplace_back(parameter.name, std::vector<float>(parameter.grad.span().begin(),
                                                                parameter.grad.span().end()));
  });

  const std::vector<int> labels = {0, 1};
  const dp::Tensor logits = model.forward(random_input(2, 3));
  const std::vector<std::string> forward_events = {
      "pre_forward fc1", "post_forward fc1", "pre_forward relu1", "post_forward relu1",
      "pre_forward fc2", "post_forward fc2", "pre_forward relu2", "post_forward relu2",
      "pre_forward fc3", "post_forward fc3"};
  EXPECT_EQ(events, forward_events);

  events.clear();
  model.backward(logits, labels);
  const std::vector<std::string> backward_events = {
      "pre_backward fc3",   "ready fc3.bias",      "ready fc3.weight",   "post_backward fc3",
      "pre_backward relu2", "post_backward relu2", "pre_backward fc2",   "ready fc2.bias",
      "ready fc2.weight",   "post_backward fc2",   "pre_backward relu1", "post_backward relu1",
      "pre_backward fc1",   "ready fc1.bias",      "ready fc1.weight",   "post_backward fc1"};
  EXPECT_EQ(events, backward_events);

  // At firing time each gradient already had its final value.
  ASSERT_EQ(ready_grads.size(), 6u);
  for (const auto& [name, grad_at_hook] : ready_grads) {
    const auto final_grad = model.parameter(name).grad.span();
    EXPECT_TRUE(std::equal(grad_at_hook.begin(), grad_at_hook.end(), final_grad.begin())) << name;
    EXPECT_TRUE(std::any_of(grad_at_hook.begin(), grad_at_hook.end(), [](float g) {
      return g != 0.0f;
    })) << name;
  }

  model.clear_hooks();
  events.clear();
  model.backward(model.forward(random_input(2, 3)), labels);
  EXPECT_TRUE(events.empty());
}

TEST(Model, FrozenParametersGetNoHookAndNoGradient) {
  dp::Model model = dp::Model::mlp("3-4-2", {.seed = 1});
  model.freeze("fc1.weight");
  EXPECT_TRUE(model.parameter("fc1.weight").frozen);
  EXPECT_EQ(model.num_trainable_parameters(), model.num_parameters() - 12);
  EXPECT_EQ(model.num_parameters(), 12u + 4 + 8 + 2);

  std::vector<std::string> ready;
  model.on_gradient_ready([&](dp::Parameter& parameter) { ready.push_back(parameter.name); });
  const std::vector<int> labels = {0, 1};
  model.backward(model.forward(random_input(2, 3)), labels);
  EXPECT_EQ(ready, (std::vector<std::string>{"fc2.bias", "fc2.weight", "fc1.bias"}));
  for (float g : model.parameter("fc1.weight").grad.span()) EXPECT_EQ(g, 0.0f);

  model.unfreeze("fc1.weight");
  ready.clear();
  model.backward(model.forward(random_input(2, 3)), labels);
  EXPECT_EQ(ready.back(), "fc1.weight");
}

TEST(Model, HooksMayReleaseAndRestoreParameters) {
  // ZeRO-3 style: free fc1's weight after its forward, bring it back before its backward.
  dp::Model model = dp::Model::mlp("3-4-2", {.seed = 1});
  const dp::Tensor input = random_input(2, 3);
  const std::vector<int> labels = {1, 0};
  model.backward(model.forward(input), labels);
  const std::vector<float> expected = model.flat_gradients();
  model.zero_grad();

  dp::Tensor stash;
  model.on_post_forward([&](dp::Layer& layer) {
    if (layer.name() == "fc1") stash = std::move(model.parameter("fc1.weight").value);
  });
  model.on_pre_backward([&](dp::Layer& layer) {
    if (layer.name() == "fc1") model.parameter("fc1.weight").value = std::move(stash);
  });
  const dp::Tensor logits = model.forward(input);
  EXPECT_TRUE(model.parameter("fc1.weight").value.empty());
  EXPECT_THROW(model.flat_parameters(), dp::Error);
  model.backward(logits, labels);
  EXPECT_EQ(model.flat_gradients(), expected);
}

// ---- Flat parameter space and accuracy ----------------------------------------------------

TEST(Model, FlatParametersRoundTrip) {
  dp::Model model = dp::Model::mlp("3-4-2", {.seed = 1});
  std::vector<float> values(model.num_parameters());
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i);
  model.set_flat_parameters(values);
  EXPECT_EQ(model.flat_parameters(), values);
  EXPECT_EQ(model.parameter("fc1.bias").value[0], 12.0f);  // after the 12 weights of fc1
  const std::vector<float> wrong(values.size() - 1);
  EXPECT_NE(error_message([&] { model.set_flat_parameters(wrong); }).find("expects 26 values"),
            std::string::npos);
}

TEST(Model, AccuracyCountsArgmaxHits) {
  dp::Tensor logits({4, 3});
  logits.at(0, 2) = 1.0f;   // predicts 2
  logits.at(1, 0) = 5.0f;   // predicts 0
  logits.at(2, 1) = -1.0f;  // ties between 0 and 2: the first maximum, 0
  logits.at(3, 1) = 2.0f;   // predicts 1
  const std::vector<int> labels = {2, 1, 0, 1};
  EXPECT_FLOAT_EQ(dp::accuracy(logits, labels), 0.75f);
  const std::vector<int> too_many = {0, 0, 0, 0, 0};
  EXPECT_THROW(dp::accuracy(logits, too_many), dp::Error);
}

TEST(Model, CostSumsTheLayers) {
  dp::Model model = dp::Model::mlp("8-16-4");
  const double expected = 2.0 * 32 * 8 * 16 + 32 * 16 + 32 * 16 + 2.0 * 32 * 16 * 4 + 32 * 4;
  EXPECT_DOUBLE_EQ(model.forward_cost(32).flops, expected);
  EXPECT_GT(model.backward_cost(32).flops, model.forward_cost(32).flops);
  // Backward: fc1 without dx (dW and db), relu1, fc2 with dx (dW, dx and db).
  const double backward = 2.0 * 32 * 8 * 16 + 32 * 16 + 32 * 16 + 4.0 * 32 * 16 * 4 + 32 * 4;
  EXPECT_DOUBLE_EQ(model.backward_cost(32).flops, backward);
}

// The bytes of every gradient of `model`, in definition order (for bitwise comparisons).
std::vector<float> gradients_of(const dp::Model& model) {
  return model.flat_gradients();
}

TEST(Model, TheFirstLayerComputesNoInputGradientAndTheParameterGradientsAreUnchanged) {
  // Model::backward runs the first layer without its input gradient ...
  dp::Model model = dp::Model::mlp("6-8-5-3", {.layer_norm = true, .seed = 4});
  // ... against the same model through every layer's full backward, dx of fc1 included.
  dp::Model full = dp::Model::mlp("6-8-5-3", {.layer_norm = true, .seed = 4});
  const dp::Tensor input = random_input(7, 6);
  const std::vector<int> labels = {0, 1, 2, 0, 1, 2, 0};

  // Every tensor is counted as it is allocated: the two backwards differ by fc1's dx alone.
  const dp::MemoryTracker& tracker = dp::this_rank_memory().tracker();
  const dp::Tensor logits = model.forward(input);
  const std::size_t before_skipping = tracker.allocations_total();
  (void)model.backward(logits, labels);
  const std::size_t skipping_allocations = tracker.allocations_total() - before_skipping;

  dp::SoftmaxCrossEntropy loss;
  const dp::Tensor full_logits = full.forward(input);
  const std::size_t before_full = tracker.allocations_total();
  (void)loss.forward(full_logits, labels);
  dp::Tensor grad = loss.backward(1.0f);
  const std::span<dp::Layer* const> layers = full.layers();
  for (auto it = layers.rbegin(); it != layers.rend(); ++it) grad = (*it)->backward(grad);
  const std::size_t full_allocations = tracker.allocations_total() - before_full;
  ASSERT_EQ(grad.shape(), (std::vector<std::int64_t>{7, 6}));  // fc1's dx, which model skipped
  EXPECT_EQ(full_allocations - skipping_allocations, 1u)
      << "Model::backward allocated " << skipping_allocations << " tensors, the full backward "
      << full_allocations << ": the first layer's input gradient must not be computed";

  const std::vector<float> skipped = gradients_of(model);
  const std::vector<float> computed = gradients_of(full);
  ASSERT_EQ(skipped.size(), computed.size());
  EXPECT_EQ(std::memcmp(skipped.data(), computed.data(), skipped.size() * sizeof(float)), 0)
      << "skipping fc1's input gradient changed a parameter gradient";
}

TEST(Model, ALinearWithoutItsInputGradientReturnsNothingAndTheSameParameterGradients) {
  dp::Linear skipping("fc", 6, 4);
  dp::Linear full("fc", 6, 4);
  for (dp::Linear* layer : {&skipping, &full}) {
    dp::CounterRng weight_stream(5, 0);
    dp::CounterRng bias_stream(5, 1);
    layer->initialize(layer->weight(), weight_stream);
    layer->initialize(layer->bias(), bias_stream);
  }
  const dp::Tensor input = random_input(5, 6);
  const dp::Tensor grad_output = random_input(5, 4, 2);
  (void)skipping.forward(input);
  (void)full.forward(input);
  const dp::Tensor none = skipping.backward_parameters_only(grad_output);
  const dp::Tensor dx = full.backward(grad_output);
  EXPECT_EQ(none.rank(), 0u) << "an input gradient was returned";
  EXPECT_EQ(dx.shape(), (std::vector<std::int64_t>{5, 6}));
  for (const auto& [mine, theirs] :
       {std::pair{&skipping.weight(), &full.weight()}, std::pair{&skipping.bias(), &full.bias()}})
    EXPECT_EQ(std::memcmp(mine->grad.data(), theirs->grad.data(), mine->grad.bytes()), 0)
        << mine->name;
  // One product fewer: 2 B in out flops (dW) and the bias sum, not 4 B in out.
  EXPECT_DOUBLE_EQ(skipping.backward_parameters_only_cost(5).flops, 2.0 * 5 * 6 * 4 + 5 * 4);
  EXPECT_LT(skipping.backward_parameters_only_cost(5).bytes, skipping.backward_cost(5).bytes);
  // Each forward allows one backward, with or without the input gradient.
  EXPECT_NE(error_message([&] {
              (void)skipping.backward_parameters_only(grad_output);
            }).find("without a forward"),
            std::string::npos);
}

}  // namespace
