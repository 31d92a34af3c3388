// Matrix products, the layers' kernels and a model training on the device, against the host
// implementation (the readable ground truth). Runs in dp_gpu_tests: skipped (exit code 77)
// without a CUDA device.
//
// Tolerances, with u = 2^-24 the unit roundoff of float32:
//   - gemm (cuBLAS, no TF32) and the Linear products: a float32 sum of k products lies within
//     (k + 1) u sum|a b| of the exact value whatever the order, so device and host within
//         |device - host| <= 2 (k + 2) u (|alpha| (|op(A)| |op(B)|)_ij + |beta| |C_ij|);
//   - bitwise: ReLU forward and backward, a Linear's bias, cross-entropy's gradient given the
//     same probabilities (one thread per element, each operation rounded on its own);
//   - column sums (a Linear's bias gradient, LayerNorm's dbeta): bitwise a host loop in the
//     kernel's order (8 groups of consecutive rows, cuda/layer_kernels.cu), and within
//     2 (rows + 1) u sum|x| of the host layer's row-order sum (both float sums of the same
//     rows and of the gradient already there);
//   - GELU: tanhf on the device, std::tanh on the host (each within 2 ulps), and nvcc fuses
//     multiply-adds: |device - host| <= 2^-19 (1 + |host|) for inputs in [-4, 4);
//   - LayerNorm and cross-entropy: row statistics in double added as a tree instead of in
//     index order, rounded to float: each output within 2^-19 of the largest |host| value
//     of its tensor (a few ulps of it);
//   - training: a few steps of the default model, parameters within
//     dp::equivalence_tolerance (dp/trainer.h), the bound the labs use for float32 sums
//     taken in another order, which is what cuBLAS does.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <latch>
#include <string>
#include <thread>
#include <vector>

#include "cuda/device_ops.h"  // the trainer's gradient scan and the handle pool, on their own
#include "dp/data.h"
#include "dp/error.h"
#include "dp/model.h"
#include "dp/ops.h"
#include "dp/rng.h"
#include "dp/tensor.h"
#include "dp/trainer.h"
#include "gpu_test_support.h"
#include "test_support.h"

