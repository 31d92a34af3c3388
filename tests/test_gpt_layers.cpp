// Unit tests of the GPT layers (dp::Embedding, dp::CausalSelfAttention, dp::LanguageModelHead,
// dp::TransformerBlock): forward against a reference written here in double precision, and
// backward against central finite differences of that reference, for the input and every
// parameter, on small random shapes (T = 1 and one head among them); the causal mask; the
// parameters' names, shapes and initialisation; the activations' memory; bad input.
//
// Why a double reference rather than differences of the float layer: a central difference
// of a float32 forward with step h has a rounding error near 1e-7 |L| / h, which forces a
// step large enough (1e-2) for the truncation error h^2 f''' / 6 to show, and a tolerance
// loose enough (1e-2 relative, as test_layers.cpp) to hide a small mistake. In double, with
// h = 1e-6, both errors are below 1e-8, so the numeric gradient is exact to far below float
// precision and the tolerance only has to cover the float32 rounding of the layer itself
// (see kGradientTolerance). The forward check ties the reference to the layer, so the two
// checks together say that backward is the derivative of the float forward.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <numbers>
#include <span>
#include <string>
#include <vector>

#include "dp/error.h"
#include "dp/layers/attention.h"
#include "dp/layers/embedding.h"
#include "dp/layers/lm_head.h"
#include "dp/layers/transformer_block.h"
#include "dp/memory.h"
#include "dp/rng.h"
#include "dp/tensor.h"
#include "test_support.h"

namespace {

using Values = std::vector<double>;
// A reference forward: (input, parameters in the layer's order) -> output, all in double.
using Reference = std::function<Values(const Values&, const std::vector<Values>&)>;

// The message of the dp::Error that `action` throws (a test failure if it throws none).
std::string error_message(const std::function<void()>& action) {
  return dp::testing::message_of<dp::Error>(action);
}

// Fills `values` with uniform values in [low, high) from stream `stream` of seed 11.
void fill_uniform(std::span<float> values, std::uint64_t stream, float low = -1.0f,
                  float high = 1.0f) {
  dp::CounterRng rng(11, stream);
  for (float& value : values) value = rng.uniform(low, high);
}

Values to_double(std::span<const float> values) {
  return Values(values.begin(), values.end());
}

// ---- The reference, in double ----------------------------------------------------------

// (rows, out) = x (rows, in) W^T + b, W (out, in).
Values linear(const Values& x, std::int64_t in, const Values& weight, const Values& bias) {
  const std::int64_t out = static_cast<std::int64_t>(bias.size());
  const std::int64_t rows = static_cast<std::int64_t>(x.size()) / in;
  Values y(static_cast<std::size_t>(rows * out));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t o = 0; o < out; ++o) {
      double sum = bias[o];
      for (std::int64_t i = 0; i < in; ++i) sum += x[r * in + i] * weight[o * in + i];
      y[r * out + o] = sum;
    }
  return y;
}

// LayerNorm over rows of `width`, biased variance, eps 1e-5 (dp::LayerNorm's default).
Values layer_norm(const Values& x, const Values& gamma, const Values& beta) {
  const std::int64_t width = static_cast<std::int64_t>(gamma.size());
  const std::int64_t rows = static_cast<std::int64_t>(x.size()) / width;
  Values y(x.size());
  for (std::int64_t r = 0; r < rows; ++r) {
    double mean = 0.0;
    for (std::int64_t j = 0; j < width; ++j) mean += x[r * width + j];
    mean /= static_cast<double>(width);
    double variance = 0.0;
    for (std::int64_t j = 0; j < width; ++j)
      variance += (x[r * width + j] - mean) * (x[r * width + j] - mean);
    variance /= static_cast<double>(width);
    for (std::int64_t j = 0; j < width; ++j)
      y[r * width + j] =
          gamma[j] * (x[r * width + j] - mean) / std::sqrt(variance + 1e-5) + beta[j];
  }
  return y;
}

// GELU, tanh approximation.
Values gelu(Values x) {
  const double c = std::sqrt(2.0 / std::numbers::pi);
  for (double& v : x) v = 0.5 * v * (1.0 + std::tanh(c * (v + 0.044715 * v * v * v)));
  return x;
}

// Causal self-attention on rows (B T, C); parameters {c_attn.weight, c_attn.bias,
// c_proj.weight, c_proj.bias}. Written from the definition: scores for j <= i only.
Values reference_attention(const Values& x, std::int64_t time, std::int64_t dim, std::int64_t heads,
                           const std::vector<Values>& p) {
  const Values qkv = linear(x, dim, p[0], p[1]);  // (B T, 3C)
  const std::int64_t batch = static_cast<std::int64_t>(x.size()) / (time * dim);
  const std::int64_t d = dim / heads;
  auto at = [&](std::int64_t b, std::int64_t t, std::int64_t part, std::int64_t h, std::int64_t e) {
    return qkv[(b * time + t) * 3 * dim + part * dim + h * d + e];
  };
  Values y(x.size(), 0.0);
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t i = 0; i < time; ++i) {
        Values scores(static_cast<std::size_t>(i + 1));
        for (std::int64_t j = 0; j <= i; ++j) {
          double dot = 0.0;
          for (std::int64_t e = 0; e < d; ++e) dot += at(b, i, 0, h, e) * at(b, j, 1, h, e);
          scores[j] = dot / std::sqrt(static_cast<double>(d));
        }
        double total = 0.0;
        for (double s : scores) total += std::exp(s);
        for (std::int64_t j = 0; j <= i; ++j)
          for (std::int64_t e = 0; e < d; ++e)
            y[(b * time + i) * dim + h * d + e] += std::exp(scores[j]) / total * at(b, j, 2, h, e);
      }
  return linear(y, dim, p[2], p[3]);
}

