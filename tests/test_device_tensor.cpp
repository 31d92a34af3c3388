// Device tensors as seen from a machine without a usable GPU (every build, every machine):
// asking for one is a clear error, and the operations refuse operands on two devices or
// host access to device memory before touching a byte. What needs a GPU is in
// tests/gpu/test_gpu_tensor.cpp.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "dp/data.h"
#include "dp/error.h"
#include "dp/memory.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "dp/tensor.h"
#include "dp/tensor_ops.h"
#include "dp/trainer.h"
#include "test_support.h"

namespace dp {
namespace {

using testing::contains;
using testing::message_of;

TEST(DeviceTensor, WithoutAUsableDeviceAskingForOneIsAClearErrorThatChargesNothing) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present: see dp_gpu_tests";
  auto memory = std::make_shared<RankMemory>();
  const ScopedRankMemory bind(memory);
  const std::string message = message_of<Error>([] {
    Tensor({4, 4}, MemoryCategory::kGradients, Device::kCuda);
  });
  if (cuda_compiled())
    EXPECT_TRUE(contains(message, "sees no CUDA device")) << message;
  else
    EXPECT_TRUE(contains(message, "this build has no CUDA: configure with a CUDA compiler"))
        << message;
  EXPECT_EQ(memory->tracker().current(MemoryCategory::kGradients), 0u);
  EXPECT_THROW(Tensor::from(std::vector<float>{1, 2}, MemoryCategory::kOther, Device::kCuda),
               Error);
  Tensor host({3});
  EXPECT_THROW((void)host.to(Device::kCuda), Error);
}

// The views below claim to be on the device but point at host memory: every check must
// throw before anything reads through them.
TEST(DeviceViews, OperandsOnTwoDevicesAreRefusedWithBothNamed) {
  std::vector<float> storage(8, 1.0f);
  const TensorView host(storage.data(), 4);
  const TensorView device(storage.data() + 4, 4, Device::kCuda);
  const std::string message = message_of<Error>([&] { add(host, device); });
  EXPECT_TRUE(contains(message, "add: the views live in host and cuda memory")) << message;
  EXPECT_THROW(axpy(2.0f, device, host), Error);
  EXPECT_THROW((void)dot(host, device), Error);
}

TEST(DeviceViews, HostAccessToDeviceMemoryIsRefused) {
  std::vector<float> storage(4, 1.0f);
  const TensorView device(storage.data(), 4, Device::kCuda);
  const std::string message = message_of<Error>([&] { (void)device.host_span(); });
  EXPECT_TRUE(contains(message, "cuda")) << message;
  EXPECT_THROW((void)ConstTensorView(device).host_span(), Error);
}

// A view becomes a communication buffer on its own device (the backend decides whether it
// accepts it), with nothing read through the pointer.
TEST(DeviceViews, CommunicationBuffersCarryTheViewsDevice) {
  std::vector<float> storage(4, 1.0f);
  const TensorView device(storage.data(), 4, Device::kCuda);
  const MutableBuffer writable = device;
  EXPECT_EQ(writable.device, Device::kCuda);
  EXPECT_EQ(writable.data, storage.data());
  EXPECT_EQ(writable.count, 4u);
  const ConstBuffer readable = ConstTensorView(device);
  EXPECT_EQ(readable.device, Device::kCuda);
  EXPECT_EQ(static_cast<ConstBuffer>(writable).device, Device::kCuda);
  const ConstBuffer host = TensorView(storage.data(), 4);
  EXPECT_EQ(host.device, Device::kHost);
}

TEST(DeviceViews, AnOptimizerRefusesViewsOnAnotherDeviceThanItsState) {
  std::vector<float> params(4, 1.0f);
  std::vector<float> grads(4, 0.5f);
  Sgd sgd(4, {.lr = 0.1f});  // state on the host
  sgd.begin_step();
  const std::string message = message_of<Error>([&] {
    sgd.update(0, TensorView(params.data(), 4, Device::kCuda),
               ConstTensorView(grads.data(), 4, Device::kCuda));
  });
  EXPECT_TRUE(contains(message, "sgd update of parameters in cuda memory")) << message;
  EXPECT_TRUE(contains(message, "(host memory)")) << message;
  sgd.update(0, TensorView(params.data(), 4), ConstTensorView(grads.data(), 4));  // host views
  EXPECT_EQ(params[0], 1.0f - 0.1f * 0.5f);
}

TEST(DeviceViews, WithoutCudaEveryOperationOnADeviceViewSaysHowToGetIt) {
  if (cuda_compiled()) GTEST_SKIP() << "this build has CUDA: the kernels run on a device";
  std::vector<float> storage(4, 1.0f);
  const TensorView device(storage.data(), 4, Device::kCuda);
  const std::string message = message_of<Error>([&] { scale(device, 2.0f); });
  EXPECT_TRUE(contains(message, "scale on a CUDA device: this build has no CUDA")) << message;
  EXPECT_THROW(fill(device, 0.0f), Error);
  EXPECT_THROW((void)norm(device), Error);
  EXPECT_THROW((void)all_finite(device), Error);
  std::vector<float> host(4);
  EXPECT_THROW(copy(device, TensorView(host.data(), 4)), Error);
}

TEST(DeviceModel, WithoutAUsableDeviceAModelOnCudaIsAClearError) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present: see dp_gpu_tests";
  const std::string built =
      message_of<Error>([] { (void)Model::mlp("8-16-4", {.device = Device::kCuda}); });
  EXPECT_TRUE(contains(built, "on a CUDA device")) << built;
  Model model = Model::mlp("8-16-4");
  EXPECT_THROW(model.to(Device::kCuda), Error);
  // The model is not left half on a device: it still trains on the host.
  EXPECT_EQ(model.device(), Device::kHost);
  const Tensor x({2, 8});
  const std::vector<int> labels = {0, 1};
  EXPECT_NO_THROW((void)model.backward(model.forward(x), labels));
}

TEST(DeviceTraining, WithoutAUsableDeviceTrainingOnCudaFailsBeforeAnyStep) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present: see dp_gpu_tests";
  TrainOptions options;
  options.steps = 3;
  options.device = Device::kCuda;
  const Dataset data = load_dataset("synthetic:256", 0);
  const std::string message = message_of<Error>([&] { (void)train_single_process(options, data); });
  EXPECT_TRUE(contains(
      message, cuda_compiled() ? "this process sees no CUDA device" : "this build has no CUDA"))
      << message;
  EXPECT_TRUE(contains(message, "--device host")) << message;
}

}  // namespace
}  // namespace dp
