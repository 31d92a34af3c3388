// Tensors of bfloat16 and float16 elements (dp/tensor.h, "Element types"): float32 stays the
// default, a 16-bit tensor is charged 2 bytes per element, the float32 accessors refuse its
// bytes with an error naming both types while the typed ones read them, and views and the
// communicator's buffers made from them carry the type. Then the operations on them
// (dp/tensor_ops.h): conversions, exhaustive over both 16-bit formats, checked against
// dp/float16.h (itself checked against independent oracles in test_float16.cpp) and against
// values written out by hand, the same on the emulated device, the float32 accumulation of
// add and axpy, and a clear error for every operation given a type it does not take.
#include <gtest/gtest.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "comm_test_support.h"
#include "dp/clock.h"
#include "dp/comm.h"
#include "dp/error.h"
#include "dp/float16.h"
#include "dp/launch.h"
#include "dp/memory.h"
#include "dp/rng.h"
#include "dp/tensor.h"
#include "dp/tensor_ops.h"
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
    const Tensor f16 =
        Tensor::uninitialized({10, 100}, DataType::kFloat16, MemoryCategory::kGradients);
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
  const std::string message =
      message_of<Error>([&] { (void)TensorView(host.data(), 5, DataType::kInt32, Device::kHost); });
  EXPECT_TRUE(contains(message,
                       "TensorView of int32 elements: expected float32, bfloat16 or "
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

// --- Conversions and the operations on 16-bit views ----------------------------------------

/// Every 16-bit pattern, 0 to 0xffff, as elements of `T` (BFloat16 or Float16).
template <typename T>
std::vector<T> every_pattern() {
  std::vector<T> values(0x10000);
  for (std::uint32_t bits = 0; bits <= 0xffffu; ++bits)
    values[bits] = T{static_cast<std::uint16_t>(bits)};
  return values;
}

/// 2^20 float32 bit patterns spread over all 2^32 (every 4096th, and an odd offset so that
/// the low bits vary): every exponent, both signs, infinities and NaNs among them.
std::vector<float> float_sweep() {
  std::vector<float> values(std::size_t{1} << 20);
  for (std::uint32_t i = 0; i < values.size(); ++i)
    values[i] = std::bit_cast<float>(i * 4096u + (i % 4093u));
  return values;
}

std::vector<std::uint32_t> bits_of(const Tensor& floats) {
  std::vector<std::uint32_t> bits;
  for (float value : floats.span()) bits.push_back(std::bit_cast<std::uint32_t>(value));
  return bits;
}

template <typename T>
std::vector<std::uint16_t> bits_of_16(const Tensor& halves) {
  std::vector<std::uint16_t> bits;
  for (T value : halves.span<T>()) bits.push_back(value.bits);
  return bits;
}

bool is_nan_bf16(std::uint16_t bits) {
  return (bits & 0x7f80u) == 0x7f80u && (bits & 0x007fu) != 0;
}
bool is_nan_f16(std::uint16_t bits) {
  return (bits & 0x7c00u) == 0x7c00u && (bits & 0x03ffu) != 0;
}

TEST(TensorConvert, EveryBfloat16ValueWidensExactlyAndComesBack) {
  const Tensor all = Tensor::from(every_pattern<BFloat16>(), MemoryCategory::kParameters);
  const Tensor widened = all.to(DataType::kFloat32);
  EXPECT_EQ(widened.dtype(), DataType::kFloat32);
  EXPECT_EQ(widened.shape(), all.shape());
  EXPECT_EQ(widened.category(), MemoryCategory::kParameters);
  const std::vector<std::uint32_t> widened_bits = bits_of(widened);
  const Tensor back = widened.to(DataType::kBFloat16);
  const std::vector<std::uint16_t> back_bits = bits_of_16<BFloat16>(back);
  const Tensor as_f16 = all.to(DataType::kFloat16);  // through float32, rounded once
  const std::vector<std::uint16_t> f16_bits = bits_of_16<Float16>(as_f16);
  for (std::uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    // bfloat16 is the top half of a float32: its float is its bits shifted, NaNs included.
    ASSERT_EQ(widened_bits[bits], bits << 16) << std::hex << bits;
    // Back unchanged; a NaN stays a NaN of the same sign and payload, made quiet.
    const std::uint32_t expected =
        is_nan_bf16(static_cast<std::uint16_t>(bits)) ? bits | 0x40u : bits;
    ASSERT_EQ(back_bits[bits], expected) << std::hex << bits;
    ASSERT_EQ(f16_bits[bits], to_float16(to_float(BFloat16{static_cast<std::uint16_t>(bits)})).bits)
        << std::hex << bits;
  }
}

TEST(TensorConvert, EveryFloat16ValueWidensExactlyAndComesBack) {
  const Tensor all = Tensor::from(every_pattern<Float16>());
  const Tensor widened = all.to(DataType::kFloat32);
  const std::vector<std::uint32_t> widened_bits = bits_of(widened);
  const std::vector<std::uint16_t> back_bits = bits_of_16<Float16>(widened.to(DataType::kFloat16));
  const std::vector<std::uint16_t> bf16_bits = bits_of_16<BFloat16>(all.to(DataType::kBFloat16));
  for (std::uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const Float16 value{static_cast<std::uint16_t>(bits)};
    ASSERT_EQ(widened_bits[bits], std::bit_cast<std::uint32_t>(to_float(value)))
        << std::hex << bits;
    const std::uint32_t expected = is_nan_f16(value.bits) ? bits | 0x200u : bits;
    ASSERT_EQ(back_bits[bits], expected) << std::hex << bits;
    ASSERT_EQ(bf16_bits[bits], to_bfloat16(to_float(value)).bits) << std::hex << bits;
  }
  // Written out by hand: the smallest subnormal, the largest subnormal, the largest finite
  // value, the infinities and a NaN.
  const auto widened_of = [&](std::uint16_t bits) { return widened.span()[bits]; };
  EXPECT_EQ(widened_of(0x0001), 0x1p-24f);
  EXPECT_EQ(widened_of(0x03ff), 1023 * 0x1p-24f);
  EXPECT_EQ(widened_of(0x0400), 0x1p-14f);
  EXPECT_EQ(widened_of(0x7bff), 65504.0f);
  EXPECT_EQ(widened_of(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(widened_of(0xfc00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(widened_of(0x7e00)));
  EXPECT_EQ(std::bit_cast<std::uint32_t>(widened_of(0x8000)), 0x80000000u);  // -0
}

TEST(TensorConvert, Float32ToFloat16RoundsAsFloat16hSaysAtItsEdges) {
  const float infinity = std::numeric_limits<float>::infinity();
  // (value, the float16 bits worked out by hand)
  const std::vector<std::pair<float, std::uint16_t>> cases = {
      {65504.0f, 0x7bff},             // largest finite
      {65519.99609375f, 0x7bff},      // just below the tie at 65520
      {65520.0f, 0x7c00},             // the tie: to the "even" 65536, i.e. infinity
      {1e5f, 0x7c00},                 // overflow
      {-1e5f, 0xfc00},                // overflow, negative
      {infinity, 0x7c00},             // infinities stay
      {-infinity, 0xfc00},            //
      {0x1p-14f, 0x0400},             // smallest normal
      {1023.5f * 0x1p-24f, 0x0400},   // tie between 0x3ff and 0x400: the even one
      {1022.5f * 0x1p-24f, 0x03fe},   // tie between 0x3fe and 0x3ff: the even one
      {0x1p-24f, 0x0001},             // smallest subnormal
      {0x1p-25f, 0x0000},             // tie between 0 and 2^-24: to 0
      {1.5f * 0x1p-25f, 0x0001},      // past the tie
      {-0x1p-25f, 0x8000},            // the sign kept
      {0x1p-30f, 0x0000},             // flushed
      {-0.0f, 0x8000},                //
      {1.0f + 0x1p-11f, 0x3c00},      // tie between 1 and 1 + 2^-10: to 1 (even)
      {1.0f + 3 * 0x1p-11f, 0x3c02},  // tie between 1 + 2^-10 and 1 + 2^-9: up
  };
  std::vector<float> values;
  for (const auto& [value, bits] : cases) values.push_back(value);
  values.push_back(std::numeric_limits<float>::quiet_NaN());
  values.push_back(-std::numeric_limits<float>::signaling_NaN());
  const Tensor rounded = Tensor::from(values).to(DataType::kFloat16);
  const std::span<const Float16> out = rounded.span<Float16>();
  for (std::size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(out[i].bits, cases[i].second) << "case " << i << ": " << cases[i].first;
    EXPECT_EQ(out[i], to_float16(cases[i].first)) << "case " << i;
  }
  EXPECT_TRUE(is_nan_f16(out[cases.size()].bits));
  EXPECT_TRUE(is_nan_f16(out[cases.size() + 1].bits));
  EXPECT_EQ(out[cases.size() + 1].bits & 0x8000u, 0x8000u);  // a NaN keeps its sign
  EXPECT_EQ(out[cases.size() + 1], to_float16(values.back()));

  // And a sweep over all float32 exponents, to both types, against dp/float16.h.
  const Tensor sweep = Tensor::from(float_sweep());
  const Tensor to_f16 = sweep.to(DataType::kFloat16);
  const Tensor to_bf16 = sweep.to(DataType::kBFloat16);
  for (std::size_t i = 0; i < sweep.size(); ++i) {
    ASSERT_EQ(to_f16.span<Float16>()[i], to_float16(sweep[i])) << std::hex << bits_of(sweep)[i];
    ASSERT_EQ(to_bf16.span<BFloat16>()[i], to_bfloat16(sweep[i])) << i;
  }
}

TEST(TensorConvert, ConvertWritesIntoAViewAndChecksItsOperands) {
  Tensor source = Tensor::from(std::vector<float>{1.0f, 3.14159f, -2.0f, 1e-40f});
  Tensor halves({6}, DataType::kBFloat16);
  convert(source.view(), halves.view(1, 4));
  EXPECT_EQ(halves.span<BFloat16>()[0].bits, 0u);              // untouched
  EXPECT_EQ(halves.span<BFloat16>()[2].bits, 0x4049u);         // 3.140625
  EXPECT_EQ(halves.span<BFloat16>()[4], to_bfloat16(1e-40f));  // a float32 subnormal
  EXPECT_EQ(halves.span<BFloat16>()[5].bits, 0u);
  Tensor same({4});
  convert(source.view(), same.view());  // the same type: the elements as they are
  EXPECT_EQ(same[1], 3.14159f);
  EXPECT_EQ(source.to(DataType::kFloat32)[1], 3.14159f);

  const std::string sizes = message_of<Error>([&] { convert(source.view(), halves.view()); });
  EXPECT_TRUE(contains(sizes, "convert: the views hold 4 and 6 elements")) << sizes;
  const std::string type = message_of<Error>([&] { (void)source.to(DataType::kInt32); });
  EXPECT_TRUE(contains(type,
                       "Tensor::to of int32 elements: expected float32, bfloat16 or "
                       "float16"))
      << type;
}

TEST(TensorOps16, AddAndAxpyAccumulateASixteenBitXInFloat32) {
  CounterRng rng(7, 0);
  std::vector<float> x_values(1000);
  std::vector<float> y_values(1000);
  for (float& v : x_values) v = rng.uniform(-4.0f, 4.0f);
  for (float& v : y_values) v = rng.uniform(-4.0f, 4.0f);
  for (DataType type : {DataType::kBFloat16, DataType::kFloat16}) {
    const Tensor x = Tensor::from(x_values).to(type);
    const Tensor x_wide = x.to(DataType::kFloat32);  // exact
    Tensor y = Tensor::from(y_values);
    Tensor expected = Tensor::from(y_values);
    add(x.view(), y.view());
    add(x_wide.view(), expected.view());  // convert, then the float32 add: the same bits
    for (std::size_t i = 0; i < y.size(); ++i) {
      ASSERT_EQ(y[i], expected[i]) << to_string(type) << " add " << i;
      ASSERT_EQ(y[i], y_values[i] + x_wide[i]) << i;  // the loop of the comment
    }
    axpy(0.375f, x.view(), y.view());
    axpy(0.375f, x_wide.view(), expected.view());
    for (std::size_t i = 0; i < y.size(); ++i) ASSERT_EQ(y[i], expected[i]) << "axpy " << i;
  }
}

TEST(TensorOps16, FillAndAllFiniteTakeEveryType) {
  Tensor h({8}, DataType::kFloat16);
  fill(h.view(2, 3), 1e5f);  // rounded once: infinity
  EXPECT_EQ(h.span<Float16>()[1].bits, 0u);
  EXPECT_EQ(h.span<Float16>()[2].bits, 0x7c00u);
  EXPECT_EQ(h.span<Float16>()[4].bits, 0x7c00u);
  EXPECT_EQ(h.span<Float16>()[5].bits, 0u);
  EXPECT_FALSE(all_finite(h.view()));
  EXPECT_TRUE(all_finite(h.view(5, 3)));
  fill(h.view(), 65504.0f);  // the largest finite float16
  EXPECT_TRUE(all_finite(h.view()));
  h.span<Float16>()[7] = Float16{0x7e01};  // a NaN
  EXPECT_FALSE(all_finite(h.view()));

  Tensor b({4}, DataType::kBFloat16);
  b.span<BFloat16>()[3] = BFloat16{0x7f7f};  // the largest finite bfloat16
  EXPECT_TRUE(all_finite(b.view()));
  b.span<BFloat16>()[0] = BFloat16{0xff80};  // -infinity
  EXPECT_FALSE(all_finite(b.view()));
  EXPECT_TRUE(all_finite(b.view(1, 3)));
}

TEST(TensorOps16, OperationsGivenATypeTheyDoNotTakeSaySo) {
  Tensor f32({4});
  Tensor bf16({4}, DataType::kBFloat16);
  Tensor f16({4}, DataType::kFloat16);
  const std::string copied = message_of<Error>([&] { copy(bf16.view(), f32.view()); });
  EXPECT_TRUE(contains(copied,
                       "copy: the views hold bfloat16 and float32 elements; expected the "
                       "same type (dp::convert"))
      << copied;
  EXPECT_THROW(copy(bf16.view(), f16.view()), Error);
  const std::string into_16 = message_of<Error>([&] { add(f32.view(), bf16.view()); });
  EXPECT_TRUE(contains(into_16, "add: y holds bfloat16 elements (x float32); expected a float32 y"))
      << into_16;
  EXPECT_THROW(add(f16.view(), bf16.view()), Error);
  EXPECT_THROW(axpy(1.0f, f32.view(), f16.view()), Error);
  const std::string scaled = message_of<Error>([&] { scale(bf16.view(), 2.0f); });
  EXPECT_TRUE(contains(scaled, "scale: x holds bfloat16 elements; expected float32")) << scaled;
  EXPECT_THROW(divide(f16.view(), 2.0f), Error);
  const std::string dotted = message_of<Error>([&] { (void)dot(f32.view(), f16.view()); });
  EXPECT_TRUE(contains(dotted, "dot: y holds float16 elements; expected float32")) << dotted;
  EXPECT_THROW((void)norm(bf16.view()), Error);
  // Nothing was written by the refused calls.
  for (float value : f32.span()) EXPECT_EQ(value, 0.0f);
}

TEST(TensorOps16, ConversionsAndAdditionsCostTheirBytesOnTheSimulatedClock) {
  LaunchOptions options;
  options.simulation = SimulationOptions::preset("ib-ndr");
  launch(options, [&options](Communicator& comm) {
    const DeviceModel& device = options.simulation.device;
    constexpr std::size_t kElements = std::size_t{1} << 20;
    const Tensor x({static_cast<std::int64_t>(kElements)});
    Tensor y({static_cast<std::int64_t>(kElements)}, DataType::kBFloat16);
    const double start = comm.clock().now();
    convert(x.view(), y.view());  // reads 4 bytes and writes 2 per element
    const double after_convert = comm.clock().now();
    EXPECT_NEAR(after_convert - start,
                6.0 * kElements / device.bytes_per_second + device.launch_seconds, 1e-12);
    Tensor sum({static_cast<std::int64_t>(kElements)});
    add(y.view(), sum.view());  // reads 2 + 4 bytes and writes 4 per element
    EXPECT_NEAR(comm.clock().now() - after_convert,
                10.0 * kElements / device.bytes_per_second + device.launch_seconds, 1e-12);
  });
}

TEST(TensorConvert, TheEmulatedDeviceGivesTheHostsBits) {
  const std::vector<BFloat16> bf16_patterns = every_pattern<BFloat16>();
  const std::vector<Float16> f16_patterns = every_pattern<Float16>();
  const std::vector<float> sweep = float_sweep();
  const Tensor host_bf16 = Tensor::from(bf16_patterns);
  const Tensor host_f16 = Tensor::from(f16_patterns);
  const Tensor host_sweep = Tensor::from(sweep);
  set_cuda_device_emulated(true);
  {
    const Tensor device_bf16 = Tensor::from(bf16_patterns, MemoryCategory::kOther, Device::kCuda);
    const Tensor device_f16 = Tensor::from(f16_patterns, MemoryCategory::kOther, Device::kCuda);
    const Tensor device_sweep = Tensor::from(sweep, MemoryCategory::kOther, Device::kCuda);
    for (DataType to : {DataType::kFloat32, DataType::kBFloat16, DataType::kFloat16}) {
      for (const auto& [host, device] :
           {std::pair{&host_bf16, &device_bf16}, std::pair{&host_f16, &device_f16},
            std::pair{&host_sweep, &device_sweep}}) {
        const Tensor on_device = device->to(to);
        EXPECT_EQ(on_device.device(), Device::kCuda);
        EXPECT_EQ(on_device.dtype(), to);
        const Tensor from_device = on_device.to(Device::kHost);
        const Tensor on_host = host->to(to);
        ASSERT_EQ(from_device.bytes(), on_host.bytes());
        EXPECT_EQ(
            std::memcmp(from_device.view().raw_data(), on_host.view().raw_data(), on_host.bytes()),
            0)
            << to_string(host->dtype()) << " to " << to_string(to);
      }
    }
    // add, axpy and all_finite on the device, against the host's.
    Tensor device_y = Tensor::from(sweep, MemoryCategory::kOther, Device::kCuda);
    Tensor host_y = Tensor::from(sweep);
    const Tensor device_x = device_sweep.to(DataType::kFloat16);
    const Tensor host_x = host_sweep.to(DataType::kFloat16);
    add(device_x.view(), device_y.view());
    add(host_x.view(), host_y.view());
    axpy(-0.5f, device_x.view(), device_y.view());
    axpy(-0.5f, host_x.view(), host_y.view());
    const Tensor back = device_y.to(Device::kHost);
    EXPECT_EQ(std::memcmp(back.view().raw_data(), host_y.view().raw_data(), host_y.bytes()), 0);
    EXPECT_FALSE(all_finite(device_x.view()));              // the sweep holds infinities and NaNs
    EXPECT_TRUE(all_finite(device_bf16.view(0, 0x7f80)));   // +0 up to the largest finite
    EXPECT_FALSE(all_finite(device_bf16.view(0, 0x7f81)));  // and +infinity
    const std::string mixed =
        message_of<Error>([&] { convert(host_sweep.view(), device_y.view()); });
    EXPECT_TRUE(contains(mixed, "convert: the views live in host and cuda (emulated) memory"))
        << mixed;
  }
  set_cuda_device_emulated(false);
}

}  // namespace
}  // namespace dp