void add_into(Values& y, const Values& x) {
  for (std::size_t i = 0; i < y.size(); ++i) y[i] += x[i];
}

// A pre-LayerNorm block on rows (B T, C), parameters in TransformerBlock's order.
Values reference_block(const Values& x, std::int64_t time, std::int64_t dim, std::int64_t heads,
                       const std::vector<Values>& p) {
  Values residual = x;
  add_into(residual, reference_attention(layer_norm(residual, p[0], p[1]), time, dim, heads,
                                         {p[2], p[3], p[4], p[5]}));
  const Values hidden = gelu(linear(layer_norm(residual, p[6], p[7]), dim, p[8], p[9]));
  add_into(residual, linear(hidden, 4 * dim, p[10], p[11]));
  return residual;
}

// ---- The checks ----------------------------------------------------------------------------

// The float32 layer against the double reference: its forward within a few float ulps of
// the output's scale, its backward within this of the exact derivative,
//   |analytic - numeric| <= kGradientTolerance * (1 + |numeric|).
// A gradient element here is a sum of at most a few hundred float products of O(1) terms,
// each rounded to 2^-24 (6e-8) relative: the worst bound is near 1e-5, and the largest
// error seen over these shapes is 3e-7. 1e-5 leaves room for another BLAS's order of
// summation; a wrong factor, a missing term or a transposed head is off by 1e-2 or more.
constexpr double kForwardTolerance = 1e-5;
constexpr double kGradientTolerance = 1e-5;
// The central difference's step, in double: truncation error h^2 f''' / 6 and rounding error
// 1e-16 |L| / h are both below 1e-8 for these O(1) functions.
constexpr double kStep = 1e-6;

// Checks `layer` (whose parameters hold random values) on `input` against `reference`:
// the forward values, then backward with the objective L = <y, r> for a random r, against
// central differences of the reference for every input element (when `input_gradient`) and
// every parameter element.
void check_against_reference(dp::Layer& layer, const dp::Tensor& input, const Reference& reference,
                             bool input_gradient) {
  SCOPED_TRACE(layer.name() + " on input " + input.shape_string());
  std::vector<dp::Parameter*> parameters = layer.parameters();
  std::vector<Values> reference_parameters;
  for (dp::Parameter* parameter : parameters) {
    parameter->grad.fill(0.0f);
    reference_parameters.push_back(to_double(parameter->value.span()));
  }
  Values reference_input = to_double(input.span());

  const dp::Tensor output = layer.forward(input);
  const Values expected = reference(reference_input, reference_parameters);
  ASSERT_EQ(output.size(), expected.size());
  double output_scale = 0.0;
  for (double v : expected) output_scale = std::max(output_scale, std::abs(v));
  for (std::size_t i = 0; i < expected.size(); ++i)
    ASSERT_NEAR(output.span()[i], expected[i], kForwardTolerance * (1.0 + output_scale))
        << "output element " << i;

  dp::Tensor projection(output.shape());  // r = dL/dy
  fill_uniform(projection.span(), 99);
  const dp::Tensor grad_input = layer.backward(projection);
  const Values r = to_double(projection.span());
  const auto objective = [&] {
    const Values y = reference(reference_input, reference_parameters);
    double sum = 0.0;
    for (std::size_t i = 0; i < y.size(); ++i) sum += y[i] * r[i];
    return sum;
  };
  // Compares analytic[i] with the central difference of the objective in values[i].
  const auto check = [&](Values& values, std::span<const float> analytic, const std::string& what) {
    ASSERT_EQ(values.size(), analytic.size()) << what;
    double worst = 0.0;
    std::size_t worst_index = 0;
    for (std::size_t i = 0; i < values.size(); ++i) {
      const double original = values[i];
      values[i] = original + kStep;
      const double plus = objective();
      values[i] = original - kStep;
      const double minus = objective();
      values[i] = original;
      const double numeric = (plus - minus) / (2.0 * kStep);
      const double error = std::abs(analytic[i] - numeric) / (1.0 + std::abs(numeric));
      if (error > worst) {
        worst = error;
        worst_index = i;
      }
    }
    EXPECT_LE(worst, kGradientTolerance) << what << ": worst at element " << worst_index;
  };

  if (input_gradient) {
    ASSERT_EQ(grad_input.shape(), input.shape());
    check(reference_input, grad_input.span(), "input gradient");
  } else {
    EXPECT_TRUE(grad_input.empty()) << "ids have no gradient";
  }
  for (std::size_t p = 0; p < parameters.size(); ++p)
    check(reference_parameters[p], parameters[p]->grad.span(), parameters[p]->name);
}

// Sets every parameter of `layer` to uniform values in [-0.5, 0.5): LayerNorm's 1 and 0 and
// zero biases would leave terms of the gradient unchecked.
void randomize_parameters(dp::Layer& layer) {
  std::uint64_t stream = 1;
  for (dp::Parameter* parameter : layer.parameters())
    fill_uniform(parameter->value.span(), stream++, -0.5f, 0.5f);
}

