// Views of tensors and the element-wise operations on them: exact results in index order,
// bounds and size checks with clear errors, and one compute op each on the simulated clock.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "dp/clock.h"
#include "dp/error.h"
#include "dp/launch.h"
#include "dp/tensor.h"
#include "dp/tensor_ops.h"
#include "test_support.h"

namespace dp {
namespace {

using testing::message_of;

Tensor iota(std::size_t n, float start = 1.0f) {
  Tensor t({static_cast<std::int64_t>(n)});
  for (std::size_t i = 0; i < n; ++i) t[i] = start + static_cast<float>(i);
  return t;
}

TEST(TensorView, SlicesNameRangesOfTheTensor) {
  Tensor t = iota(10);
  TensorView middle = t.view(3, 4);
  EXPECT_EQ(middle.size(), 4u);
  EXPECT_EQ(middle.data(), t.data() + 3);
  EXPECT_EQ(middle.slice(1, 2).data(), t.data() + 4);
  EXPECT_EQ(middle.host_span()[0], 4.0f);
  EXPECT_TRUE(t.view(10, 0).empty());
  const MutableBuffer buffer = middle;  // views go straight to the communicator
  EXPECT_EQ(buffer.count, 4u);
  EXPECT_EQ(buffer.data, t.data() + 3);
}

TEST(TensorView, ARangePastTheEndIsAnErrorThatSaysSo) {
  Tensor t = iota(10);
  const std::string message = message_of<Error>([&] { t.view(8, 3); });
  EXPECT_NE(message.find("Tensor::view(offset 8, count 3)"), std::string::npos) << message;
  EXPECT_NE(message.find("[8, 8 + 3)"), std::string::npos) << message;
  EXPECT_NE(message.find("10 elements"), std::string::npos) << message;
  const std::string sliced = message_of<Error>([&] { t.view(0, 0).slice(0, 1); });
  EXPECT_NE(sliced.find("TensorView::slice(offset 0, count 1) of 0 elements"), std::string::npos)
      << sliced;
  // An offset so large that offset + count wraps around must not pass.
  EXPECT_THROW(t.view(std::numeric_limits<std::size_t>::max(), 2), Error);
}

TEST(TensorOps, EachOperationComputesWhatItsCommentSays) {
  Tensor x = iota(5);         // 1 2 3 4 5
  Tensor y = iota(5, 10.0f);  // 10 11 12 13 14
  add(x.view(), y.view());
  EXPECT_EQ(y[0], 11.0f);
  EXPECT_EQ(y[4], 19.0f);
  axpy(2.0f, x.view(), y.view());
  EXPECT_EQ(y[4], 29.0f);
  scale(y.view(), 0.5f);
  EXPECT_EQ(y[4], 14.5f);
  divide(y.view(2, 3), 2.0f);  // only elements 2..4
  EXPECT_EQ(y[1], 0.5f * (13.0f + 4.0f));
  EXPECT_EQ(y[4], 7.25f);
  copy(x.view(0, 2), y.view(3, 2));
  EXPECT_EQ(y[3], 1.0f);
  EXPECT_EQ(y[4], 2.0f);
  fill(y.view(), -1.0f);
  EXPECT_EQ(y[2], -1.0f);
  EXPECT_DOUBLE_EQ(dot(x.view(), x.view()), 55.0);
  EXPECT_DOUBLE_EQ(norm(x.view()), std::sqrt(55.0));
  EXPECT_TRUE(all_finite(x.view()));
  x[2] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(all_finite(x.view()));
}

TEST(TensorOps, DivideIsNotAMultiplicationByTheReciprocal) {
  // 1/3 is not a float: x / 3 and x * (1/3) differ in the last bit for some x. Labs that
  // promise a division must get exactly the division.
  Tensor divided = iota(1000, 0.1f);
  Tensor scaled = iota(1000, 0.1f);
  divide(divided.view(), 3.0f);
  scale(scaled.view(), 1.0f / 3.0f);
  int differences = 0;
  for (std::size_t i = 0; i < divided.size(); ++i) {
    EXPECT_EQ(divided[i], (0.1f + static_cast<float>(i)) / 3.0f);
    differences += divided[i] != scaled[i] ? 1 : 0;
  }
  EXPECT_GT(differences, 0);
}

TEST(TensorOps, SizeMismatchesAreErrorsThatNameBothSizes) {
  Tensor a = iota(4);
  Tensor b = iota(5);
  for (const std::string& message : {message_of<Error>([&] { copy(a.view(), b.view()); }),
                                     message_of<Error>([&] { add(a.view(), b.view()); }),
                                     message_of<Error>([&] { axpy(1.0f, a.view(), b.view()); }),
                                     message_of<Error>([&] { dot(a.view(), b.view()); })}) {
    EXPECT_NE(message.find("4 and 5 elements"), std::string::npos) << message;
  }
}

TEST(TensorOps, EveryOperationIsOneComputeOpOnTheSimulatedClock) {
  LaunchOptions options;
  options.simulation = SimulationOptions::preset("ib-ndr");
  launch(options, [&options](Communicator& comm) {
    Tensor x = iota(1 << 20);
    Tensor y = iota(1 << 20);
    const double start = comm.clock().now();
    copy(x.view(), y.view());
    const double after_copy = comm.clock().now();
    // A copy reads and writes 4 MiB each: bytes / bandwidth plus the launch cost.
    const DeviceModel& device = options.simulation.device;
    const double expected = 8.0 * (1 << 20) / device.bytes_per_second + device.launch_seconds;
    EXPECT_NEAR(after_copy - start, expected, 1e-12);
    divide(y.view(), 2.0f);
    EXPECT_GT(comm.clock().now(), after_copy);
    const RankTrace trace = comm.clock().trace();
    bool saw_copy = false;
    for (const TraceEvent& event : trace.events) saw_copy = saw_copy || event.name == "copy";
    EXPECT_TRUE(saw_copy) << "the copy is missing from the trace";
  });
}

}  // namespace
}  // namespace dp
