// Unit tests of the BLAS wrappers and the layers: forward values, backward against
// central finite differences, gradient accumulation, frozen parameters and bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "dp/error.h"
#include "dp/layers/cross_entropy.h"
#include "dp/layers/gelu.h"
#include "dp/layers/layer_norm.h"
#include "dp/layers/linear.h"
#include "dp/layers/relu.h"
#include "dp/memory.h"
#include "dp/ops.h"
#include "dp/rng.h"
#include "test_support.h"

namespace {

// The message of the dp::Error that `action` throws (a test failure if it throws none).
std::string error_message(const std::function<void()>& action) {
  return dp::testing::message_of<dp::Error>(action);
}

// Fills `tensor` with uniform values in [low, high) from stream `stream` of seed 7.
void fill_uniform(dp::Tensor& tensor, std::uint64_t stream, float low = -1.0f, float high = 1.0f) {
  dp::CounterRng rng(7, stream);
  for (float& value : tensor.span()) value = rng.uniform(low, high);
}

// sum_i a_i * b_i in double: a scalar objective L(y) = <y, r> whose gradient wrt y is r.
double dot(std::span<const float> a, std::span<const float> b) {
  double sum = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) sum += double{a[i]} * b[i];
  return sum;
}

// Compares `analytic` with the central difference (f(v + h) - f(v - h)) / 2h of
// `objective` for every element of `values` (perturbed in place and restored).
void expect_matches_finite_differences(std::span<float> values, std::span<const float> analytic,
                                       const std::function<double()>& objective,
                                       const std::string& what, float step = 1e-2f) {
  ASSERT_EQ(values.size(), analytic.size()) << what;
  for (std::size_t i = 0; i < values.size(); ++i) {
    const float original = values[i];
    values[i] = original + step;
    const double plus = objective();
    values[i] = original - step;
    const double minus = objective();
    values[i] = original;
    const double numeric = (plus - minus) / (2.0 * step);
    EXPECT_NEAR(analytic[i], numeric, 1e-3 + 1e-2 * std::abs(numeric)) << what << " element " << i;
  }
}

// Checks the input gradient and every parameter gradient of `layer` on a random
// (batch, in) input, using the objective <layer(x), r> with a random r.
void check_layer_gradients(dp::Layer& layer, std::int64_t batch, std::int64_t in, std::int64_t out,
                           float input_low = -1.0f, float input_high = 1.0f) {
  dp::Tensor input({batch, in});
  fill_uniform(input, 1, input_low, input_high);
  dp::Tensor projection({batch, out});  // r: dL/dy
  fill_uniform(projection, 2);
  for (dp::Parameter* parameter : layer.parameters()) parameter->grad.fill(0.0f);

  layer.forward(input);
  const dp::Tensor grad_input = layer.backward(projection);
  const auto objective = [&] { return dot(layer.forward(input).span(), projection.span()); };

  expect_matches_finite_differences(input.span(), grad_input.span(), objective,
                                    layer.name() + " input");
  for (dp::Parameter* parameter : layer.parameters())
    expect_matches_finite_differences(parameter->value.span(), parameter->grad.span(), objective,
                                      parameter->name);
}

// ---- BLAS wrappers ------------------------------------------------------------------------