// Random token ids in [0, vocab), stored as floats, (batch, time).
dp::Tensor random_ids(std::int64_t batch, std::int64_t time, std::int64_t vocab) {
  dp::Tensor ids({batch, time});
  dp::CounterRng rng(11, 5);
  for (float& id : ids.span())
    id = static_cast<float>(rng.below(static_cast<std::uint64_t>(vocab)));
  return ids;
}

dp::Tensor random_input(std::int64_t batch, std::int64_t time, std::int64_t dim) {
  dp::Tensor input({batch, time, dim});
  fill_uniform(input.span(), 7);
  return input;
}

// ---- Embedding -----------------------------------------------------------------------------

TEST(Embedding, ForwardAndBackwardMatchTheReference) {
  struct Shape {
    std::int64_t batch, time, vocab, context, dim;
  };
  for (const Shape& s : {Shape{2, 5, 7, 6, 3}, Shape{1, 1, 4, 3, 2}, Shape{3, 4, 3, 4, 5}}) {
    dp::Embedding embed("embed", s.vocab, s.context, s.dim);
    randomize_parameters(embed);
    const dp::Tensor ids = random_ids(s.batch, s.time, s.vocab);
    const Reference reference = [&](const Values& x, const std::vector<Values>& p) {
      Values y(static_cast<std::size_t>(s.batch * s.time * s.dim));
      for (std::int64_t b = 0; b < s.batch; ++b)
        for (std::int64_t t = 0; t < s.time; ++t)
          for (std::int64_t c = 0; c < s.dim; ++c) {
            const auto id = static_cast<std::int64_t>(x[b * s.time + t]);
            y[(b * s.time + t) * s.dim + c] = p[0][id * s.dim + c] + p[1][t * s.dim + c];
          }
      return y;
    };
    check_against_reference(embed, ids, reference, /*input_gradient=*/false);
  }
}

TEST(Embedding, ParametersAreNamedAsGpt2AndDrawnWithStd002) {
  dp::Embedding embed("embedding", 50, 16, 32);
  const std::vector<dp::Parameter*> parameters = embed.parameters();
  ASSERT_EQ(parameters.size(), 2u);
  EXPECT_EQ(parameters[0]->name, "wte.weight");
  EXPECT_EQ(parameters[0]->value.shape(), (std::vector<std::int64_t>{50, 32}));
  EXPECT_EQ(parameters[1]->name, "wpe.weight");
  EXPECT_EQ(parameters[1]->value.shape(), (std::vector<std::int64_t>{16, 32}));
  EXPECT_EQ(embed.kind(), "embedding");
  dp::CounterRng rng(3, 0);
  embed.initialize(*parameters[0], rng);
  double squares = 0.0;
  for (float v : parameters[0]->value.span()) squares += double{v} * v;
  const double std = std::sqrt(squares / static_cast<double>(parameters[0]->value.size()));
  EXPECT_NEAR(std, 0.02, 0.002);  // 1600 draws: the sample std is within 3% of 0.02
}

TEST(Embedding, BackwardAccumulatesAndSkipsFrozenParameters) {
  dp::Embedding embed("embed", 5, 4, 3);
  randomize_parameters(embed);
  const dp::Tensor ids = random_ids(2, 4, 5);
  dp::Tensor grad({2, 4, 3});
  fill_uniform(grad.span(), 8);
  embed.forward(ids);
  embed.backward(grad);
  const std::vector<float> once(embed.token_weight().grad.span().begin(),
                                embed.token_weight().grad.span().end());
  embed.position_weight().frozen = true;
  embed.position_weight().grad.fill(0.0f);
  embed.forward(ids);
  embed.backward(grad);
  for (std::size_t i = 0; i < once.size(); ++i)
    EXPECT_FLOAT_EQ(embed.token_weight().grad.span()[i], 2 * once[i]);
  for (float v : embed.position_weight().grad.span()) EXPECT_EQ(v, 0.0f);
}

TEST(Embedding, RejectsIdsThatAreNotIntegersInTheVocabulary) {
  dp::Embedding embed("embed", 7, 4, 2);
  const auto message_for = [&](float bad) {
    dp::Tensor ids({2, 3});  // zeros: valid
    ids.at(1, 2) = bad;
    return error_message([&] { embed.forward(ids); });
  };
  for (const float bad : {3.5f, -1.0f, 7.0f, std::numeric_limits<float>::quiet_NaN()}) {
    const std::string message = message_for(bad);
    EXPECT_TRUE(dp::testing::contains(message, "embed: the token id at (b = 1, t = 2) is"))
        << message;
    EXPECT_TRUE(dp::testing::contains(message, "expected an integer in [0, 7)")) << message;
  }
  EXPECT_TRUE(dp::testing::contains(message_for(3.5f), "is 3.5,"));
  const std::string too_long = error_message([&] { embed.forward(dp::Tensor({1, 5})); });
  EXPECT_TRUE(dp::testing::contains(
      too_long,
      "embed expects token ids of shape (B, T) with 1 <= T <= 4 (its context), got "
      "(1, 5)"))
      << too_long;
  const std::string wrong_rank = error_message([&] { embed.forward(dp::Tensor({1, 2, 2})); });
  EXPECT_TRUE(dp::testing::contains(wrong_rank, "got (1, 2, 2)")) << wrong_rank;
  const std::string no_forward = error_message([&] { embed.backward(dp::Tensor({1, 2, 2})); });
  EXPECT_TRUE(dp::testing::contains(no_forward, "backward called without a forward")) << no_forward;
  const std::string sizes = error_message([] { dp::Embedding("e", 0, 4, 2); });
  EXPECT_TRUE(dp::testing::contains(sizes, "got vocab = 0, context = 4, dim = 2")) << sizes;
  const std::string huge = error_message([] { dp::Embedding("e", (1 << 24) + 1, 4, 2); });
  EXPECT_TRUE(dp::testing::contains(huge, "at most 2^24")) << huge;
}

