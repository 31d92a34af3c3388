// gpu_test_support.h: what the GPU tests (dp_gpu_tests) share: seeded random inputs and
// comparisons of a device tensor with its host counterpart.
//
// Example:
//
//   const dp::Tensor host = dp::Tensor::from(dp::testing::gpu::random_values(1000, 7));
//   const dp::Tensor device = host.to(dp::Device::kCuda);
//   EXPECT_TRUE(dp::testing::gpu::bitwise_equal(host, device));
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "dp/tensor.h"

namespace dp::testing::gpu {

/// n floats drawn uniformly from [low, high) with a fixed seed.
inline std::vector<float> random_values(std::size_t n, unsigned seed, float low = -1.0f,
                                        float high = 1.0f) {
  std::mt19937 generator(seed);
  std::uniform_real_distribution<float> uniform(low, high);
  std::vector<float> values(n);
  for (float& value : values) value = uniform(generator);
  return values;
}

/// True when the two tensors (one on the host, one on the device) hold the same bits.
inline bool bitwise_equal(const Tensor& host, const Tensor& device) {
  const Tensor copied = device.to(Device::kHost);
  return host.dtype() == copied.dtype() && host.size() == copied.size() &&
         std::memcmp(host.view().raw_data(), copied.view().raw_data(), host.bytes()) == 0;
}

/// The main() of a GPU test program: runs its tests, or exits with 77 (ctest's
/// SKIP_RETURN_CODE) saying that `what` are skipped when this process sees no CUDA device.
inline int run_gpu_tests(int argc, char** argv, const char* what) {
  ::testing::InitGoogleTest(&argc, argv);
  if (cuda_device_count() == 0) {
    std::fprintf(stderr, "no CUDA device: the %s are skipped (exit code 77)\n", what);
    return 77;
  }
  return RUN_ALL_TESTS();
}

}  // namespace dp::testing::gpu
