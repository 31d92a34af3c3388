// Device tensors and the kernels of dp/tensor_ops.h against the host implementation, the
// readable ground truth. Needs a CUDA device: without one, main() exits with code 77,
// which ctest reports as skipped (SKIP_RETURN_CODE in tests/CMakeLists.txt).
//
// Tolerances (derived in common/src/cuda/kernels.cu):
//   - fill, copy, scale, divide, add, axpy, all_finite, the SGD and AdamW updates, and on
//     bfloat16 and float16 elements convert, fill, add, axpy and all_finite: bitwise equal
//     to the host;
//   - dot, norm: |device - host| <= 2 (n - 1) 2^-53 sum|x[i] y[i]| (for norm, of the
//     squares: the norm is compared through its square).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "dp/error.h"
#include "dp/float16.h"
#include "dp/memory.h"
#include "dp/optimizer.h"
#include "dp/tensor.h"
#include "dp/tensor_ops.h"
#include "gpu_test_support.h"

namespace dp {
namespace {

using testing::gpu::bitwise_equal;

/// n floats drawn uniformly from [-1, 1) with a fixed seed (a size that is not a multiple
/// of any block size, so the kernels' tails are exercised).
std::vector<float> random_values(std::size_t n, unsigned seed) {
  return testing::gpu::random_values(n, seed);
}

constexpr std::size_t kN = (1u << 20) + 37;

/// The bound of the file comment for a sum of n products with absolute sum `magnitude`.
double reduction_bound(std::size_t n, double magnitude) {
  return 2.0 * static_cast<double>(n - 1) * std::ldexp(1.0, -53) * magnitude;
}

TEST(GpuTensor, LivesOnTheDeviceChargedToItsCategoryAndRefusesHostAccess) {
  auto memory = std::make_shared<RankMemory>();
  const ScopedRankMemory bind(memory);
  {
    Tensor g({250, 4}, MemoryCategory::kGradients, Device::kCuda);
    EXPECT_EQ(g.device(), Device::kCuda);
    EXPECT_EQ(g.view().device(), Device::kCuda);
    EXPECT_EQ(memory->tracker().current(MemoryCategory::kGradients), 4000u);
    // What a solution touching raw host memory of a device tensor runs into.
    EXPECT_THROW((void)g.data(), Error);
    EXPECT_THROW((void)g.span(), Error);
    EXPECT_THROW((void)g[0], Error);
    EXPECT_THROW((void)g.at(0, 0), Error);
    EXPECT_THROW((void)g.view().host_span(), Error);
    const Tensor back = g.to(Device::kHost);  // zero-filled at construction
    for (std::size_t i = 0; i < back.size(); ++i) ASSERT_EQ(back[i], 0.0f) << i;
  }
  EXPECT_EQ(memory->tracker().current(MemoryCategory::kGradients), 0u);
  EXPECT_EQ(memory->tracker().peak(MemoryCategory::kGradients), 4000u);
}

TEST(GpuTensor, PastTheBudgetADeviceAllocationThrowsOutOfMemory) {
  auto memory = std::make_shared<RankMemory>();
  const ScopedRankMemory bind(memory);
  memory->tracker().set_budget(1024);
  EXPECT_THROW(Tensor({512}, MemoryCategory::kOptimizerState, Device::kCuda), OutOfMemory);
  EXPECT_EQ(memory->tracker().current_total(), 0u);
}

TEST(GpuTensor, CopiesCrossDevicesWholeAndBySlice) {
  const std::vector<float> values = random_values(kN, 1);
  const Tensor host = Tensor::from(values);
  Tensor device = Tensor::from(values, MemoryCategory::kActivations, Device::kCuda);
  EXPECT_TRUE(bitwise_equal(host, device));
  EXPECT_TRUE(bitwise_equal(host, host.to(Device::kCuda)));
  EXPECT_TRUE(bitwise_equal(host, device.clone()));
  // Slices: device -> device, device -> host, host -> device.
  Tensor other({static_cast<std::int64_t>(kN)}, MemoryCategory::kActivations, Device::kCuda);
  copy(device.view(100, 5000), other.view(7, 5000));
  Tensor out({5000});
  copy(other.view(7, 5000), out.view());
  EXPECT_EQ(std::memcmp(out.data(), host.data() + 100, out.bytes()), 0);
  copy(host.view(0, 10), other.view(0, 10));
  Tensor first({10});
  copy(other.view(0, 10), first.view());
  EXPECT_EQ(std::memcmp(first.data(), host.data(), first.bytes()), 0);
}

TEST(GpuTensorOps, ElementWiseOperationsEqualTheHostBitwise) {
  const std::vector<float> xs = random_values(kN, 2);
  const std::vector<float> ys = random_values(kN, 3);
  const Tensor x_host = Tensor::from(xs);
  const Tensor x_device = Tensor::from(xs, MemoryCategory::kActivations, Device::kCuda);
  Tensor y_host = Tensor::from(ys);
  Tensor y_device = Tensor::from(ys, MemoryCategory::kActivations, Device::kCuda);

  scale(y_host.view(), 0.37f);
  scale(y_device.view(), 0.37f);
  EXPECT_TRUE(bitwise_equal(y_host, y_device)) << "scale";
  divide(y_host.view(), 3.0f);
  divide(y_device.view(), 3.0f);
  EXPECT_TRUE(bitwise_equal(y_host, y_device)) << "divide";
  add(x_host.view(), y_host.view());
  add(x_device.view(), y_device.view());
  EXPECT_TRUE(bitwise_equal(y_host, y_device)) << "add";
  axpy(-0.1f, x_host.view(), y_host.view());  // a fused multiply-add would differ here
  axpy(-0.1f, x_device.view(), y_device.view());
  EXPECT_TRUE(bitwise_equal(y_host, y_device)) << "axpy";
  fill(y_host.view(12, 1000), 2.5f);
  fill(y_device.view(12, 1000), 2.5f);
  EXPECT_TRUE(bitwise_equal(y_host, y_device)) << "fill";
  y_host.fill(-1.0f);
  y_device.fill(-1.0f);
  EXPECT_TRUE(bitwise_equal(y_host, y_device)) << "Tensor::fill";
}

TEST(GpuTensorOps, SixteenBitConversionsAndAccumulationEqualTheHostBitwise) {
  // Every bfloat16 and every float16 bit pattern, and float32 patterns over every exponent
  // (every 4096th, the low bits varied): NaNs, infinities, subnormals and ties among them.
  std::vector<BFloat16> bf16(0x10000);
  std::vector<Float16> f16(0x10000);
  for (std::uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    bf16[bits] = BFloat16{static_cast<std::uint16_t>(bits)};
    f16[bits] = Float16{static_cast<std::uint16_t>(bits)};
  }
  std::vector<float> sweep(std::size_t{1} << 20);
  for (std::uint32_t i = 0; i < sweep.size(); ++i)
    sweep[i] = std::bit_cast<float>(i * 4096u + (i % 4093u));
  const Tensor host_bf16 = Tensor::from(bf16);
  const Tensor host_f16 = Tensor::from(f16);
  const Tensor host_sweep = Tensor::from(sweep);
  const Tensor device_bf16 = Tensor::from(bf16, MemoryCategory::kOther, Device::kCuda);
  const Tensor device_f16 = Tensor::from(f16, MemoryCategory::kOther, Device::kCuda);
  const Tensor device_sweep = Tensor::from(sweep, MemoryCategory::kOther, Device::kCuda);
  for (DataType to : {DataType::kFloat32, DataType::kBFloat16, DataType::kFloat16}) {
    EXPECT_TRUE(bitwise_equal(host_bf16.to(to), device_bf16.to(to)))
        << "bfloat16 to " << to_string(to);
    EXPECT_TRUE(bitwise_equal(host_f16.to(to), device_f16.to(to)))
        << "float16 to " << to_string(to);
    EXPECT_TRUE(bitwise_equal(host_sweep.to(to), device_sweep.to(to)))
        << "float32 to " << to_string(to);
  }

  const std::vector<float> xs = random_values(kN, 4);
  const std::vector<float> ys = random_values(kN, 5);
  for (DataType type : {DataType::kBFloat16, DataType::kFloat16}) {
    const Tensor x_host = Tensor::from(xs).to(type);
    const Tensor x_device = Tensor::from(xs, MemoryCategory::kActivations, Device::kCuda).to(type);
    EXPECT_TRUE(bitwise_equal(x_host, x_device)) << to_string(type);
    Tensor y_host = Tensor::from(ys);
    Tensor y_device = Tensor::from(ys, MemoryCategory::kActivations, Device::kCuda);
    add(x_host.view(), y_host.view());
    add(x_device.view(), y_device.view());
    EXPECT_TRUE(bitwise_equal(y_host, y_device)) << "add of " << to_string(type);
    axpy(-0.1f, x_host.view(), y_host.view());
    axpy(-0.1f, x_device.view(), y_device.view());
    EXPECT_TRUE(bitwise_equal(y_host, y_device)) << "axpy of " << to_string(type);
    Tensor filled_host({static_cast<std::int64_t>(kN)}, type);
    Tensor filled_device({static_cast<std::int64_t>(kN)}, type, MemoryCategory::kOther,
                         Device::kCuda);
    EXPECT_TRUE(bitwise_equal(filled_host, filled_device)) << "zero-filled " << to_string(type);
    fill(filled_host.view(12, 1000), 1e5f);  // float16: infinity
    fill(filled_device.view(12, 1000), 1e5f);
    EXPECT_TRUE(bitwise_equal(filled_host, filled_device)) << "fill of " << to_string(type);
    filled_host.fill(-3.14159f);
    filled_device.fill(-3.14159f);
    EXPECT_TRUE(bitwise_equal(filled_host, filled_device)) << "Tensor::fill of " << to_string(type);
  }
  // all_finite: +0 up to the largest finite value, then the positive infinity.
  EXPECT_TRUE(all_finite(device_bf16.view(0, 0x7f80)));
  EXPECT_FALSE(all_finite(device_bf16.view(0, 0x7f81)));
  EXPECT_TRUE(all_finite(device_f16.view(0, 0x7c00)));
  EXPECT_FALSE(all_finite(device_f16.view(0, 0x7c01)));
  EXPECT_FALSE(all_finite(device_f16.view(0x7e00, 1)));      // a NaN alone
  EXPECT_TRUE(all_finite(device_f16.view(0x8000, 0x7c00)));  // -0 down to the most negative
}

TEST(GpuTensorOps, DotAndNormAgreeWithTheHostWithinTheStatedBound) {
  for (const std::size_t n : {std::size_t{1}, std::size_t{255}, kN, std::size_t{10'000'019}}) {
    const std::vector<float> xs = random_values(n, 4);
    const std::vector<float> ys = random_values(n, 5);
    const Tensor x_host = Tensor::from(xs);
    const Tensor y_host = Tensor::from(ys);
    const Tensor x_device = x_host.to(Device::kCuda);
    const Tensor y_device = y_host.to(Device::kCuda);
    double magnitude = 0;
    double squares = 0;
    for (std::size_t i = 0; i < n; ++i) {
      magnitude += std::abs(static_cast<double>(xs[i]) * ys[i]);
      squares += static_cast<double>(xs[i]) * xs[i];
    }
    const double host_dot = dot(x_host.view(), y_host.view());
    const double device_dot = dot(x_device.view(), y_device.view());
    EXPECT_LE(std::abs(device_dot - host_dot), reduction_bound(n, magnitude)) << "n = " << n;
    const double host_norm = norm(x_host.view());
    const double device_norm = norm(x_device.view());
    // Compared through the squares: the bound, plus the roundings of each square root and
    // of squaring it again (3 u of the sum of squares on each side).
    EXPECT_LE(std::abs(device_norm * device_norm - host_norm * host_norm),
              reduction_bound(n, squares) + 8 * std::ldexp(1.0, -53) * squares)
        << "n = " << n;
    // The device's order of additions is fixed: the same bits every time.
    EXPECT_EQ(dot(x_device.view(), y_device.view()), device_dot);
  }
}

TEST(GpuTensorOps, AllFiniteFindsOneNanOrInfinityAnywhere) {
  Tensor x = Tensor::from(random_values(kN, 6), MemoryCategory::kActivations, Device::kCuda);
  EXPECT_TRUE(all_finite(x.view()));
  for (const float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    Tensor y = x.clone();
    const Tensor one = Tensor::from(std::vector<float>{bad});
    copy(one.view(), y.view(kN - 1, 1));
    EXPECT_FALSE(all_finite(y.view()));
    EXPECT_TRUE(all_finite(y.view(0, kN - 1)));
  }
}

/// Runs `steps` updates of a slice with `host` and `device` (the same optimizer on either
/// device) from the same parameters and gradients, expecting bitwise equal parameters
/// after each step and equal state at the end.
template <typename OptimizerType>
void expect_same_updates(OptimizerType& host, OptimizerType& device, const char* what) {
  constexpr std::size_t kOffset = 1000;
  const std::size_t n = kN - 2000;  // a slice of the state, as a ZeRO shard updates
  Tensor p_host = Tensor::from(random_values(n, 7));
  Tensor p_device = p_host.to(Device::kCuda);
  for (int step = 0; step < 3; ++step) {
    const Tensor g_host = Tensor::from(random_values(n, 8 + step));
    const Tensor g_device = g_host.to(Device::kCuda);
    host.begin_step();
    device.begin_step();
    host.update(kOffset, p_host.view(), g_host.view());
    device.update(kOffset, p_device.view(), g_device.view());
    EXPECT_TRUE(bitwise_equal(p_host, p_device)) << what << ", step " << step + 1;
  }
  const auto host_state = host.state();
  const auto device_state = device.state();
  ASSERT_EQ(host_state.size(), device_state.size());
  for (std::size_t i = 0; i < host_state.size(); ++i)
    EXPECT_TRUE(bitwise_equal(*host_state[i].tensor, *device_state[i].tensor))
        << what << ", " << host_state[i].name;
}

TEST(GpuOptimizers, SgdAndAdamWUpdatesEqualTheHostBitwise) {
  for (const SgdOptions options :
       {SgdOptions{.lr = 0.1f}, SgdOptions{.lr = 0.1f, .weight_decay = 0.01f},
        SgdOptions{.lr = 0.05f, .momentum = 0.9f, .weight_decay = 0.01f}}) {
    Sgd host(kN, options);
    Sgd device(kN, options, Device::kCuda);
    expect_same_updates(host, device, "sgd");
  }
  AdamW host(kN, {.lr = 1e-3f});
  AdamW device(kN, {.lr = 1e-3f}, Device::kCuda);
  EXPECT_EQ(device.device(), Device::kCuda);
  expect_same_updates(host, device, "adamw");
}

TEST(GpuTensorOps, OperandsOnTwoDevicesAreRefused) {
  const Tensor host({16});
  Tensor device({16}, MemoryCategory::kActivations, Device::kCuda);
  EXPECT_THROW(add(host.view(), device.view()), Error);
  EXPECT_THROW((void)dot(device.view(), host.view()), Error);
}

}  // namespace
}  // namespace dp

int main(int argc, char** argv) {
  return dp::testing::gpu::run_gpu_tests(argc, argv, "GPU tests");
}