// ---- CausalSelfAttention ---------------------------------------------------------------

struct AttentionShape {
  std::int64_t batch, time, dim, heads;
};
// T = 1 and one head among them, and T below the context.
const std::vector<AttentionShape> kAttentionShapes = {
    {2, 5, 8, 2}, {1, 1, 4, 1}, {3, 4, 6, 1}, {2, 3, 8, 4}, {1, 6, 4, 2}};

TEST(CausalSelfAttention, ForwardAndBackwardMatchTheReference) {
  for (const AttentionShape& s : kAttentionShapes) {
    dp::CausalSelfAttention attn("attn", s.dim, s.heads, /*context=*/6);
    randomize_parameters(attn);
    const Reference reference = [&](const Values& x, const std::vector<Values>& p) {
      return reference_attention(x, s.time, s.dim, s.heads, p);
    };
    check_against_reference(attn, random_input(s.batch, s.time, s.dim), reference, true);
  }
}

TEST(CausalSelfAttention, IsStableForLargeScores) {
  // Scores near 1e4: exp() without the row maximum taken out would overflow to inf.
  dp::CausalSelfAttention attn("attn", 4, 1, 3);
  randomize_parameters(attn);
  for (float& w : attn.qkv_projection().weight().value.span()) w *= 200.0f;
  dp::Tensor input = random_input(1, 3, 4);
  const dp::Tensor output = attn.forward(input);
  for (float v : output.span()) EXPECT_TRUE(std::isfinite(v)) << v;
  const dp::Tensor grad_input = attn.backward(dp::Tensor({1, 3, 4}));
  for (float v : grad_input.span()) EXPECT_TRUE(std::isfinite(v)) << v;
}

// Changing the token at position `changed` of sequence 0 changes no output before it, bit
// for bit, and no output of sequence 1; it changes the output at `changed`.
void expect_causal(dp::Layer& layer, std::int64_t time, std::int64_t dim, std::int64_t changed) {
  SCOPED_TRACE(layer.name());
  dp::Tensor input = random_input(2, time, dim);
  const dp::Tensor before = layer.forward(input);
  for (std::int64_t c = 0; c < dim; ++c)
    input.span()[changed * dim + c] += 0.25f * static_cast<float>(c + 1);
  const dp::Tensor after = layer.forward(input);
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t t = 0; t < time; ++t) {
      if (b == 0 && t >= changed) continue;
      for (std::int64_t c = 0; c < dim; ++c) {
        const std::size_t i = static_cast<std::size_t>((b * time + t) * dim + c);
        ASSERT_EQ(before.span()[i], after.span()[i]) << "b " << b << " t " << t << " c " << c;
      }
    }
  bool moved = false;
  for (std::int64_t c = 0; c < dim; ++c) {
    const std::size_t i = static_cast<std::size_t>(changed * dim + c);
    moved = moved || before.span()[i] != after.span()[i];
  }
  EXPECT_TRUE(moved) << "the changed token's own output did not change";
}

TEST(CausalSelfAttention, ALaterTokenChangesNoEarlierOutput) {
  dp::CausalSelfAttention attn("attn", 8, 2, 6);
  randomize_parameters(attn);
  for (std::int64_t changed : {1, 3, 5}) expect_causal(attn, 6, 8, changed);
}

TEST(CausalSelfAttention, ParametersAreNamedAsGpt2) {
  dp::CausalSelfAttention attn("h.3.attn", 8, 2, 4);
  const std::vector<dp::Parameter*> parameters = attn.parameters();
  ASSERT_EQ(parameters.size(), 4u);
  EXPECT_EQ(parameters[0]->name, "h.3.attn.c_attn.weight");
  EXPECT_EQ(parameters[0]->value.shape(), (std::vector<std::int64_t>{24, 8}));
  EXPECT_EQ(parameters[1]->name, "h.3.attn.c_attn.bias");
  EXPECT_EQ(parameters[2]->name, "h.3.attn.c_proj.weight");
  EXPECT_EQ(parameters[2]->value.shape(), (std::vector<std::int64_t>{8, 8}));
  EXPECT_EQ(parameters[3]->name, "h.3.attn.c_proj.bias");
  EXPECT_EQ(attn.kind(), "attention");
}

