// What is particular to the mpi backend: launches over part of the job, errors every rank
// raises, transfers that progress while the rank computes, counters equal to the local
// backend's, and MPI's rules (tags, aliasing). Runs under mpiexec (dp_mpi_tests): every
// process runs every test, and a process that sits a launch out checks that it did.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <numeric>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "dp/comm.h"
#include "dp/error.h"
#include "dp/launch.h"

namespace dp {
namespace {

using std::chrono::milliseconds;

LaunchOptions on_mpi(int world_size) {
  LaunchOptions options;
  options.world_size = world_size;
  options.backend = Backend::kMpi;
  return options;
}

bool takes_part(int world_size) {
  return mpi_world_rank() < world_size;
}

/// Runs a launch that must fail with a `dp::CommError` on its ranks; returns the message
/// (empty on processes that sat it out, which must not throw).
std::string comm_error_of(int world_size, const std::function<void(Communicator&)>& rank_main) {
  try {
    launch(on_mpi(world_size), rank_main);
  } catch (const CommError& e) {
    EXPECT_TRUE(takes_part(world_size)) << "a process outside the launch threw";
    return e.what();
  }
  EXPECT_FALSE(takes_part(world_size)) << "expected a dp::CommError on every rank";
  return "";
}

TEST(MpiBackend, ProcessesPastTheWorldSizeSitTheLaunchOut) {
  for (int p = 1; p <= mpi_world_size(); ++p) {
    int calls = 0;
    launch(on_mpi(p), [&](Communicator& comm) {
      ++calls;
      EXPECT_EQ(comm.size(), p);
      EXPECT_EQ(comm.rank(), mpi_world_rank());
      EXPECT_EQ(comm.backend(), "mpi");
    });
    EXPECT_EQ(calls, takes_part(p) ? 1 : 0) << "world size " << p;
  }
}

TEST(MpiBackend, WorldSizeLargerThanTheJobIsRejectedWithBothNumbers) {
  const int too_many = mpi_world_size() + 1;
  try {
    launch(on_mpi(too_many), [](Communicator&) {});
    FAIL() << "expected a dp::Error";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(fmt::format("world_size={}", too_many)), std::string::npos) << message;
    EXPECT_NE(message.find(fmt::format("only {} MPI processes", mpi_world_size())),
              std::string::npos)
        << message;
    EXPECT_NE(message.find(fmt::format("dplab run -n {}", too_many)), std::string::npos) << message;
  }
}

TEST(MpiBackend, MismatchedSizesFailOnEveryRankAndSoDoLaterCollectives) {
  const int p = std::min(3, mpi_world_size());
  if (p < 2) GTEST_FAIL() << "needs at least 2 processes, got " << mpi_world_size();
  bool later_call_failed = false;
  const std::string message = comm_error_of(p, [&](Communicator& comm) {
    std::vector<float> data(comm.rank() == 1 ? 512 : 1024);
    try {
      comm.allreduce(std::span(data), ReduceOp::kSum)->wait();
    } catch (const CommError&) {
      // The ranks are out of step now: nothing later may run.
      std::vector<float> matching(8);
      try {
        comm.allreduce(std::span(matching), ReduceOp::kSum)->wait();
      } catch (const CommError& later) {
        later_call_failed =
            std::string(later.what()).find("earlier one failed") != std::string::npos;
      }
      throw;
    }
  });
  if (!takes_part(p)) return;
  EXPECT_TRUE(later_call_failed);
  EXPECT_NE(message.find("collective #0 does not match across ranks"), std::string::npos)
      << message;
  const std::string others = p == 3 ? "ranks 0, 2" : "rank 0";
  EXPECT_NE(message.find(others + " called allreduce(count=1024 float32, op=sum)"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("rank 1 called allreduce(count=512 float32, op=sum)"), std::string::npos)
      << message;
}

TEST(MpiBackend, MismatchedRootsAndKindsAreNamed) {
  const std::string roots = comm_error_of(2, [](Communicator& comm) {
    std::vector<float> data(8);
    comm.broadcast(std::span(data), comm.rank())->wait();
  });
  if (takes_part(2)) {
    EXPECT_NE(roots.find("rank 0 called broadcast(count=8 float32, root=0); rank 1 called "
                         "broadcast(count=8 float32, root=1)"),
              std::string::npos)
        << roots;
  }
  const std::string kinds = comm_error_of(2, [](Communicator& comm) {
    std::vector<float> data(8);
    comm.allreduce(std::span(data), ReduceOp::kSum)->wait();  // matches
    if (comm.rank() == 0)
      comm.barrier();
    else
      comm.allreduce(std::span(data), ReduceOp::kMax)->wait();
  });
  if (takes_part(2)) {
    EXPECT_NE(kinds.find("collective #1 does not match"), std::string::npos) << kinds;
    EXPECT_NE(kinds.find("rank 0 called barrier()"), std::string::npos) << kinds;
    EXPECT_NE(kinds.find("rank 1 called allreduce(count=8 float32, op=max)"), std::string::npos)
        << kinds;
  }
}

TEST(MpiBackend, AnErrorEveryRankRaisesPropagatesAndTheNextLaunchWorks) {
  const int p = mpi_world_size();
  try {
    launch(on_mpi(p), [](Communicator&) { throw Error("gives up"); });
    FAIL() << "expected a dp::Error";
  } catch (const Error& e) {
    // launch names the rank that raised it.
    EXPECT_EQ(std::string(e.what()), fmt::format("rank {}: gives up", mpi_world_rank()));
    EXPECT_EQ(e.rank(), mpi_world_rank());
  }
  launch(on_mpi(p), [&](Communicator& comm) {
    std::vector<std::int32_t> one(1, 1);
    comm.allreduce(std::span(one), ReduceOp::kSum)->wait();
    EXPECT_EQ(one[0], p);
  });
}

TEST(MpiBackend, LargeTransfersProgressWhileTheRankComputes) {
  // Without a thread that calls into MPI, neither transfer would move during the sleep:
  // the 4 MiB message needs a rendezvous, and the all-reduce many rounds.
  launch(on_mpi(2), [](Communicator& comm) {
    constexpr std::size_t kCount = 1 << 20;
    std::vector<float> message(kCount, static_cast<float>(comm.rank() + 1));
    std::vector<float> reduced(4 * kCount, 1.0f);
    auto transfer = comm.rank() == 0 ? comm.isend(std::span<const float>(message), 1, 0)
                                     : comm.irecv(std::span(message), 0, 0);
    auto reduction = comm.allreduce(std::span(reduced), ReduceOp::kSum);
    std::this_thread::sleep_for(milliseconds(1500));  // "compute" without calling dplab
    EXPECT_TRUE(transfer->test()) << "the point-to-point transfer stalled";
    EXPECT_TRUE(reduction->test()) << "the all-reduce stalled";
    transfer->wait();
    reduction->wait();
    EXPECT_EQ(message[kCount - 1], 1.0f);
    EXPECT_EQ(reduced[4 * kCount - 1], 2.0f);
  });
}

TEST(MpiBackend, ManyMiBInFlightWaitedInReverseWithARingBesideThem) {
  const int p = mpi_world_size();
  launch(on_mpi(p), [&](Communicator& comm) {
    const std::vector<std::size_t> sizes = {3 << 20, 1, 0, 1009, 1 << 20};
    std::vector<std::vector<float>> buffers;
    for (std::size_t count : sizes) buffers.emplace_back(count, 1.0f + comm.rank());
    std::vector<std::unique_ptr<Work>> works;
    for (auto& buffer : buffers) works.push_back(comm.allreduce(std::span(buffer), ReduceOp::kSum));
    const int right = (comm.rank() + 1) % p;
    const int left = (comm.rank() + p - 1) % p;
    std::vector<float> outgoing(1 << 20, static_cast<float>(comm.rank()));
    std::vector<float> incoming(1 << 20, -1.0f);
    auto recv = comm.irecv(std::span(incoming), left, 11);
    auto send = comm.isend(std::span<const float>(outgoing), right, 11);
    for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->wait();
    recv->wait();
    send->wait();
    const float rank_sum = static_cast<float>(p * (p + 1) / 2);
    for (const auto& buffer : buffers)
      for (float value : buffer) ASSERT_EQ(value, rank_sum);
    for (float value : incoming) ASSERT_EQ(value, static_cast<float>(left));
  });
}

TEST(MpiBackend, PointToPointSizeMismatchIsReportedByTheReceiver) {
  launch(on_mpi(2), [](Communicator& comm) {
    // Shorter than the receive: MPI delivers it and the receiver sees the size.
    std::vector<float> short_message(10), long_receive(12);
    if (comm.rank() == 0) {
      comm.isend(std::span<const float>(short_message), 1, 3)->wait();
    } else {
      try {
        comm.irecv(std::span(long_receive), 0, 3)->wait();
        ADD_FAILURE() << "expected a dp::CommError";
      } catch (const CommError& e) {
        EXPECT_NE(std::string(e.what()).find("rank 0 sent 10 float32 with tag 3 to rank 1, "
                                             "which posted a receive of 12 float32"),
                  std::string::npos)
            << e.what();
      }
    }
    // Longer than the receive: MPI truncates, the receiver fails.
    std::vector<float> long_message(12), short_receive(10);
    if (comm.rank() == 0) {
      comm.isend(std::span<const float>(long_message), 1, 4)->wait();
    } else {
      try {
        comm.irecv(std::span(short_receive), 0, 4)->wait();
        ADD_FAILURE() << "expected a dp::CommError";
      } catch (const CommError& e) {
        EXPECT_NE(std::string(e.what()).find("rank 0 sent more than 10 float32 with tag 4"),
                  std::string::npos)
            << e.what();
      }
    }
  });
}

TEST(MpiBackend, TagsOutsideMpisRangeAreRejected) {
  launch(on_mpi(2), [](Communicator& comm) {
    std::vector<float> data(4);
    EXPECT_THROW(comm.isend(std::span<const float>(data), 1 - comm.rank(), -1), Error);
    EXPECT_THROW(comm.irecv(std::span(data), 1 - comm.rank(), -5), Error);
  });
}

// The mpi backend takes host buffers only (see mpi_backend.cpp): a buffer marked as device
// memory fails at the call, on the rank that passed it, before MPI reads it (the pointer is
// host memory here, so a read would not crash: the test would see it as a wrong result).
TEST(MpiBackend, DeviceBuffersAreRefusedAtTheCallWithTheDevicesNamed) {
  launch(on_mpi(2), [](Communicator& comm) {
    std::vector<float> values(8, 1.0f);
    const MutableBuffer device{values.data(), values.size(), DataType::kFloat32, Device::kCuda};
    const MutableBuffer half{values.data(), 4, DataType::kFloat32, Device::kCuda};
    const std::vector<std::function<void()>> calls = {
        [&] { comm.allreduce(device, ReduceOp::kSum); },
        [&] { comm.reduce_scatter(device, half, ReduceOp::kSum); },
        [&] { comm.allgather(half, device); },
        [&] { comm.broadcast(device, 0); },
        [&] { comm.isend(device, 1 - comm.rank(), 0); },
        [&] { comm.irecv(device, 1 - comm.rank(), 0); },
    };
    for (const auto& call : calls) {
      try {
        call();
        ADD_FAILURE() << "expected a dp::Error for a device buffer on the mpi backend";
      } catch (const CommError& error) {
        ADD_FAILURE() << "expected a dp::Error at the call, got a CommError: " << error.what();
      } catch (const Error& error) {
        EXPECT_NE(std::string(error.what())
                      .find("on the mpi backend: expected a buffer in host memory, got one in cuda "
                            "memory"),
                  std::string::npos)
            << error.what();
      }
    }
    EXPECT_EQ(values, std::vector<float>(8, 1.0f));
    comm.barrier();  // nothing was issued: the ranks still agree
  });
}

TEST(MpiBackend, AllGatherInPlaceAndReduceScatterAverageOfInt32) {
  const int p = mpi_world_size();
  launch(on_mpi(p), [&](Communicator& comm) {
    // ZeRO's pattern: each rank's shard already sits in its slot of the full buffer.
    constexpr std::size_t kShard = 1000;
    const auto slot = static_cast<std::size_t>(comm.rank()) * kShard;
    std::vector<float> full(kShard * static_cast<std::size_t>(p), -1.0f);
    for (std::size_t k = 0; k < kShard; ++k) full[slot + k] = static_cast<float>(comm.rank());
    comm.allgather(std::span<const float>(full).subspan(slot, kShard), std::span(full))->wait();
    for (int r = 0; r < p; ++r)
      ASSERT_EQ(full[static_cast<std::size_t>(r) * kShard + kShard - 1], static_cast<float>(r));

    std::vector<std::int32_t> in(kShard * static_cast<std::size_t>(p), comm.rank() + 1);
    std::vector<std::int32_t> out(kShard);
    comm.reduce_scatter(std::span<const std::int32_t>(in), std::span(out), ReduceOp::kAvg)->wait();
    for (std::int32_t value : out) ASSERT_EQ(value, (p * (p + 1) / 2) / p);
  });
}

TEST(MpiBackend, ValidationCanBeSwitchedOff) {
  LaunchOptions options = on_mpi(mpi_world_size());
  options.comm.validate_collectives = false;
  launch(options, [&](Communicator& comm) {
    std::vector<float> data(1009, 1.0f);
    comm.allreduce(std::span(data), ReduceOp::kAvg)->wait();
    EXPECT_EQ(data[1008], 1.0f);
  });
}

/// A fixed sequence of every kind of call, whose counters both backends must agree on.
void exercise_every_call(Communicator& comm) {
  const int p = comm.size();
  std::vector<float> values(1009, 1.0f), one(1, 1.0f), none;
  comm.allreduce(std::span(values), ReduceOp::kSum)->wait();
  comm.allreduce(std::span(one), ReduceOp::kMax)->wait();
  comm.allreduce(std::span(none), ReduceOp::kSum)->wait();
  std::vector<float> shard(3), full(3 * static_cast<std::size_t>(p), 1.0f);
  comm.reduce_scatter(std::span<const float>(full), std::span(shard), ReduceOp::kAvg)->wait();
  comm.allgather(std::span<const float>(shard), std::span(full))->wait();
  std::vector<std::int32_t> seven(7, comm.rank());
  comm.broadcast(std::span(seven), p - 1)->wait();
  comm.barrier();
  if (p > 1) {
    std::vector<float> outgoing(100), incoming(100);
    auto send = comm.isend(std::span<const float>(outgoing), (comm.rank() + 1) % p, 2);
    comm.irecv(std::span(incoming), (comm.rank() + p - 1) % p, 2)->wait();
    send->wait();
  }
}

void expect_same_counters(const CommCounters& mpi, const CommCounters& local, int p) {
  for (std::size_t op = 0; op < kNumCommOps; ++op) {
    const auto name = to_string(static_cast<CommOp>(op));
    EXPECT_EQ(mpi.per_op[op].calls, local.per_op[op].calls) << name << " at p=" << p;
    EXPECT_EQ(mpi.per_op[op].bytes_sent, local.per_op[op].bytes_sent) << name << " at p=" << p;
    EXPECT_EQ(mpi.per_op[op].bytes_received, local.per_op[op].bytes_received)
        << name << " at p=" << p;
    EXPECT_EQ(mpi.per_op[op].messages_sent, local.per_op[op].messages_sent)
        << name << " at p=" << p;
    EXPECT_EQ(mpi.per_op[op].messages_received, local.per_op[op].messages_received)
        << name << " at p=" << p;
  }
  EXPECT_EQ(mpi.bytes_sent_to, local.bytes_sent_to) << "p=" << p;
  EXPECT_EQ(mpi.bytes_received_from, local.bytes_received_from) << "p=" << p;
}

TEST(MpiBackend, CountersEqualTheLocalBackendsAtEveryWorldSize) {
  for (int p = 1; p <= mpi_world_size(); ++p) {
    std::vector<CommCounters> local(static_cast<std::size_t>(p));
    LaunchOptions threads;
    threads.world_size = p;
    launch(threads, [&](Communicator& comm) {
      exercise_every_call(comm);
      local[comm.rank()] = comm.counters();
    });
    launch(on_mpi(p), [&](Communicator& comm) {
      exercise_every_call(comm);
      expect_same_counters(comm.counters(), local[comm.rank()], p);
      // A snapshot subtracted from itself is empty: since() is how callers count a span.
      const CommCounters now = comm.counters();
      EXPECT_EQ(now.since(now).total_bytes_sent(), 0u);
      EXPECT_EQ(now.since(now).total_calls(), 0u);
    });
  }
}

}  // namespace
}  // namespace dp
