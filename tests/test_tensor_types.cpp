// Tensors of bfloat16 and float16 elements (dp/tensor.h, "Element types"): float32 stays the
// default, a 16-bit tensor is charged 2 bytes per element, the float32 accessors refuse its
// bytes with an error naming both types while the typed ones read them, and views and the
// communicator's buffers made from them carry the type.
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "comm_test_support.h"
#include "dp/comm.h"
#include "dp/error.h"
#include "dp/float16.h"
#include "dp/launch.h"
#include "dp/memory.h"
#include "dp/tensor.h"
#include "test_support.h"

namespace dp {
namespace {

using testing::contains;
using testing::message_of;
using testing::test_launch;

TEST(TensorTypes, Float32StaysTheDefaultEverywhere) {
  const Tensor made({3, 4});
  EXPECT_EQ(made.dtype(), DataType::kFloat32);
  EXPECT_EQ(Tensor::uninitialized({5}).dtype(), DataType::kFloat32);
  EXPECT_EQ(Tensor::from(std::vector<float>{1, 2}).dtype(), DataType::kFloat32);
  EXPECT_EQ(Tensor().dtype(), DataType::kFloat32);
  EXPECT_EQ(made.bytes(), 48u);
  EXPECT_EQ(made.view().dtype(), DataType::kFloat32);
  EXPECT_EQ(TensorView().dtype(), DataType::kFloat32);
  std::vector<float> host(3);
  EXPECT_EQ(TensorView(std::span(host)).dtype(), DataType::kFloat32);
  EXPECT_EQ(data_type_of<float>, DataType::kFloat32);
  EXPECT_EQ(data_type_of<const BFloat16>, DataType::kBFloat16);
  EXPECT_EQ(data_type_of<Float16>, DataType::kFloat16);
}

TEST(TensorTypes, SixteenBitTensorsAreChargedTwoBytesPerElement) {
  auto memory = std::make_shared<RankMemory>();
  const ScopedRankMemory bind(memory);
  const MemoryTracker& tracker = memory->tracker();
  {
    const Tensor bf16({1000}, DataType::kBFloat16, MemoryCategory::kParameters);
    EXPECT_EQ(bf16.bytes(), 2000u);
    EXPECT_EQ(tracker.current(MemoryCategory::kParameters), 2000u);
    const Tensor f16 = Tensor::uninitialized({10, 100}, DataType::kFloat16,
                                             MemoryCategory::kGradients);
    EXPECT_EQ(tracker.current(MemoryCategory::kGradients), 2000u);
    const Tensor f32({1000}, MemoryCategory::kOptimizerState);
    EXPECT_EQ(tracker.current(MemoryCategory::kOptimizerState), 4000u);
    // Copies keep the type, and so the size.
    const Tensor copy = bf16.clone(MemoryCategory::kOther);
    EXPECT_EQ(copy.dtype(), DataType::kBFloat16);
    EXPECT_EQ(tracker.current(MemoryCategory::kOther), 2000u);
    EXPECT_EQ(tracker.current_total(), 10000u);
  }
  EXPECT_EQ(tracker.current_total(), 0u);
}

TEST(TensorTypes, TheFloatAccessorsRefuseSixteenBitElementsNamingBothTypes) {
  Tensor t({2, 3}, DataType::kBFloat16);
  const Tensor& constant = t;
  const std::string message = message_of<Error>([&] { (void)t.span(); });
  EXPECT_TRUE(contains(message, "Tensor::span() of bfloat16 elements: expected float32 elements"))
      << message;
  EXPECT_TRUE(contains(message, "<dp::BFloat16>")) << message;
  EXPECT_THROW((void)t.data(), Error);
  EXPECT_THROW((void)constant.data(), Error);
  EXPECT_THROW((void)constant.span(), Error);
  EXPECT_THROW((void)t[0], Error);
  EXPECT_THROW((void)constant[0], Error);
  EXPECT_THROW((void)t.at(1, 2), Error);
  EXPECT_THROW((void)constant.at(1, 2), Error);
  const std::string view_message = message_of<Error>([&] { (void)t.view().data(); });
  EXPECT_TRUE(contains(view_message, "TensorView::data() of bfloat16 elements: expected float32"))
      << view_message;
  EXPECT_THROW((void)t.view().host_span(), Error);
  EXPECT_THROW((void)constant.view().data(), Error);
  const std::string span_message =
      message_of<Error>([&] { (void)constant.view(1, 2).host_span(); });
  EXPECT_TRUE(contains(span_message, "ConstTensorView::host_span() of bfloat16 elements"))
      << span_message;

  // The typed accessors refuse another type the same way, float32 included.
  const std::string typed = message_of<Error>([&] { (void)t.span<Float16>(); });
  EXPECT_TRUE(contains(typed, "Tensor::span() of bfloat16 elements: expected float16 elements"))
      << typed;
  Tensor f32({4});
  const std::string from_float = message_of<Error>([&] { (void)f32.data<BFloat16>(); });
  EXPECT_TRUE(contains(from_float, "Tensor::data() of float32 elements: expected bfloat16"))
      << from_float;
  EXPECT_THROW((void)f32.view().host_span<Float16>(), Error);
  EXPECT_THROW((void)std::as_const(f32).view().data<BFloat16>(), Error);
  Tensor f16({4}, DataType::kFloat16);
  EXPECT_THROW((void)f16.span<BFloat16>(), Error);
  EXPECT_THROW((void)f16.view().data<float>(), Error);
}

TEST(TensorTypes, TheTypedAccessorsReadAndWriteTheElements) {
  Tensor t({2, 3}, DataType::kFloat16);
  for (Float16 value : t.span<Float16>()) EXPECT_EQ(value.bits, 0u);  // zero-filled
  t.fill(1e5f);  // rounded once: past float16's range
  for (Float16 value : std::as_const(t).span<Float16>()) EXPECT_EQ(value.bits, 0x7c00u);
  t.span<Float16>()[4] = to_float16(-2.5f);
  EXPECT_EQ(to_float(t.data<Float16>()[4]), -2.5f);
  EXPECT_EQ(t.view().data<Float16>(), t.data<Float16>());
  EXPECT_EQ(to_float(t.view().host_span<Float16>()[4]), -2.5f);
  EXPECT_EQ(to_float(std::as_const(t).view().host_span<Float16>()[4]), -2.5f);
  EXPECT_EQ(t.data<Float16>(), std::as_const(t).data<Float16>());

  const std::vector<BFloat16> values = {to_bfloat16(1.0f), to_bfloat16(3.14159f),
                                        to_bfloat16(-0.0f)};
  const Tensor b = Tensor::from(std::span(values), MemoryCategory::kGradients);
  EXPECT_EQ(b.dtype(), DataType::kBFloat16);
  EXPECT_EQ(b.shape(), std::vector<std::int64_t>{3});
  EXPECT_EQ(b.category(), MemoryCategory::kGradients);
  EXPECT_TRUE(std::vector<BFloat16>(b.span<BFloat16>().begin(), b.span<BFloat16>().end()) ==
              values);
  Tensor filled({2}, DataType::kBFloat16);
  filled.fill(3.14159f);
  EXPECT_EQ(filled.span<BFloat16>()[1], to_bfloat16(3.14159f));  // 0x4049: rounded once
}

TEST(TensorTypes, ViewsSliceInElementsOfTheirTypeAndCarryIt) {
  Tensor t({10}, DataType::kBFloat16);
  const TensorView middle = t.view(3, 4);
  EXPECT_EQ(middle.dtype(), DataType::kBFloat16);
  EXPECT_EQ(middle.bytes(), 8u);
  EXPECT_EQ(middle.data<BFloat16>(), t.data<BFloat16>() + 3);
  EXPECT_EQ(middle.slice(1, 2).data<BFloat16>(), t.data<BFloat16>() + 4);
  EXPECT_EQ(middle.raw_data(), static_cast<void*>(t.data<BFloat16>() + 3));
  const ConstTensorView read_only = middle;  // the conversion keeps the type
  EXPECT_EQ(read_only.dtype(), DataType::kBFloat16);
  EXPECT_EQ(read_only.slice(2, 2).data<BFloat16>(), t.data<BFloat16>() + 5);
  EXPECT_EQ(std::as_const(t).view(9, 1).data<BFloat16>(), t.data<BFloat16>() + 9);
  EXPECT_THROW((void)middle.slice(3, 2), Error);

  std::array<Float16, 5> host{};
  const TensorView over_host{std::span<Float16>(host)};
  EXPECT_EQ(over_host.dtype(), DataType::kFloat16);
  EXPECT_EQ(over_host.size(), 5u);
  EXPECT_EQ(ConstTensorView(std::span<const Float16>(host)).dtype(), DataType::kFloat16);
  EXPECT_EQ(TensorView(host.data(), 2).bytes(), 4u);
  const std::string message = message_of<Error>(
      [&] { (void)TensorView(host.data(), 5, DataType::kInt32, Device::kHost); });
  EXPECT_TRUE(contains(message, "TensorView of int32 elements: expected float32, bfloat16 or "
                                "float16"))
      << message;
  EXPECT_THROW((void)Tensor({2}, DataType::kUInt8), Error);
  EXPECT_THROW((void)ConstTensorView(host.data(), 1, DataType::kUInt8, Device::kHost), Error);
}

TEST(TensorTypes, BuffersMadeFromViewsCarryTheType) {
  Tensor t({6}, DataType::kFloat16);
  const MutableBuffer out = t.view(2, 3);
  EXPECT_EQ(out.type, DataType::kFloat16);
  EXPECT_EQ(out.count, 3u);
  EXPECT_EQ(out.bytes(), 6u);
  EXPECT_EQ(out.data, static_cast<void*>(t.data<Float16>() + 2));
  const ConstBuffer in = std::as_const(t).view();
  EXPECT_EQ(in.type, DataType::kFloat16);
  EXPECT_EQ(in.bytes(), 12u);
  const ConstBuffer from_mutable_view = t.view();
  EXPECT_EQ(from_mutable_view.type, DataType::kFloat16);
  Tensor f32({6});
  EXPECT_EQ(static_cast<MutableBuffer>(f32.view()).type, DataType::kFloat32);
}

TEST(TensorTypes, ABfloat16ViewAllReducesAsBfloat16) {
  // Rank r holds 1 + r 2^-8 in every element: in bfloat16 (8 bits of precision) the sum of
  // 1 and 1 + 2^-8 is 2 + 2^-8, a tie between 2 and 2 + 2^-6 rounded to the even 2. Summed as
  // floats (or as bytes read as floats) it would be something else.
  launch(test_launch(2), [](Communicator& comm) {
    Tensor t({4}, DataType::kBFloat16, MemoryCategory::kGradients);
    t.fill(1.0f + static_cast<float>(comm.rank()) * 0x1p-8f);
    comm.allreduce(t.view(), ReduceOp::kSum)->wait();
    for (BFloat16 value : t.span<BFloat16>()) EXPECT_EQ(to_float(value), 2.0f);
    EXPECT_EQ(comm.counters().of(CommOp::kAllReduce).bytes_sent, 8u);  // 2 (p-1)/p 8 bytes
  });
}

TEST(TensorTypes, MovesClonesAndDeviceCopiesKeepTheType) {
  Tensor t({3}, DataType::kBFloat16);
  t.fill(0.5f);
  Tensor moved = std::move(t);
  EXPECT_EQ(moved.dtype(), DataType::kBFloat16);
  EXPECT_EQ(t.dtype(), DataType::kFloat32);  // NOLINT(bugprone-use-after-move): documented
  Tensor assigned;
  assigned = std::move(moved);
  EXPECT_EQ(assigned.dtype(), DataType::kBFloat16);
  EXPECT_EQ(assigned.bytes(), 6u);
  const Tensor copy = assigned.clone();
  EXPECT_EQ(copy.dtype(), DataType::kBFloat16);
  EXPECT_EQ(copy.span<BFloat16>()[2], to_bfloat16(0.5f));

  set_cuda_device_emulated(true);
  {
    const Tensor device = copy.to(Device::kCuda);
    EXPECT_EQ(device.dtype(), DataType::kBFloat16);
    EXPECT_EQ(device.bytes(), 6u);
    // The device check comes first: the tensor is not the host's to read, whatever its type.
    const std::string message = message_of<Error>([&] { (void)device.span<BFloat16>(); });
    EXPECT_TRUE(contains(message, "Tensor::span() of a tensor in cuda (emulated) memory"))
        << message;
    Tensor zeros({2}, DataType::kFloat16, MemoryCategory::kOther, Device::kCuda);
    const Tensor back = device.to(Device::kHost);
    EXPECT_EQ(back.span<BFloat16>()[1], to_bfloat16(0.5f));
    EXPECT_EQ(zeros.to(Device::kHost).span<Float16>()[1].bits, 0u);
  }
  set_cuda_device_emulated(false);
}

}  // namespace
}  // namespace dp