TEST(CausalSelfAttention, RejectsBadSizesAndShapes) {
  const std::string heads = error_message([] { dp::CausalSelfAttention("a", 10, 4, 8); });
  EXPECT_TRUE(dp::testing::contains(heads, "attention a: 4 heads do not divide dim = 10")) << heads;
  const std::string sizes = error_message([] { dp::CausalSelfAttention("a", 8, 0, 8); });
  EXPECT_TRUE(dp::testing::contains(sizes, "got dim = 8, heads = 0, context = 8")) << sizes;
  dp::CausalSelfAttention attn("attn", 8, 2, 4);
  const std::string width = error_message([&] { attn.forward(dp::Tensor({2, 3, 6})); });
  EXPECT_TRUE(dp::testing::contains(
      width, "attn expects input of shape (B, T, 8) with 1 <= T <= 4, got (2, 3, 6)"))
      << width;
  const std::string too_long = error_message([&] { attn.forward(dp::Tensor({2, 5, 8})); });
  EXPECT_TRUE(dp::testing::contains(too_long, "got (2, 5, 8)")) << too_long;
  const std::string rows = error_message([&] { attn.forward_rows(dp::Tensor({7, 8}), 2); });
  EXPECT_TRUE(dp::testing::contains(rows, "got (7, 8) for T = 2")) << rows;
  const std::string no_forward = error_message([&] { attn.backward(dp::Tensor({1, 2, 8})); });
  EXPECT_TRUE(dp::testing::contains(no_forward, "backward called without a forward")) << no_forward;
  attn.forward(dp::Tensor({2, 3, 8}));
  const std::string grad = error_message([&] { attn.backward(dp::Tensor({2, 4, 8})); });
  EXPECT_TRUE(dp::testing::contains(
      grad,
      "attn backward expects a gradient of shape (2, 3, 8) like its last output, got "
      "(2, 4, 8)"))
      << grad;
}

// ---- TransformerBlock ------------------------------------------------------------------

TEST(TransformerBlock, ForwardAndBackwardMatchTheReference) {
  for (const AttentionShape& s : kAttentionShapes) {
    dp::TransformerBlock block("h.0", s.dim, s.heads, /*context=*/6, /*layers=*/2);
    randomize_parameters(block);
    const Reference reference = [&](const Values& x, const std::vector<Values>& p) {
      return reference_block(x, s.time, s.dim, s.heads, p);
    };
    check_against_reference(block, random_input(s.batch, s.time, s.dim), reference, true);
  }
}

TEST(TransformerBlock, ALaterTokenChangesNoEarlierOutput) {
  dp::TransformerBlock block("h.0", 8, 2, 6, 1);
  randomize_parameters(block);
  for (std::int64_t changed : {1, 4}) expect_causal(block, 6, 8, changed);
}

TEST(TransformerBlock, ParametersAreNamedAndShapedAsGpt2) {
  dp::TransformerBlock block("h.1", 8, 2, 4, 3);
  const std::vector<std::pair<std::string, std::vector<std::int64_t>>> expected = {
      {"h.1.ln_1.weight", {8}},
      {"h.1.ln_1.bias", {8}},
      {"h.1.attn.c_attn.weight", {24, 8}},
      {"h.1.attn.c_attn.bias", {24}},
      {"h.1.attn.c_proj.weight", {8, 8}},
      {"h.1.attn.c_proj.bias", {8}},
      {"h.1.ln_2.weight", {8}},
      {"h.1.ln_2.bias", {8}},
      {"h.1.mlp.c_fc.weight", {32, 8}},
      {"h.1.mlp.c_fc.bias", {32}},
      {"h.1.mlp.c_proj.weight", {8, 32}},
      {"h.1.mlp.c_proj.bias", {8}}};
  const std::vector<dp::Parameter*> parameters = block.parameters();
  ASSERT_EQ(parameters.size(), expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(parameters[i]->name, expected[i].first);
    EXPECT_EQ(parameters[i]->value.shape(), expected[i].second) << expected[i].first;
    EXPECT_EQ(parameters[i]->grad.shape(), expected[i].second) << expected[i].first;
  }
  EXPECT_EQ(block.kind(), "transformer_block");
}

TEST(TransformerBlock, InitialisesAsGpt2) {
  const std::int64_t layers = 8;
  dp::TransformerBlock block("h.0", 64, 4, 4, layers);
  // The sample standard deviation of `parameter`'s values after initialising it.
  const auto drawn_std = [&](dp::Parameter& parameter) {
    dp::CounterRng rng(5, parameter.index);
    block.initialize(parameter, rng);
    double squares = 0.0;
    for (float v : parameter.value.span()) squares += double{v} * v;
    return std::sqrt(squares / static_cast<double>(parameter.value.size()));
  };
  // 4096 draws or more each: a sample std within 5% of the true one.
  EXPECT_NEAR(drawn_std(block.attention().qkv_projection().weight()), 0.02, 0.001);
  EXPECT_NEAR(drawn_std(block.mlp_fc().weight()), 0.02, 0.001);
  const double branch_std = 0.02 / std::sqrt(2.0 * layers);
  EXPECT_NEAR(drawn_std(block.attention().output_projection().weight()), branch_std,
              0.05 * branch_std);
  EXPECT_NEAR(drawn_std(block.mlp_proj().weight()), branch_std, 0.05 * branch_std);
  for (dp::Parameter* bias :
       {&block.attention().qkv_projection().bias(), &block.mlp_fc().bias(), &block.ln_1().bias()}) {
    bias->value.fill(3.0f);
    EXPECT_EQ(drawn_std(*bias), 0.0) << bias->name;
  }
  block.ln_2().weight().value.fill(3.0f);
  dp::CounterRng rng(5, 0);
  block.initialize(block.ln_2().weight(), rng);
  for (float v : block.ln_2().weight().value.span()) EXPECT_EQ(v, 1.0f);
}