namespace dp {
namespace {

using testing::message_of;
using testing::gpu::bitwise_equal;
using testing::gpu::random_values;

constexpr double kUnitRoundoff = 0x1.0p-24;

/// A host tensor of `shape` with values uniform in [low, high) (seeded).
Tensor random_tensor(const std::vector<std::int64_t>& shape, unsigned seed, float low = -1.0f,
                     float high = 1.0f) {
  Tensor tensor =
      Tensor::from(random_values(static_cast<std::size_t>(element_count(shape)), seed, low, high));
  tensor.reshape(shape);
  return tensor;
}

/// |x| element by element (a host tensor).
Tensor absolute(const Tensor& x) {
  Tensor result = x.clone();
  for (float& value : result.span()) value = std::abs(value);
  return result;
}

/// Expects |device[i] - host[i]| <= bound(i) for every element; reports the worst one.
void expect_within(const Tensor& host, const Tensor& device,
                   const std::function<double(std::size_t)>& bound, const std::string& what) {
  ASSERT_EQ(device.device(), Device::kCuda) << what;
  ASSERT_EQ(host.shape(), device.shape()) << what;
  const Tensor copied = device.to(Device::kHost);
  std::size_t failures = 0;
  std::size_t worst = 0;
  double worst_ratio = 0;
  for (std::size_t i = 0; i < host.size(); ++i) {
    const double difference = std::abs(static_cast<double>(copied[i]) - host[i]);
    const double allowed = bound(i);
    if (!(difference <= allowed)) ++failures;  // a NaN fails too
    const double ratio = allowed > 0 ? difference / allowed : (difference > 0 ? INFINITY : 0);
    if (ratio > worst_ratio || std::isnan(difference)) {
      worst_ratio = ratio;
      worst = i;
    }
  }
  EXPECT_EQ(failures, 0u) << what << ": worst element " << worst << ": host " << host[worst]
                          << ", device " << copied[worst] << ", allowed difference "
                          << bound(worst);
}

/// Each element within `fraction` of the largest |host| value of the tensor.
void expect_within_normwise(const Tensor& host, const Tensor& device, double fraction,
                            const std::string& what) {
  double largest = 0;
  for (const float value : host.span()) largest = std::max(largest, double{std::abs(value)});
  expect_within(
      host, device, [&](std::size_t) { return fraction * largest; }, what);
}

/// before[j] + the column sums of x (rows, cols) in the order of the device's kernel
/// (cuda/layer_kernels.cu): 8 groups of ceil(rows / 8) consecutive rows, each added in row
/// order, then the groups' sums in group order, then one addition into before[j].
Tensor column_sums_in_device_order(const Tensor& before, const Tensor& x) {
  constexpr std::int64_t kGroups = 8;
  const std::int64_t rows = x.dim(0);
  const std::int64_t cols = x.dim(1);
  const std::int64_t per_group = (rows + kGroups - 1) / kGroups;
  Tensor result = before.to(Device::kHost);
  for (std::int64_t j = 0; j < cols; ++j) {
    float sum = 0.0f;
    for (std::int64_t group = 0; group < kGroups; ++group) {
      float partial = 0.0f;
      const std::int64_t first = std::min(rows, group * per_group);
      const std::int64_t last = std::min(rows, first + per_group);
      for (std::int64_t r = first; r < last; ++r) partial += x.at(r, j);
      sum += partial;
    }
    result[static_cast<std::size_t>(j)] += sum;
  }
  return result;
}

/// The bound of a column sum of the file comment: 2 (rows + 1) u (|before| + sum |x|).
std::function<double(std::size_t)> column_sum_bound(const Tensor& before, const Tensor& x) {
  std::vector<double> magnitude(static_cast<std::size_t>(x.dim(1)));
  for (std::size_t j = 0; j < magnitude.size(); ++j) {
    magnitude[j] = std::abs(before[j]);
    for (std::int64_t r = 0; r < x.dim(0); ++r)
      magnitude[j] += std::abs(x.at(r, static_cast<std::int64_t>(j)));
  }
  const auto rows = static_cast<double>(x.dim(0));
  return
      [magnitude, rows](std::size_t j) { return 2.0 * (rows + 1) * kUnitRoundoff * magnitude[j]; };
}

/// The gemm bound of the file comment, given the host magnitudes |op(A)| |op(B)| (m, n).
std::function<double(std::size_t)> product_bound(std::int64_t k, const Tensor& magnitude,
                                                 double extra = 0) {
  return [k, &magnitude, extra](std::size_t i) {
    return 2.0 * static_cast<double>(k + 2) * kUnitRoundoff * (magnitude[i] + extra);
  };
}

// --- Matrix products -----------------------------------------------------------------------

TEST(GpuMatmul, EveryTransposeCombinationAgreesWithTheHostWithinTheFloat32Bound) {
  constexpr std::int64_t m = 67;
  constexpr std::int64_t n = 45;
  constexpr std::int64_t k = 300;
  for (const Transpose ta : {Transpose::kNo, Transpose::kYes}) {
    for (const Transpose tb : {Transpose::kNo, Transpose::kYes}) {
      const std::string what = fmt::format("op(A){} op(B){}", ta == Transpose::kYes ? "^T" : "",
                                           tb == Transpose::kYes ? "^T" : "");
      const Tensor a = random_tensor(
          ta == Transpose::kYes ? std::vector<std::int64_t>{k, m} : std::vector<std::int64_t>{m, k},
          1);
      const Tensor b = random_tensor(
          tb == Transpose::kYes ? std::vector<std::int64_t>{n, k} : std::vector<std::int64_t>{k, n},
          2);
      const Tensor c0 = random_tensor({m, n}, 3);
      constexpr float alpha = 0.75f;
      constexpr float beta = -1.5f;
      Tensor c_host = c0.clone();
      matmul_into(a, ta, b, tb, c_host, alpha, beta);
      const Tensor a_device = a.to(Device::kCuda);
      const Tensor b_device = b.to(Device::kCuda);
      Tensor c_device = c0.to(Device::kCuda);
      matmul_into(a_device, ta, b_device, tb, c_device, alpha, beta);

      // |alpha| |op(A)| |op(B)| + |beta| |C|, on the host
      Tensor magnitude = absolute(c0);
      matmul_into(absolute(a), ta, absolute(b), tb, magnitude, std::abs(alpha), std::abs(beta));
      expect_within(c_host, c_device, product_bound(k, magnitude), what);

      // matmul allocates its result on the operands' device
      const Tensor fresh = matmul(a_device, ta, b_device, tb);
      EXPECT_EQ(fresh.device(), Device::kCuda) << what;
      Tensor fresh_magnitude = matmul(absolute(a), ta, absolute(b), tb);
      expect_within(matmul(a, ta, b, tb), fresh, product_bound(k, fresh_magnitude), what);
    }
  }
}

TEST(GpuMatmul, AnEmptyInnerDimensionScalesTheOutputByBeta) {
  // k = 0 gives a leading dimension of 0 to a row-major operand of no columns, which cuBLAS
  // refuses unless the call raises it to 1; the product is then c = beta c.
  for (const Transpose ta : {Transpose::kNo, Transpose::kYes}) {
    for (const Transpose tb : {Transpose::kNo, Transpose::kYes}) {
      const Tensor a(
          ta == Transpose::kNo ? std::vector<std::int64_t>{2, 0} : std::vector<std::int64_t>{0, 2},
          MemoryCategory::kActivations, Device::kCuda);
      const Tensor b(
          tb == Transpose::kNo ? std::vector<std::int64_t>{0, 3} : std::vector<std::int64_t>{3, 0},
          MemoryCategory::kActivations, Device::kCuda);
      Tensor c_host({2, 3});
      for (float& value : c_host.span()) value = 4.0f;
      Tensor c = c_host.to(Device::kCuda);
      matmul_into(a, ta, b, tb, c, 1.0f, 0.5f);
      for (const float value : c.to(Device::kHost).span()) EXPECT_EQ(value, 2.0f);
    }
  }
}

TEST(GpuMatmul, OperandsOnTwoDevicesAreRefusedWithBothNamed) {
  const Tensor host({4, 4});
  const Tensor device({4, 4}, MemoryCategory::kActivations, Device::kCuda);
  Tensor out({4, 4}, MemoryCategory::kActivations, Device::kCuda);
  const std::string message =
      message_of<Error>([&] { matmul_into(host, Transpose::kNo, device, Transpose::kNo, out); });
  EXPECT_NE(message.find("a on host, b on cuda"), std::string::npos) << message;
}

TEST(GpuMatmul, EachThreadHasItsOwnHandleAndStream) {
  // Two threads (two ranks) multiply at once, each on its own handle and compute stream.
  const Tensor a = random_tensor({128, 256}, 4);
  const Tensor b = random_tensor({256, 96}, 5);
  const Tensor expected = matmul(a, Transpose::kNo, b, Transpose::kNo);
  const Tensor magnitude = matmul(absolute(a), Transpose::kNo, absolute(b), Transpose::kNo);
  std::vector<Tensor> results(2);
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < results.size(); ++t)
    threads.emplace_back([&, t] {
      const Tensor a_device = a.to(Device::kCuda);
      const Tensor b_device = b.to(Device::kCuda);
      for (int repeat = 0; repeat < 20; ++repeat)
        results[t] = matmul(a_device, Transpose::kNo, b_device, Transpose::kNo);
      results[t] = results[t].to(Device::kHost);  // waits for this thread's stream
    });
  for (std::thread& thread : threads) thread.join();
  for (const Tensor& result : results)
    expect_within(expected, result.to(Device::kCuda), product_bound(256, magnitude),
                  "matmul on a second thread");
}

TEST(GpuMatmul, ThreadsOfLaterLaunchesReuseThePooledHandles) {
  // Threads that end give their handle back; the threads after them take it over instead
  // of making one (before the pool, every rank thread of every launch made its own).
  // The threads of a launch hold their handles at once (the latch), as ranks do.
  const auto threads_multiply = [](int count) {
    std::latch all_multiplied(count);
    std::vector<std::thread> threads;
    for (int t = 0; t < count; ++t)
      threads.emplace_back([&] {
        Tensor one({4, 4}, MemoryCategory::kActivations, Device::kCuda);
        one.fill(1.0f);
        (void)matmul(one, Transpose::kNo, one, Transpose::kNo).to(Device::kHost);
        all_multiplied.arrive_and_wait();
      });
    for (std::thread& thread : threads) thread.join();
  };
  threads_multiply(2);  // at least two handles in the pool now
  const std::size_t made = cuda::cublas_handles_created();
  for (int launch = 0; launch < 5; ++launch) threads_multiply(2);
  EXPECT_EQ(cuda::cublas_handles_created(), made) << "a later thread made a handle of its own";
}

// --- The trainer's gradient scan (cuda::fold_max_abs_bits) ---------------------------------

/// The bits of |x| (non-negative floats order as their bits).
unsigned int magnitude_bits(float x) {
  const float magnitude = std::abs(x);
  unsigned int bits = 0;
  std::memcpy(&bits, &magnitude, sizeof bits);
  return bits;
}

TEST(GpuGradientScan, OnePassGivesTheHostsLargestMagnitudeAndSeesEveryNonFinite) {
  // 70 arrays (two launches of 64 and 6), sizes from 0 to beyond one block's stride.
  std::vector<Tensor> host;
  std::vector<Tensor> device;
  unsigned int expected = 0;
  for (unsigned i = 0; i < 70; ++i) {
    const std::int64_t size = i == 3 ? 0 : static_cast<std::int64_t>(1 + (i * 7919) % 5000);
    host.push_back(random_tensor({size}, 100 + i, -3.0f, 3.0f));
    for (const float value : host.back().span())
      expected = std::max(expected, magnitude_bits(value));
    device.push_back(host.back().to(Device::kCuda));
  }
  std::vector<const float*> arrays;
  std::vector<std::size_t> sizes;
  for (const Tensor& tensor : device) {
    arrays.push_back(tensor.view().data());
    sizes.push_back(tensor.size());
  }
  Tensor result({2}, MemoryCategory::kActivations, Device::kCuda);  // {scan, running}
  result.fill(0.0f);
  auto* bits = reinterpret_cast<unsigned int*>(result.view().data());
  const auto read = [&](int slot) {
    unsigned int value = 0;
    cuda::copy_bytes(&value, bits + slot, sizeof value);
    return value;
  };
  cuda::fold_max_abs_bits(arrays.data(), sizes.data(), arrays.size(), bits, bits + 1);
  EXPECT_EQ(read(0), expected);
  EXPECT_EQ(read(1), expected);

  // The running maximum keeps the largest over calls; the scan starts from 0 each call.
  const std::vector<float> small_values{0.5f};
  const Tensor small = Tensor::from(small_values, MemoryCategory::kActivations, Device::kCuda);
  const float* small_data = small.view().data();
  const std::size_t one = 1;
  cuda::fold_max_abs_bits(&small_data, &one, 1, bits, bits + 1);
  EXPECT_EQ(read(0), magnitude_bits(0.5f));
  EXPECT_EQ(read(1), expected);

  // An infinity or a NaN in the last array (the second launch) reads 0x7f800000 or more.
  for (const float bad : {INFINITY, -INFINITY, NAN}) {
    Tensor poisoned = host.back().clone();
    poisoned[poisoned.size() - 1] = bad;
    const Tensor poisoned_device = poisoned.to(Device::kCuda);
    arrays.back() = poisoned_device.view().data();
    cuda::fold_max_abs_bits(arrays.data(), sizes.data(), arrays.size(), bits, nullptr);
    EXPECT_GE(read(0), 0x7f800000u) << bad;
    EXPECT_EQ(read(1), expected) << "a scan without the running target changed it";
  }
}

// --- Layers ----------------------------------------------------------------------------------

constexpr std::int64_t kBatch = 33;

/// Copies a host layer's parameter values and gradients into the same layer on the device.
void copy_parameters_to_device(Layer& host, Layer& device) {
  const std::vector<Parameter*> from = host.parameters();
  const std::vector<Parameter*> to = device.parameters();
  ASSERT_EQ(from.size(), to.size());
  for (std::size_t i = 0; i < from.size(); ++i) {
    to[i]->value = from[i]->value.to(Device::kCuda);
    to[i]->grad = from[i]->grad.to(Device::kCuda);
  }
}

/// Draws every parameter of `layer` (seeded) and gives its gradients nonzero values, so the
/// test sees that backward adds into them.
void randomize(Layer& layer, unsigned seed) {
  for (Parameter* parameter : layer.parameters()) {
    const Tensor values = random_tensor(parameter->value.shape(), seed++);
    std::copy_n(values.data(), values.size(), parameter->value.data());
    const Tensor grads = random_tensor(parameter->grad.shape(), seed++);
    std::copy_n(grads.data(), grads.size(), parameter->grad.data());
  }
}

TEST(GpuLayers, LinearForwardAndBackwardAgreeWithTheHost) {
  constexpr std::int64_t in = 67;
  constexpr std::int64_t out = 129;
  Linear host("fc", in, out);
  Linear device("fc", in, out);
  randomize(host, 10);
  copy_parameters_to_device(host, device);
  const Tensor x = random_tensor({kBatch, in}, 20);
  const Tensor dy = random_tensor({kBatch, out}, 21);

  const Tensor y_host = host.forward(x);
  const Tensor y_device = device.forward(x.to(Device::kCuda));
  // out = b + x W^T: |x| |W|^T + |b|
  Tensor y_magnitude = Tensor::uninitialized({kBatch, out});
  for (std::int64_t r = 0; r < kBatch; ++r)
    for (std::int64_t j = 0; j < out; ++j) y_magnitude.at(r, j) = std::abs(host.bias().value[j]);
  matmul_into(absolute(x), Transpose::kNo, absolute(host.weight().value), Transpose::kYes,
              y_magnitude, 1.0f, 1.0f);
  expect_within(y_host, y_device, product_bound(in, y_magnitude), "linear forward");

  const Tensor weight_grad_before = host.weight().grad.clone();
  const Tensor bias_grad_before = host.bias().grad.clone();
  const Tensor dx_host = host.backward(dy);
  const Tensor dx_device = device.backward(dy.to(Device::kCuda));
  const Tensor dx_magnitude =
      matmul(absolute(dy), Transpose::kNo, absolute(host.weight().value), Transpose::kNo);
  expect_within(dx_host, dx_device, product_bound(out, dx_magnitude), "linear dx");
  Tensor dw_magnitude = absolute(weight_grad_before);
  matmul_into(absolute(dy), Transpose::kYes, absolute(x), Transpose::kNo, dw_magnitude, 1.0f, 1.0f);
  expect_within(host.weight().grad, device.weight().grad, product_bound(kBatch, dw_magnitude),
                "linear dW");
  EXPECT_TRUE(bitwise_equal(column_sums_in_device_order(bias_grad_before, dy), device.bias().grad))
      << "linear db in the kernel's order";
  expect_within(host.bias().grad, device.bias().grad, column_sum_bound(bias_grad_before, dy),
                "linear db");
}

TEST(GpuLayers, LinearBiasGradientOfManyRowsAndColumnsFollowsTheStatedOrder) {
  // 1000 rows (8 groups of 125) and 4100 columns (129 tiles, the last of 4 columns).
  constexpr std::int64_t rows = 1000;
  constexpr std::int64_t out = 4100;
  Linear host("fc", 3, out);
  Linear device("fc", 3, out);
  randomize(host, 11);
  copy_parameters_to_device(host, device);
  const Tensor x = random_tensor({rows, 3}, 22);
  const Tensor dy = random_tensor({rows, out}, 23);
  const Tensor bias_grad_before = host.bias().grad.clone();
  (void)host.forward(x);
  (void)device.forward(x.to(Device::kCuda));
  (void)host.backward(dy);
  (void)device.backward(dy.to(Device::kCuda));
  EXPECT_TRUE(bitwise_equal(column_sums_in_device_order(bias_grad_before, dy), device.bias().grad))
      << "linear db in the kernel's order";
  expect_within(host.bias().grad, device.bias().grad, column_sum_bound(bias_grad_before, dy),
                "linear db");
}

TEST(GpuLayers, ReluForwardAndBackwardEqualTheHostBitwise) {
  ReLU host("relu", 300);
  ReLU device("relu", 300);
  const Tensor x = random_tensor({kBatch, 300}, 30);
  const Tensor dy = random_tensor({kBatch, 300}, 31);
  EXPECT_TRUE(bitwise_equal(host.forward(x), device.forward(x.to(Device::kCuda))));
  EXPECT_TRUE(bitwise_equal(host.backward(dy), device.backward(dy.to(Device::kCuda))));
}

TEST(GpuLayers, GeluForwardAndBackwardAgreeWithTheHostWithinAFewUlps) {
  GELU host("gelu", 300);
  GELU device("gelu", 300);
  const Tensor x = random_tensor({kBatch, 300}, 40, -4.0f, 4.0f);
  const Tensor dy = random_tensor({kBatch, 300}, 41);
  const auto bound = [](const Tensor& reference) {
    return [&reference](std::size_t i) { return 0x1.0p-19 * (1.0 + std::abs(reference[i])); };
  };
  const Tensor y_host = host.forward(x);
  expect_within(y_host, device.forward(x.to(Device::kCuda)), bound(y_host), "gelu forward");
  const Tensor dx_host = host.backward(dy);
  expect_within(dx_host, device.backward(dy.to(Device::kCuda)), bound(dx_host), "gelu backward");
}

TEST(GpuLayers, LayerNormForwardAndBackwardAgreeWithTheHost) {
  // 1000 columns: wider than a block, so each thread of a row's block strides.
  constexpr std::int64_t width = 1000;
  LayerNorm host("ln", width);
  LayerNorm device("ln", width);
  randomize(host, 50);
  copy_parameters_to_device(host, device);
  const Tensor beta_grad_before = host.bias().grad.clone();
  // An offset mean, as activations have: the statistics must take it out accurately.
  const Tensor x = random_tensor({kBatch, width}, 60, 2.0f, 5.0f);
  const Tensor dy = random_tensor({kBatch, width}, 61);
  expect_within_normwise(host.forward(x), device.forward(x.to(Device::kCuda)), 0x1.0p-19,
                         "layer norm forward");
  expect_within_normwise(host.backward(dy), device.backward(dy.to(Device::kCuda)), 0x1.0p-19,
                         "layer norm dx");
  expect_within_normwise(host.weight().grad, device.weight().grad, 0x1.0p-19, "layer norm dgamma");
  EXPECT_TRUE(bitwise_equal(column_sums_in_device_order(beta_grad_before, dy), device.bias().grad))
      << "layer norm dbeta in the kernel's order";
  expect_within(host.bias().grad, device.bias().grad, column_sum_bound(beta_grad_before, dy),
                "layer norm dbeta");
}

TEST(GpuLayers, CrossEntropyLossAndGradientAgreeWithTheHost) {
  constexpr std::int64_t classes = 300;  // wider than a block
  const Tensor logits = random_tensor({kBatch, classes}, 70, -8.0f, 8.0f);
  std::vector<int> labels(kBatch);
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<int>((i * 37) % classes);
  SoftmaxCrossEntropy host;
  SoftmaxCrossEntropy device;
  const float loss_host = host.forward(logits, labels);
  const float loss_device = device.forward(logits.to(Device::kCuda), labels);
  EXPECT_NEAR(loss_device, loss_host, 0x1.0p-19 * std::abs(loss_host));
  constexpr float kScale = 0.5f;
  expect_within_normwise(host.backward(kScale), device.backward(kScale), 0x1.0p-19,
                         "cross-entropy gradient");
}

// --- GPT layers ------------------------------------------------------------------------------
//
// The embedding moves values and adds each in the host's order: bitwise. The attention, the
// block and the head chain products (k = C, d, T, 4C terms) with a softmax (expf, a sum in
// double as a tree) and LayerNorms: each output and gradient within 2^-14 of the largest
// |host| value of its tensor, which covers the sum of the chain's float32 product bounds,
// 2 (k + 2) u per product for k <= 300 (4 products: 4 * 604 u < 2^-14), with room for the
// softmax's and LayerNorm's few ulps.

constexpr double kGptFraction = 0x1.0p-14;

/// Random token ids in [0, vocab) stored as floats, (batch, time), with repeats.
Tensor random_ids(std::int64_t batch, std::int64_t time, std::int64_t vocab, unsigned seed) {
  Tensor ids = random_tensor({batch, time}, seed, 0.0f, static_cast<float>(vocab));
  for (float& id : ids.span()) id = std::floor(id);
  return ids;
}

TEST(GpuGptLayers, EmbeddingForwardAndBackwardEqualTheHostBitwise) {
  constexpr std::int64_t vocab = 7, context = 300, dim = 33, batch = 5;
  Embedding host("embed", vocab, context, dim);
  Embedding device("embed", vocab, context, dim);
  randomize(host, 80);
  copy_parameters_to_device(host, device);
  const Tensor ids = random_ids(batch, context, vocab, 81);
  EXPECT_TRUE(bitwise_equal(host.forward(ids), device.forward(ids.to(Device::kCuda))));
  const Tensor dy = random_tensor({batch, context, dim}, 82);
  (void)host.backward(dy);
  (void)device.backward(dy.to(Device::kCuda));
  EXPECT_TRUE(bitwise_equal(host.token_weight().grad, device.token_weight().grad)) << "wte";
  EXPECT_TRUE(bitwise_equal(host.position_weight().grad, device.position_weight().grad)) << "wpe";
  // A bad id on the device is found like one on the host.
  Tensor bad = ids.clone();
  bad[3] = 7.0f;
  const std::string message =
      message_of<Error>([&] { (void)device.forward(bad.to(Device::kCuda)); });
  EXPECT_TRUE(testing::contains(message, "the token id at (b = 0, t = 3) is 7")) << message;
}

/// Runs `host` and `device` (the same layer, parameters copied) forward on `x` and backward
/// on `dy`, and compares the outputs, the input gradients and every parameter gradient.
void expect_gpt_layer_agrees(Layer& host, Layer& device, const Tensor& x, const Tensor& dy) {
  SCOPED_TRACE(host.name());
  expect_within_normwise(host.forward(x), device.forward(x.to(Device::kCuda)), kGptFraction,
                         "forward");
  expect_within_normwise(host.backward(dy), device.backward(dy.to(Device::kCuda)), kGptFraction,
                         "input gradient");
  const std::vector<Parameter*> host_parameters = host.parameters();
  const std::vector<Parameter*> device_parameters = device.parameters();
  for (std::size_t i = 0; i < host_parameters.size(); ++i)
    expect_within_normwise(host_parameters[i]->grad, device_parameters[i]->grad, kGptFraction,
                           host_parameters[i]->name);
}

TEST(GpuGptLayers, AttentionAgreesWithTheHost) {
  // T = 300: a row of scores wider than a block, so each thread of the softmax strides; and
  // T = 1, a single score per head.
  for (const std::int64_t time : {300, 1}) {
    CausalSelfAttention host("attn", 32, 4, 300);
    CausalSelfAttention device("attn", 32, 4, 300);
    randomize(host, 90);
    copy_parameters_to_device(host, device);
    expect_gpt_layer_agrees(host, device, random_tensor({3, time, 32}, 91),
                            random_tensor({3, time, 32}, 92));
  }
}

TEST(GpuGptLayers, TransformerBlockAndHeadAgreeWithTheHost) {
  TransformerBlock host_block("h.0", 32, 4, 64, 2);
  TransformerBlock device_block("h.0", 32, 4, 64, 2);
  randomize(host_block, 100);
  copy_parameters_to_device(host_block, device_block);
  expect_gpt_layer_agrees(host_block, device_block, random_tensor({4, 64, 32}, 101),
                          random_tensor({4, 64, 32}, 102));
  LanguageModelHead host_head("head", 32, 65, 64);
  LanguageModelHead device_head("head", 32, 65, 64);
  randomize(host_head, 110);
  copy_parameters_to_device(host_head, device_head);
  expect_gpt_layer_agrees(host_head, device_head, random_tensor({4, 64, 32}, 111),
                          random_tensor({4 * 64, 65}, 112));
}

// --- A model on the device ------------------------------------------------------------------

TEST(GpuModel, MovesToTheDeviceAndBackBitwiseAndFiresTheSameHooks) {
  Model host = Model::mlp("64-96-10", {.layer_norm = true, .seed = 3});
  Model device = Model::mlp("64-96-10", {.layer_norm = true, .seed = 3, .device = Device::kCuda});
  EXPECT_EQ(device.device(), Device::kCuda);
  EXPECT_EQ(host.flat_parameters(), device.flat_parameters());

  std::vector<std::string> host_order;
  std::vector<std::string> device_order;
  host.on_gradient_ready([&](Parameter& p) { host_order.push_back(p.name); });
  device.on_gradient_ready([&](Parameter& p) {
    EXPECT_EQ(p.grad.device(), Device::kCuda) << p.name;
    device_order.push_back(p.name);
  });
  const Tensor x = random_tensor({16, 64}, 80);
  const std::vector<int> labels(16, 3);
  const float loss_host = host.backward(host.forward(x), labels);
  const float loss_device = device.backward(device.forward(x.to(Device::kCuda)), labels);
  EXPECT_NEAR(loss_device, loss_host, 1e-5f * std::abs(loss_host));
  EXPECT_EQ(device_order, host_order);

  device.to(Device::kHost);
  EXPECT_EQ(device.device(), Device::kHost);
  EXPECT_EQ(device.parameter("fc1.weight").grad.device(), Device::kHost);
}

TEST(GpuModel, AnInputOnAnotherDeviceIsRefusedNamingTheLayer) {
  Model model = Model::mlp("8-16-4", {.device = Device::kCuda});
  const Tensor host_input({2, 8});
  const std::string message = message_of<Error>([&] { (void)model.forward(host_input); });
  EXPECT_NE(message.find("fc1: the input lives on host but fc1.weight lives on cuda"),
            std::string::npos)
      << message;
  // One parameter left behind on the host: the layer that holds it says so.
  Parameter& bias = model.parameter("fc2.bias");
  bias.value = bias.value.to(Device::kHost);
  const std::string mixed = message_of<Error>([&] {
    (void)model.forward(Tensor({2, 8}).to(Device::kCuda));
  });
  EXPECT_NE(mixed.find("fc2: fc2.bias lives on host but fc2.weight lives on cuda"),
            std::string::npos)
      << mixed;
}

TEST(GpuTraining, AFewStepsOfTheDefaultModelMatchTheHostWithinTheEquivalenceTolerance) {
  for (const char* name : {"sgd", "adamw"}) {
    const std::string optimizer = name;
    TrainOptions options;  // the default model, 64-256-256-10, on the synthetic data set
    options.steps = 5;
    options.optimizer = optimizer;
    options.lr = optimizer == "sgd" ? 0.1f : 1e-3f;
    options.log_every = 1;
    const Dataset data = load_dataset(options.dataset, options.seed);
    const TrainResult host = train_single_process(options, data);
    options.device = Device::kCuda;
    const TrainResult device = train_single_process(options, data);
    EXPECT_EQ(device.model.device(), Device::kCuda);
    EXPECT_EQ(device.optimizer->device(), Device::kCuda);

    const std::vector<float> expected = host.model.flat_parameters();
    const std::vector<float> actual = device.model.flat_parameters();
    ASSERT_EQ(expected.size(), actual.size());
    float largest = 0;
    for (std::size_t i = 0; i < expected.size(); ++i)
      largest = std::max(largest, std::abs(expected[i] - actual[i]));
    const float tolerance =
        equivalence_tolerance(options, std::max(host.max_abs_gradient, device.max_abs_gradient));
    EXPECT_LE(largest, tolerance) << optimizer;
    ASSERT_EQ(host.reports.size(), device.reports.size());
    for (std::size_t i = 0; i < host.reports.size(); ++i)
      EXPECT_NEAR(device.reports[i].loss, host.reports[i].loss, 1e-4f)
          << optimizer << " step " << i + 1;
  }
}

}  // namespace
}  // namespace dp
