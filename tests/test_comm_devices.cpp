// Communication buffers and devices, on a machine without a GPU (the GPU side is in
// tests/gpu/test_gpu_comm.cpp): a buffer carries its device, the backends refuse the
// devices they cannot reach with a clear dp::Error before they read anything, and the nccl
// backend without CUDA, NCCL or a GPU is an error that says so, not a crash.
#include <gtest/gtest.h>

#include <span>
#include <string>
#include <vector>

#include "dp/comm.h"
#include "dp/error.h"
#include "dp/launch.h"
#include "dp/tensor.h"
#include "test_support.h"

namespace dp {
namespace {

using testing::contains;
using testing::message_of;

TEST(CommDevices, BuffersAreOnTheHostUnlessTheySayOtherwise) {
  std::vector<float> values(4, 1.0f);
  const MutableBuffer host{std::span<float>(values)};
  EXPECT_EQ(host.device, Device::kHost);
  const MutableBuffer device(values.data(), values.size(), DataType::kFloat32, Device::kCuda);
  EXPECT_EQ(device.device, Device::kCuda);
  EXPECT_EQ(static_cast<ConstBuffer>(device).device, Device::kCuda);
}

TEST(CommDevices, NcclIsABackendName) {
  EXPECT_EQ(parse_backend("nccl"), Backend::kNccl);
  EXPECT_EQ(to_string(Backend::kNccl), "nccl");
  const std::string message = message_of<Error>([] { (void)parse_backend("gloo"); });
  EXPECT_TRUE(contains(message, "expected 'local', 'mpi' or 'nccl'")) << message;
}

TEST(CommDevices, NcclWithoutAGpuIsAClearErrorAndRunsNothing) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present: tests/gpu cover nccl";
  bool ran = false;
  const std::string message = message_of<Error>([&] {
    launch({.world_size = 1, .backend = Backend::kNccl}, [&](Communicator&) { ran = true; });
  });
  EXPECT_FALSE(ran);
  if (nccl_built()) {
    EXPECT_TRUE(contains(message, "the nccl backend needs a CUDA device: this process sees none"))
        << message;
  } else {
    EXPECT_TRUE(contains(message,
                         "the nccl backend was requested but this dplab was built "
                         "without CUDA and NCCL"))
        << message;
  }
}

// The pointer is host memory marked as device memory: the call must fail before it reads or
// writes through it (ASan in the sanitize build would see a wild access otherwise).
TEST(CommDevices, LocalDeviceBuffersWithoutAGpuAreAClearError) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present: tests/gpu cover it";
  const std::string message = message_of<Error>([] {
    launch({.world_size = 1}, [](Communicator& comm) {
      std::vector<float> values(8, 1.0f);
      comm.allreduce({values.data(), values.size(), DataType::kFloat32, Device::kCuda},
                     ReduceOp::kSum)
          ->wait();
    });
  });
  EXPECT_TRUE(contains(
      message, cuda_compiled() ? "this process sees no CUDA device" : "this build has no CUDA"))
      << message;
}

TEST(CommDevices, LocalInputAndOutputOnTwoDevicesAreRefused) {
  const std::string message = message_of<Error>([] {
    launch({.world_size = 1}, [](Communicator& comm) {
      std::vector<float> in(4, 1.0f);
      std::vector<float> out(4, 0.0f);
      comm.reduce_scatter(std::span<const float>(in),
                          {out.data(), out.size(), DataType::kFloat32, Device::kCuda},
                          ReduceOp::kSum);
    });
  });
  EXPECT_TRUE(contains(message,
                       "reduce_scatter: expected the input and the output on one "
                       "device, got the input in host memory and the output in cuda "
                       "memory"))
      << message;
}

}  // namespace
}  // namespace dp