TEST(TransformerBlock, ChargesItsActivationsAndReleasesThemInBackward) {
  auto memory = std::make_shared<dp::RankMemory>();
  dp::ScopedRankMemory bind(memory);
  const std::int64_t batch = 2, time = 3, dim = 8, heads = 2;
  dp::TransformerBlock block("h.0", dim, heads, 4, 1);
  randomize_parameters(block);
  const dp::Tensor input = random_input(batch, time, dim);
  const std::size_t start = memory->tracker().current(dp::MemoryCategory::kActivations);
  const dp::Tensor output = block.forward(input);
  const std::size_t rows = batch * time;
  const std::size_t row_elements = rows * dim;
  // Saved: ln_1's and ln_2's xhat (and one 1/std per row each), the inputs of c_attn,
  // c_proj and c_fc, [q | k | v], P (B, H, T, T), the GELU's and mlp.c_proj's inputs (4C
  // each); and the output itself.
  const std::size_t saved = 2 * (row_elements + rows) + 3 * row_elements + 3 * row_elements +
                            batch * heads * time * time + 2 * 4 * row_elements;
  EXPECT_EQ(memory->tracker().current(dp::MemoryCategory::kActivations) - start,
            (saved + row_elements) * sizeof(float));
  const dp::Tensor grad_input = block.backward(output);
  EXPECT_EQ(memory->tracker().current(dp::MemoryCategory::kActivations) - start,
            2 * row_elements * sizeof(float))
      << "only the output and the input gradient remain";
}

// The whole point of activation checkpointing: the same bits for a fraction of the memory.
TEST(TransformerBlock, ActivationCheckpointingKeepsTheInputAndGivesTheSameBits) {
  auto memory = std::make_shared<dp::RankMemory>();
  dp::ScopedRankMemory bind(memory);
  const std::int64_t batch = 2, time = 3, dim = 8, heads = 2;
  const std::size_t row_elements = batch * time * dim;
  dp::TransformerBlock keeping("h.0", dim, heads, 4, 1);
  dp::TransformerBlock checkpointed("h.0", dim, heads, 4, 1);
  checkpointed.set_activation_checkpointing(true);
  EXPECT_TRUE(checkpointed.activation_checkpointing());
  randomize_parameters(keeping);
  randomize_parameters(checkpointed);
  const dp::Tensor input = random_input(batch, time, dim);
  const dp::Tensor kept_output = keeping.forward(input);
  const dp::Tensor kept_grad_input = keeping.backward(kept_output);

  const std::size_t start = memory->tracker().current(dp::MemoryCategory::kActivations);
  const dp::Tensor output = checkpointed.forward(input);
  EXPECT_EQ(memory->tracker().current(dp::MemoryCategory::kActivations) - start,
            2 * row_elements * sizeof(float))
      << "a checkpointed block keeps a copy of its input, beside its output, and nothing else";
  EXPECT_TRUE(std::ranges::equal(output.span(), kept_output.span()));
  const dp::Tensor grad_input = checkpointed.backward(output);
  EXPECT_EQ(memory->tracker().current(dp::MemoryCategory::kActivations) - start,
            2 * row_elements * sizeof(float))
      << "backward recomputes what it needs and releases it, and the input copy";
  EXPECT_TRUE(std::ranges::equal(grad_input.span(), kept_grad_input.span()));
  const std::vector<dp::Parameter*> kept = keeping.parameters();
  const std::vector<dp::Parameter*> recomputed = checkpointed.parameters();
  for (std::size_t p = 0; p < kept.size(); ++p)
    EXPECT_TRUE(std::ranges::equal(recomputed[p]->grad.span(), kept[p]->grad.span()))
        << kept[p]->name << ": the recomputed forward must give bitwise the same gradient";

  // The recomputation is charged: one more forward in each backward.
  EXPECT_DOUBLE_EQ(checkpointed.backward_cost(batch).flops,
                   keeping.backward_cost(batch).flops + keeping.forward_cost(batch).flops);
  const std::string again = error_message([&] { (void)checkpointed.backward(output); });
  EXPECT_NE(again.find("backward called without a forward"), std::string::npos) << again;
}

TEST(GptLayers, DiscardSavedMakesBackwardRefuseUntilTheNextForward) {
  auto memory = std::make_shared<dp::RankMemory>();
  dp::ScopedRankMemory bind(memory);
  dp::TransformerBlock block("h.0", 8, 2, 4, 1);
  randomize_parameters(block);
  const dp::Tensor input = random_input(2, 3, 8);
  const std::size_t start = memory->tracker().current(dp::MemoryCategory::kActivations);
  const dp::Tensor output = block.forward(input);
  block.discard_saved();
  EXPECT_EQ(memory->tracker().current(dp::MemoryCategory::kActivations) - start, output.bytes())
      << "only the output is left";
  const std::string message = error_message([&] { (void)block.backward(output); });
  EXPECT_NE(message.find("backward called without a forward"), std::string::npos) << message;
}