TEST(Ops, GemmComputesTheProductOfTransposedOperands) {
  // A = [[1, 2, 3], [4, 5, 6]] (2, 3); B = [[1, 0], [0, 1], [1, 1]] (3, 2).
  const std::vector<float> a = {1, 2, 3, 4, 5, 6};
  const std::vector<float> b = {1, 0, 0, 1, 1, 1};
  std::vector<float> c(4, 100.0f);
  dp::gemm(dp::Transpose::kNo, dp::Transpose::kNo, 2, 2, 3, 1.0f, a.data(), 3, b.data(), 2, 0.0f,
           c.data(), 2);
  EXPECT_EQ(c, (std::vector<float>{4, 5, 10, 11}));

  // A^T A: (3, 2)(2, 3) = (3, 3), then add it once more with beta = 1.
  std::vector<float> gram(9, 0.0f);
  dp::gemm(dp::Transpose::kYes, dp::Transpose::kNo, 3, 3, 2, 1.0f, a.data(), 3, a.data(), 3, 0.0f,
           gram.data(), 3);
  EXPECT_EQ(gram, (std::vector<float>{17, 22, 27, 22, 29, 36, 27, 36, 45}));
  dp::gemm(dp::Transpose::kYes, dp::Transpose::kNo, 3, 3, 2, 2.0f, a.data(), 3, a.data(), 3, 1.0f,
           gram.data(), 3);
  EXPECT_EQ(gram[0], 51.0f);
  EXPECT_EQ(gram[8], 135.0f);
}

TEST(Ops, GemvAndMatmulAgree) {
  dp::Tensor a({3, 4});
  fill_uniform(a, 3);
  dp::Tensor x({4, 1});
  fill_uniform(x, 4);
  const dp::Tensor product = dp::matmul(a, dp::Transpose::kNo, x, dp::Transpose::kNo);  // (3, 1)
  ASSERT_EQ(product.shape(), (std::vector<std::int64_t>{3, 1}));
  std::vector<float> y(3, 0.0f);
  dp::gemv(dp::Transpose::kNo, 3, 4, 1.0f, a.data(), 4, x.data(), 0.0f, y.data());
  for (std::size_t i = 0; i < 3; ++i) {
    double expected = 0.0;
    for (std::int64_t j = 0; j < 4; ++j) expected += double{a.at(i, j)} * x[j];
    EXPECT_NEAR(product[i], expected, 1e-6);
    EXPECT_NEAR(y[i], expected, 1e-6);
  }
}

TEST(Ops, MatmulRejectsShapesThatDoNotFit) {
  dp::Tensor a({2, 3});
  dp::Tensor b({2, 3});
  const std::string message =
      error_message([&] { dp::matmul(a, dp::Transpose::kNo, b, dp::Transpose::kNo); });
  EXPECT_NE(message.find("(2, 3)"), std::string::npos) << message;
  EXPECT_NE(message.find("inner sizes differ"), std::string::npos) << message;
  // (2, 3) (2, 3)^T fits and gives (2, 2); a wrong output shape is reported.
  dp::Tensor wrong_output({3, 3});
  const std::string output_message = error_message(
      [&] { dp::matmul_into(a, dp::Transpose::kNo, b, dp::Transpose::kYes, wrong_output); });
  EXPECT_NE(output_message.find("must be (2, 2), got (3, 3)"), std::string::npos) << output_message;
}

TEST(Ops, AnEmptyInnerDimensionScalesTheOutputByBeta) {
  // op(a) (2, 0) op(b) (0, 3): the product is zero, so c = beta c. Every operand layout,
  // because a leading dimension of 0 (a row of no elements) is one BLAS refuses.
  for (const dp::Transpose ta : {dp::Transpose::kNo, dp::Transpose::kYes}) {
    for (const dp::Transpose tb : {dp::Transpose::kNo, dp::Transpose::kYes}) {
      const dp::Tensor a(ta == dp::Transpose::kNo ? std::vector<std::int64_t>{2, 0}
                                                  : std::vector<std::int64_t>{0, 2});
      const dp::Tensor b(tb == dp::Transpose::kNo ? std::vector<std::int64_t>{0, 3}
                                                  : std::vector<std::int64_t>{3, 0});
      dp::Tensor c({2, 3});
      for (float& value : c.span()) value = 4.0f;
      dp::matmul_into(a, ta, b, tb, c, 1.0f, 0.5f);
      for (const float value : c.span()) EXPECT_EQ(value, 2.0f);
      dp::matmul_into(a, ta, b, tb, c, 1.0f, 0.0f);
      for (const float value : c.span()) EXPECT_EQ(value, 0.0f);
    }
  }
}

