// A tensor freed while a call in flight still reads or writes its memory is reported, naming
// the tensor and the call (comm/in_flight_buffers.h), in the eager and the adversarial
// completion modes alike; the caching allocator would otherwise hand the block to the next
// tensor and the call's late write would land there unseen. Memory freed after the call's
// wait, or after its Work is destroyed, is not reported.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "comm_test_support.h"
#include "dp/comm.h"
#include "dp/error.h"
#include "dp/launch.h"
#include "dp/tensor.h"
#include "test_support.h"

namespace dp {
namespace {

using testing::contains;
using testing::message_of;

constexpr int kWorld = 3;
constexpr std::int64_t kShard = 64;

class InFlightBuffers : public ::testing::TestWithParam<Completion> {
 protected:
  LaunchOptions options() const {
    LaunchOptions options = testing::test_launch(kWorld);
    options.comm.completion = GetParam();
    options.comm.completion_seed = 5;
    return options;
  }
};

/// Holds a reduce-scatter's Work and its buffers with the Work declared before the buffers,
/// so that the buffers are destroyed first: the escape of the lab 6 student trial.
struct WorkDeclaredBeforeItsBuffers {
  std::unique_ptr<Work> pending;
  Tensor in;
  Tensor out;

  explicit WorkDeclaredBeforeItsBuffers(Communicator& comm)
      : in({kShard * comm.size()}, MemoryCategory::kCommunication),
        out({kShard}, MemoryCategory::kGradients) {
    in.fill(1.0f);
    pending = comm.reduce_scatter(std::as_const(in).view(), out.view(), ReduceOp::kSum);
  }
};

/// The same with the Work declared after the buffers: it is destroyed, and so waited, first.
struct WorkDeclaredAfterItsBuffers {
  Tensor in;
  Tensor out;
  std::unique_ptr<Work> pending;

  explicit WorkDeclaredAfterItsBuffers(Communicator& comm)
      : in({kShard * comm.size()}, MemoryCategory::kCommunication),
        out({kShard}, MemoryCategory::kGradients) {
    in.fill(1.0f);
    pending = comm.reduce_scatter(std::as_const(in).view(), out.view(), ReduceOp::kSum);
  }
};

TEST_P(InFlightBuffers, AnInputFreedBeforeTheWaitIsReportedByTheWait) {
  std::vector<std::string> messages(kWorld);
  launch(options(), [&](Communicator& comm) {
    Tensor in({kShard * comm.size()}, MemoryCategory::kCommunication);
    Tensor out({kShard}, MemoryCategory::kGradients);
    auto work = comm.reduce_scatter(std::as_const(in).view(), out.view(), ReduceOp::kSum);
    in = Tensor();  // freed under the call
    messages[static_cast<std::size_t>(comm.rank())] = message_of<Error>([&] { work->wait(); });
  });
  for (const std::string& message : messages) {
    EXPECT_TRUE(contains(message,
                         "reduce_scatter (its call #1: 192 float32 in, 64 out): the "
                         "memory of its input buffer was freed while the call was in "
                         "flight: a tensor of communication, shape (192)"))
        << message;
    EXPECT_TRUE(contains(message, "expected every buffer to outlive its call")) << message;
  }
}

TEST_P(InFlightBuffers, AWorkDestroyedAfterItsBuffersIsReportedAtTheNextCall) {
  std::vector<std::string> messages(kWorld);
  launch(options(), [&](Communicator& comm) {
    std::optional<WorkDeclaredBeforeItsBuffers> state(std::in_place, comm);
    state.reset();  // out, then in, then the Work: both buffers die under the call
    messages[static_cast<std::size_t>(comm.rank())] = message_of<Error>([&] { comm.barrier(); });
    comm.barrier();  // reported once
  });
  for (const std::string& message : messages) {
    EXPECT_TRUE(contains(message,
                         "reduce_scatter (its call #1: 192 float32 in, 64 out): the "
                         "memory of its output buffer was freed while the call was in "
                         "flight: a tensor of gradients, shape (64)"))
        << message;
    EXPECT_TRUE(contains(message, "found when its Work was destroyed without wait()")) << message;
  }
}

TEST_P(InFlightBuffers, AWorkDestroyedAfterItsBuffersLastIsReportedByLaunch) {
  const std::string message = message_of<Error>([&] {
    launch(options(), [](Communicator& comm) { WorkDeclaredBeforeItsBuffers state(comm); });
  });
  EXPECT_TRUE(contains(message,
                       "the memory of its output buffer was freed while the call was "
                       "in flight: a tensor of gradients"))
      << message;
}

TEST_P(InFlightBuffers, AHeldBlockGoesToNoOtherTensorUntilTheCallCompletes) {
  launch(options(), [&](Communicator& comm) {
    Tensor in({kShard * comm.size()}, MemoryCategory::kCommunication);
    Tensor out({kShard}, MemoryCategory::kGradients);
    auto work = comm.reduce_scatter(std::as_const(in).view(), out.view(), ReduceOp::kSum);
    const float* freed = std::as_const(out).view().data();
    out = Tensor();
    // The allocator hands out the last block of a size class it got back: not this one.
    const Tensor next({kShard}, MemoryCategory::kGradients);
    EXPECT_NE(next.view().data(), freed);
    EXPECT_THROW(work->wait(), Error);
  });
}

TEST_P(InFlightBuffers, BuffersFreedAfterTheWaitOrAfterTheWorkAreNotReported) {
  launch(options(), [&](Communicator& comm) {
    {
      Tensor in({kShard * comm.size()}, MemoryCategory::kCommunication);
      Tensor out({kShard}, MemoryCategory::kGradients);
      auto work = comm.reduce_scatter(std::as_const(in).view(), out.view(), ReduceOp::kSum);
      work->wait();
      out = Tensor();
      in = Tensor();
    }
    { WorkDeclaredAfterItsBuffers state(comm); }
    {
      // A tensor of no call, freed while a call is in flight, goes back at once.
      Tensor data({kShard}, MemoryCategory::kCommunication);
      auto work = comm.allreduce(data.view(), ReduceOp::kSum);
      Tensor unrelated({kShard}, MemoryCategory::kActivations);
      const float* freed = std::as_const(unrelated).view().data();
      unrelated = Tensor();
      const Tensor next({kShard}, MemoryCategory::kActivations);
      EXPECT_EQ(next.view().data(), freed);
      work->wait();
    }
    comm.barrier();  // nothing deferred
  });
}

INSTANTIATE_TEST_SUITE_P(EagerAndAdversarial, InFlightBuffers,
                         ::testing::Values(Completion::kEager, Completion::kAdversarial),
                         [](const auto& test_case) {
                           return test_case.param == Completion::kEager ? "Eager" : "Adversarial";
                         });

}  // namespace
}  // namespace dp