TEST(TransformerBlock, RejectsBadSizesAndShapes) {
  const std::string heads = error_message([] { dp::TransformerBlock("h.0", 10, 3, 8, 1); });
  EXPECT_TRUE(dp::testing::contains(heads, "transformer block h.0: 3 heads do not divide dim = 10"))
      << heads;
  const std::string sizes = error_message([] { dp::TransformerBlock("h.0", 8, 2, 8, 0); });
  EXPECT_TRUE(dp::testing::contains(sizes, "layers = 0")) << sizes;
  dp::TransformerBlock block("h.2", 8, 2, 4, 1);
  const std::string shape = error_message([&] { block.forward(dp::Tensor({6, 8})); });
  EXPECT_TRUE(dp::testing::contains(
      shape, "h.2 expects input of shape (B, T, 8) with 1 <= T <= 4, got (6, 8)"))
      << shape;
  const std::string no_forward = error_message([&] { block.backward(dp::Tensor({1, 2, 8})); });
  EXPECT_TRUE(dp::testing::contains(no_forward, "h.2: backward called without a forward"))
      << no_forward;
}

// ---- LanguageModelHead ---------------------------------------------------------------------

TEST(LanguageModelHead, ForwardAndBackwardMatchTheReference) {
  struct Shape {
    std::int64_t batch, time, dim, vocab;
  };
  for (const Shape& s : {Shape{2, 5, 8, 7}, Shape{1, 1, 4, 3}, Shape{3, 2, 6, 11}}) {
    dp::LanguageModelHead head("head", s.dim, s.vocab, /*context=*/6);
    randomize_parameters(head);
    const Reference reference = [&](const Values& x, const std::vector<Values>& p) {
      return linear(layer_norm(x, p[0], p[1]), s.dim, p[2], Values(s.vocab, 0.0));
    };
    check_against_reference(head, random_input(s.batch, s.time, s.dim), reference, true);
  }
}

TEST(LanguageModelHead, GivesOneRowOfLogitsPerToken) {
  dp::LanguageModelHead head("head", 4, 5, 3);
  randomize_parameters(head);
  dp::Tensor input = random_input(2, 3, 4);
  const dp::Tensor logits = head.forward(input);
  EXPECT_EQ(logits.shape(), (std::vector<std::int64_t>{6, 5}));
  // The token (b = 1, t = 2) alone, as a batch of one sequence of one token: row 1 * 3 + 2.
  dp::Tensor token({1, 1, 4});
  for (std::int64_t c = 0; c < 4; ++c) token.span()[c] = input.span()[(1 * 3 + 2) * 4 + c];
  const dp::Tensor alone = head.forward(token);
  for (std::int64_t v = 0; v < 5; ++v) EXPECT_FLOAT_EQ(alone.at(0, v), logits.at(5, v));
}

TEST(LanguageModelHead, ParametersAreNamedAsGpt2AndInitialised) {
  dp::LanguageModelHead head("head", 8, 5, 4);
  const std::vector<dp::Parameter*> parameters = head.parameters();
  ASSERT_EQ(parameters.size(), 3u);
  EXPECT_EQ(parameters[0]->name, "ln_f.weight");
  EXPECT_EQ(parameters[1]->name, "ln_f.bias");
  EXPECT_EQ(parameters[2]->name, "lm_head.weight");
  EXPECT_EQ(parameters[2]->value.shape(), (std::vector<std::int64_t>{5, 8}));
  EXPECT_EQ(head.kind(), "lm_head");
  dp::CounterRng rng(1, 0);
  head.initialize(*parameters[0], rng);
  for (float v : parameters[0]->value.span()) EXPECT_EQ(v, 1.0f);
  head.initialize(*parameters[2], rng);
  for (float v : parameters[2]->value.span()) EXPECT_LT(std::abs(v), 0.2f);  // 10 std
  EXPECT_NE(parameters[2]->value.span()[0], 0.0f);
}

TEST(LanguageModelHead, RejectsBadSizesAndShapes) {
  const std::string sizes = error_message([] { dp::LanguageModelHead("head", 8, 0, 4); });
  EXPECT_TRUE(dp::testing::contains(sizes, "got dim = 8, vocab = 0, context = 4")) << sizes;
  dp::LanguageModelHead head("head", 8, 5, 4);
  const std::string shape = error_message([&] { head.forward(dp::Tensor({6, 8})); });
  EXPECT_TRUE(dp::testing::contains(
      shape, "head expects input of shape (B, T, 8) with 1 <= T <= 4, got (6, 8)"))
      << shape;
  head.forward(dp::Tensor({2, 3, 8}));
  const std::string grad = error_message([&] { head.backward(dp::Tensor({2, 3, 5})); });
  EXPECT_TRUE(dp::testing::contains(grad, "got (2, 3, 5)")) << grad;
}

// ---- Accumulation and frozen parameters ----------------------------------------------------