TEST(Ops, BlasThreadsCanBeSetAndMustBePositive) {
  const int before = dp::blas_threads();
  dp::set_blas_threads(1);
  EXPECT_EQ(dp::blas_threads(), 1);
  dp::set_blas_threads(before);
  EXPECT_THROW(dp::set_blas_threads(0), dp::Error);
}

// ---- Linear -------------------------------------------------------------------------------

TEST(Linear, ForwardComputesXWTransposePlusBias) {
  dp::Linear fc("fc1", 2, 3);
  // W = [[1, 2], [3, 4], [5, 6]] (out, in), b = [1, 0, -1].
  const std::vector<float> weight = {1, 2, 3, 4, 5, 6};
  std::copy(weight.begin(), weight.end(), fc.weight().value.data());
  fc.bias().value[0] = 1.0f;
  fc.bias().value[2] = -1.0f;
  dp::Tensor x({2, 2});
  x.at(0, 0) = 1.0f;
  x.at(0, 1) = 1.0f;
  x.at(1, 0) = 2.0f;  // second row (2, 0)
  const dp::Tensor y = fc.forward(x);
  ASSERT_EQ(y.shape(), (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(std::vector<float>(y.span().begin(), y.span().end()),
            (std::vector<float>{4, 7, 10, 3, 6, 9}));
}

TEST(Linear, ParametersAreNamedAndShapedLikePyTorch) {
  dp::Linear fc("fc2", 5, 4);
  const std::vector<dp::Parameter*> parameters = fc.parameters();
  ASSERT_EQ(parameters.size(), 2u);
  EXPECT_EQ(parameters[0]->name, "fc2.weight");
  EXPECT_EQ(parameters[0]->value.shape(), (std::vector<std::int64_t>{4, 5}));
  EXPECT_EQ(parameters[1]->name, "fc2.bias");
  EXPECT_EQ(parameters[1]->grad.shape(), (std::vector<std::int64_t>{4}));
  EXPECT_EQ(fc.kind(), "linear");
}

TEST(Linear, ParametersAndGradientsAreChargedToTheirCategories) {
  auto memory = std::make_shared<dp::RankMemory>();
  dp::ScopedRankMemory bind(memory);
  dp::Linear fc("fc1", 4, 3);
  EXPECT_EQ(memory->tracker().current(dp::MemoryCategory::kParameters), (12 + 3) * sizeof(float));
  EXPECT_EQ(memory->tracker().current(dp::MemoryCategory::kGradients), (12 + 3) * sizeof(float));
}

TEST(Linear, BackwardMatchesFiniteDifferences) {
  dp::Linear fc("fc1", 5, 4);
  fill_uniform(fc.weight().value, 10);
  fill_uniform(fc.bias().value, 11);
  check_layer_gradients(fc, 3, 5, 4);
}

TEST(Linear, BackwardAccumulatesIntoGradients) {
  dp::Linear fc("fc1", 5, 4);
  fill_uniform(fc.weight().value, 10);
  dp::Tensor x({3, 5});
  fill_uniform(x, 1);
  dp::Tensor dy({3, 4});
  fill_uniform(dy, 2);

  fc.forward(x);
  fc.backward(dy);
  const dp::Tensor once_weight = fc.weight().grad.clone();
  const dp::Tensor once_bias = fc.bias().grad.clone();
  fc.forward(x);
  fc.backward(dy);
  for (std::size_t i = 0; i < once_weight.size(); ++i)
    EXPECT_FLOAT_EQ(fc.weight().grad[i], 2.0f * once_weight[i]) << i;
  for (std::size_t i = 0; i < once_bias.size(); ++i)
    EXPECT_FLOAT_EQ(fc.bias().grad[i], 2.0f * once_bias[i]) << i;
  EXPECT_NE(once_bias[0], 0.0f);  // the check above would pass trivially on zeros
}

TEST(Linear, FrozenParametersGetNoGradient) {
  dp::Linear fc("fc1", 5, 4);
  fill_uniform(fc.weight().value, 10);
  fc.weight().frozen = true;
  dp::Tensor x({3, 5});
  fill_uniform(x, 1);
  dp::Tensor dy({3, 4});
  fill_uniform(dy, 2);
  fc.forward(x);
  const dp::Tensor dx = fc.backward(dy);
  for (float g : fc.weight().grad.span()) EXPECT_EQ(g, 0.0f);
  EXPECT_NE(fc.bias().grad[0], 0.0f);  // the bias is still trained
  EXPECT_NE(dx[0], 0.0f);              // and the input gradient still flows
}

TEST(Linear, ReleasedGradientIsAllocatedAgainBeforeAccumulating) {
  dp::Linear fc("fc1", 5, 4);
  fill_uniform(fc.weight().value, 10);
  fc.weight().grad = dp::Tensor();  // as a ZeRO-2 hook frees it after reduce-scatter
  dp::Tensor x({3, 5});
  fill_uniform(x, 1);
  dp::Tensor dy({3, 4});
  fill_uniform(dy, 2);
  fc.forward(x);
  fc.backward(dy);
  ASSERT_EQ(fc.weight().grad.shape(), (std::vector<std::int64_t>{4, 5}));
  // dW[0][0] = sum_b dy[b][0] x[b][0]
  double expected = 0.0;
  for (std::int64_t b = 0; b < 3; ++b) expected += double{dy.at(b, 0)} * x.at(b, 0);
  EXPECT_NEAR(fc.weight().grad[0], expected, 1e-6);
}

TEST(Linear, RejectsWrongShapesWithClearMessages) {
  EXPECT_THROW(dp::Linear("fc1", 0, 4), dp::Error);
  dp::Linear fc("fc1", 64, 10);
  dp::Tensor x({32, 63});
  EXPECT_EQ(error_message([&] { fc.forward(x); }),
            "fc1 expects input of shape (B, 64), got (32, 63)");
  dp::Tensor flat({64});
  EXPECT_NE(error_message([&] { fc.forward(flat); }).find("got (64)"), std::string::npos);

  EXPECT_NE(error_message([&] {
              fc.backward(dp::Tensor({32, 10}));
            }).find("without a forward"),
            std::string::npos);
  fc.forward(dp::Tensor({32, 64}));
  const std::string message = error_message([&] { fc.backward(dp::Tensor({32, 9})); });
  EXPECT_NE(message.find("(32, 10)"), std::string::npos) << message;
  EXPECT_NE(message.find("got (32, 9)"), std::string::npos) << message;
}

TEST(Linear, ForwardReportsAReleasedWeight) {
  dp::Linear fc("fc1", 4, 2);
  fc.weight().value = dp::Tensor();  // as a ZeRO-3 hook frees a layer after use
  const std::string message = error_message([&] { fc.forward(dp::Tensor({1, 4})); });
  EXPECT_NE(message.find("fc1.weight"), std::string::npos) << message;
  EXPECT_NE(message.find("expected (2, 4)"), std::string::npos) << message;
}

TEST(Linear, CostCountsTheMatrixProducts) {
  dp::Linear fc("fc1", 64, 32);
  EXPECT_DOUBLE_EQ(fc.forward_cost(8).flops, 2.0 * 8 * 64 * 32 + 8 * 32);
  EXPECT_DOUBLE_EQ(fc.backward_cost(8).flops, 4.0 * 8 * 64 * 32 + 8 * 32);
  EXPECT_GT(fc.forward_cost(8).bytes, 4.0 * 64 * 32);  // at least the weight is read
}

// ---- Activations --------------------------------------------------------------------------

TEST(ReLU, ForwardClampsNegativesAndBackwardMasks) {
  dp::ReLU relu("relu1", 3);
  dp::Tensor x({1, 3});
  x[0] = -1.0f;
  x[1] = 0.0f;
  x[2] = 2.5f;
  const dp::Tensor y = relu.forward(x);
  EXPECT_EQ(y[0], 0.0f);
  EXPECT_EQ(y[1], 0.0f);
  EXPECT_EQ(y[2], 2.5f);
  dp::Tensor dy({1, 3});
  dy.fill(3.0f);
  const dp::Tensor dx = relu.backward(dy);
  EXPECT_EQ(dx[0], 0.0f);
  EXPECT_EQ(dx[1], 0.0f);  // no gradient at exactly 0, as in PyTorch
  EXPECT_EQ(dx[2], 3.0f);
  EXPECT_TRUE(relu.parameters().empty());
}

TEST(ReLU, BackwardMatchesFiniteDifferences) {
  // Inputs at least 0.1 away from the kink at 0, so x +- h never crosses it.
  dp::ReLU relu("relu1", 6);
  dp::Tensor x({4, 6});
  fill_uniform(x, 1, 0.1f, 1.0f);
  for (std::size_t i = 0; i < x.size(); i += 2) x[i] = -x[i];
  dp::Tensor dy({4, 6});
  fill_uniform(dy, 2);
  relu.forward(x);
  const dp::Tensor dx = relu.backward(dy);
  expect_matches_finite_differences(
      x.span(), dx.span(), [&] { return dot(relu.forward(x).span(), dy.span()); }, "relu input");
}

TEST(GELU, ForwardMatchesTheTanhApproximation) {
  dp::GELU gelu("gelu1", 3);
  dp::Tensor x({1, 3});
  x[0] = 0.0f;
  x[1] = 1.0f;
  x[2] = -2.0f;
  const dp::Tensor y = gelu.forward(x);
  EXPECT_EQ(y[0], 0.0f);
  EXPECT_NEAR(y[1], 0.8411919906, 1e-6);  // 0.5 (1 + tanh(sqrt(2/pi) (1 + 0.044715)))
  EXPECT_NEAR(y[2], -0.0454023059, 1e-6);
}

TEST(GELU, BackwardMatchesFiniteDifferences) {
  dp::GELU gelu("gelu1", 5);
  check_layer_gradients(gelu, 4, 5, 5, -3.0f, 3.0f);
}

TEST(Activations, RejectWrongWidth) {
  dp::ReLU relu("relu2", 8);
  EXPECT_EQ(error_message([&] {
              relu.forward(dp::Tensor({2, 7}));
            }),
            "relu2 expects input of shape (B, 8), got (2, 7)");
  dp::GELU gelu("gelu2", 8);
  EXPECT_THROW(gelu.forward(dp::Tensor({2, 9})), dp::Error);
  EXPECT_THROW(dp::ReLU("relu3", 0), dp::Error);
}

// ---- LayerNorm ----------------------------------------------------------------------------

TEST(LayerNorm, ForwardNormalisesEachRow) {
  dp::LayerNorm ln("ln1", 6);
  dp::CounterRng unused(0, 0);
  for (dp::Parameter* parameter : ln.parameters()) ln.initialize(*parameter, unused);
  EXPECT_EQ(ln.weight().value[0], 1.0f);
  EXPECT_EQ(ln.bias().value[0], 0.0f);
  dp::Tensor x({3, 6});
  fill_uniform(x, 1, -5.0f, 9.0f);
  const dp::Tensor y = ln.forward(x);
  for (std::int64_t row = 0; row < 3; ++row) {
    double mean = 0.0;
    double square = 0.0;
    for (std::int64_t j = 0; j < 6; ++j) {
      mean += y.at(row, j) / 6.0;
      square += double{y.at(row, j)} * y.at(row, j) / 6.0;
    }
    EXPECT_NEAR(mean, 0.0, 1e-6) << row;
    EXPECT_NEAR(square - mean * mean, 1.0, 1e-4) << row;  // eps shrinks it a little
  }
}

TEST(LayerNorm, BackwardMatchesFiniteDifferences) {
  dp::LayerNorm ln("ln1", 5);
  fill_uniform(ln.weight().value, 20, 0.5f, 1.5f);  // a non-trivial gamma and beta
  fill_uniform(ln.bias().value, 21);
  check_layer_gradients(ln, 3, 5, 5);
}

TEST(LayerNorm, RejectsBadSettingsAndShapes) {
  EXPECT_THROW(dp::LayerNorm("ln1", 0), dp::Error);
  EXPECT_THROW(dp::LayerNorm("ln1", 4, 0.0f), dp::Error);
  dp::LayerNorm ln("ln1", 4);
  EXPECT_EQ(error_message([&] {
              ln.forward(dp::Tensor({2, 5}));
            }),
            "ln1 expects input of shape (B, 4), got (2, 5)");
}

// ---- Softmax cross-entropy ----------------------------------------------------------------

TEST(SoftmaxCrossEntropy, UniformLogitsGiveLogOfClassCount) {
  dp::SoftmaxCrossEntropy loss;
  dp::Tensor logits({2, 4});
  const std::vector<int> labels = {0, 3};
  EXPECT_NEAR(loss.forward(logits, labels), std::log(4.0), 1e-6);
  const dp::Tensor grad = loss.backward();
  // (softmax - onehot) / B = (0.25 - 1) / 2 at the label, 0.25 / 2 elsewhere.
  EXPECT_FLOAT_EQ(grad.at(0, 0), -0.375f);
  EXPECT_FLOAT_EQ(grad.at(0, 1), 0.125f);
  EXPECT_FLOAT_EQ(grad.at(1, 3), -0.375f);
}

TEST(SoftmaxCrossEntropy, IsStableForLargeLogits) {
  dp::SoftmaxCrossEntropy loss;
  dp::Tensor logits({1, 2});
  logits[0] = 1000.0f;  // exp(1000) overflows float and double
  logits[1] = 0.0f;
  const std::vector<int> wrong = {1};
  EXPECT_NEAR(loss.forward(logits, wrong), 1000.0, 1e-3);
  const dp::Tensor grad = loss.backward();
  EXPECT_FLOAT_EQ(grad[0], 1.0f);
  EXPECT_FLOAT_EQ(grad[1], -1.0f);
}

TEST(SoftmaxCrossEntropy, BackwardMatchesFiniteDifferencesAndScales) {
  dp::SoftmaxCrossEntropy loss;
  dp::Tensor logits({4, 5});
  fill_uniform(logits, 1, -3.0f, 3.0f);
  const std::vector<int> labels = {0, 4, 2, 2};
  loss.forward(logits, labels);
  const dp::Tensor grad = loss.backward();
  const dp::Tensor half = loss.backward(0.5f);
  for (std::size_t i = 0; i < grad.size(); ++i) EXPECT_FLOAT_EQ(half[i], 0.5f * grad[i]);
  expect_matches_finite_differences(
      logits.span(), grad.span(), [&] { return double{loss.forward(logits, labels)}; }, "logits");
}

TEST(SoftmaxCrossEntropy, RejectsBadLabelsAndShapes) {
  dp::SoftmaxCrossEntropy loss;
  dp::Tensor logits({2, 3});
  const std::vector<int> out_of_range = {0, 7};
  EXPECT_EQ(error_message([&] { loss.forward(logits, out_of_range); }),
            "label 1 is 7, expected a class in [0, 3)");
  const std::vector<int> negative = {-1, 0};
  EXPECT_NE(error_message([&] { loss.forward(logits, negative); }).find("label 0 is -1"),
            std::string::npos);
  const std::vector<int> too_few = {0};
  EXPECT_NE(error_message([&] { loss.forward(logits, too_few); }).find("1 labels for a batch of 2"),
            std::string::npos);
  dp::SoftmaxCrossEntropy fresh;
  EXPECT_THROW(fresh.backward(), dp::Error);
}

}  // namespace