// Backward passes on the same batch add up (micro-batch accumulation relies on backward
// adding, not overwriting): two give twice the gradient of one. Then a frozen parameter's
// gradient (the last: the head's own projection) is left alone by a third pass, while the
// others reach three times the gradient of one.
void expect_accumulates_and_skips_frozen(dp::Layer& layer, const dp::Tensor& input) {
  SCOPED_TRACE(layer.name());
  randomize_parameters(layer);
  std::vector<dp::Parameter*> parameters = layer.parameters();
  for (dp::Parameter* parameter : parameters) parameter->grad.fill(0.0f);
  dp::Tensor grad(layer.forward(input).shape());
  fill_uniform(grad.span(), 21);
  layer.backward(grad);
  std::vector<std::vector<float>> once;
  for (dp::Parameter* parameter : parameters)
    once.emplace_back(parameter->grad.span().begin(), parameter->grad.span().end());
  // Expects every parameter but the first `skipped_last` ones from the end at `times` once.
  const auto expect_multiple = [&](float times, std::size_t skipped_last) {
    for (std::size_t p = 0; p + skipped_last < parameters.size(); ++p)
      for (std::size_t i = 0; i < once[p].size(); ++i)
        ASSERT_NEAR(parameters[p]->grad.span()[i], times * once[p][i],
                    1e-6 * (1 + std::abs(once[p][i])))
            << parameters[p]->name << " element " << i << " after " << times << " passes";
  };
  layer.forward(input);
  layer.backward(grad);
  expect_multiple(2.0f, 0);
  parameters.back()->frozen = true;
  parameters.back()->grad.fill(0.0f);
  layer.forward(input);
  layer.backward(grad);
  for (float v : parameters.back()->grad.span()) EXPECT_EQ(v, 0.0f) << parameters.back()->name;
  expect_multiple(3.0f, 1);
  parameters.back()->frozen = false;
}

TEST(GptLayers, BackwardAccumulatesAndSkipsFrozenParameters) {
  dp::CausalSelfAttention attn("attn", 8, 2, 4);
  expect_accumulates_and_skips_frozen(attn, random_input(2, 3, 8));
  dp::TransformerBlock block("h.0", 8, 2, 4, 1);
  expect_accumulates_and_skips_frozen(block, random_input(2, 3, 8));
  dp::LanguageModelHead head("head", 8, 5, 4);
  expect_accumulates_and_skips_frozen(head, random_input(2, 3, 8));
}

// ---- The emulated device -------------------------------------------------------------------

// Turns the emulated CUDA device on for one test, and off after it (every device tensor of
// the test is gone by then).
class GptLayersOnTheEmulatedDevice : public ::testing::Test {
 protected:
  void SetUp() override { dp::set_cuda_device_emulated(true); }
  void TearDown() override { dp::set_cuda_device_emulated(false); }
};

// Copies of `layer`'s parameters on the emulated device, for a twin built the same way.
void copy_parameters_to_device(dp::Layer& from, dp::Layer& to) {
  const std::vector<dp::Parameter*> source = from.parameters();
  const std::vector<dp::Parameter*> target = to.parameters();
  ASSERT_EQ(source.size(), target.size());
  for (std::size_t i = 0; i < source.size(); ++i) {
    target[i]->value = source[i]->value.to(dp::Device::kCuda);
    target[i]->grad = source[i]->grad.to(dp::Device::kCuda);
  }
}

std::vector<float> host_values(const dp::Tensor& tensor) {
  const dp::Tensor host = tensor.to(dp::Device::kHost);
  return {host.span().begin(), host.span().end()};
}

// The layers reach device tensors only through views (no host accessor, which a device
// tensor refuses), so on the emulated device they run and give the host's results bit for
// bit: what lets `--device emulated` grade labs on a GPT.
TEST_F(GptLayersOnTheEmulatedDevice, EveryLayerRunsAndMatchesTheHostBitwise) {
  dp::Embedding host_embed("embed", 7, 4, 8);
  dp::Embedding device_embed("embed", 7, 4, 8);
  dp::TransformerBlock host_block("h.0", 8, 2, 4, 1);
  dp::TransformerBlock device_block("h.0", 8, 2, 4, 1);
  dp::LanguageModelHead host_head("head", 8, 7, 4);
  dp::LanguageModelHead device_head("head", 8, 7, 4);
  const std::vector<dp::Layer*> host_layers = {&host_embed, &host_block, &host_head};
  const std::vector<dp::Layer*> device_layers = {&device_embed, &device_block, &device_head};
  for (std::size_t l = 0; l < host_layers.size(); ++l) {
    randomize_parameters(*host_layers[l]);
    copy_parameters_to_device(*host_layers[l], *device_layers[l]);
  }

  const dp::Tensor ids = random_ids(2, 3, 7);
  const dp::Tensor host_logits = host_head.forward(host_block.forward(host_embed.forward(ids)));
  const dp::Tensor device_logits =
      device_head.forward(device_block.forward(device_embed.forward(ids.to(dp::Device::kCuda))));
  EXPECT_EQ(device_logits.device(), dp::Device::kCuda);
  EXPECT_EQ(host_values(device_logits), host_values(host_logits));

  dp::Tensor grad({6, 7});
  fill_uniform(grad.span(), 12);
  host_embed.backward(host_block.backward(host_head.backward(grad)));
  device_embed.backward(device_block.backward(device_head.backward(grad.to(dp::Device::kCuda))));
  for (std::size_t l = 0; l < host_layers.size(); ++l) {
    const std::vector<dp::Parameter*> host_parameters = host_layers[l]->parameters();
    const std::vector<dp::Parameter*> device_parameters = device_layers[l]->parameters();
    for (std::size_t i = 0; i < host_parameters.size(); ++i)
      EXPECT_EQ(host_values(device_parameters[i]->grad), host_values(host_parameters[i]->grad))
          << host_parameters[i]->name;
  }
}

}  // namespace
