// Every collective and point-to-point pattern at world sizes 1 to 5 and sizes 0, 1, a
// prime and several MiB, on the backend DPLAB_TEST_BACKEND names. Values are small
// integers, so float sums are exact and results can be compared with ==.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "comm_test_support.h"
#include "dp/comm.h"
#include "dp/error.h"
#include "dp/launch.h"
#include "test_support.h"

namespace dp {
namespace {

using testing::message_of;
using testing::test_launch;

// 0, 1, a prime, and 8 MiB of float32 plus a few elements (so chunks are uneven).
// Empty, one element, eager calls of one piece and of several (shards crossing pieces),
// and a call for the communication threads.
const std::vector<std::size_t> kCounts = {0, 1, 1009, 5003, 2 * 1024 * 1024 + 3};

float value_of(int rank, std::size_t index) {
  return static_cast<float>((rank + 1) * static_cast<int>(index % 7 + 1));
}

std::vector<float> rank_values(int rank, std::size_t count) {
  std::vector<float> values(count);
  for (std::size_t k = 0; k < count; ++k) values[k] = value_of(rank, k);
  return values;
}

class CollectiveTest : public ::testing::TestWithParam<int> {};

TEST_P(CollectiveTest, AllReduceSumAvgMax) {
  const int p = GetParam();
  for (std::size_t count : kCounts) {
    launch(test_launch(p), [&](Communicator& comm) {
      const float rank_sum = static_cast<float>(p * (p + 1) / 2);
      auto sum = rank_values(comm.rank(), count);
      auto avg = sum;
      auto max = sum;
      comm.allreduce(std::span(sum), ReduceOp::kSum)->wait();
      comm.allreduce(std::span(avg), ReduceOp::kAvg)->wait();
      comm.allreduce(std::span(max), ReduceOp::kMax)->wait();
      for (std::size_t k = 0; k < count; ++k) {
        const float unit = static_cast<float>(k % 7 + 1);
        ASSERT_EQ(sum[k], rank_sum * unit) << "count " << count << " index " << k;
        ASSERT_EQ(avg[k], rank_sum * unit / static_cast<float>(p)) << "index " << k;
        ASSERT_EQ(max[k], static_cast<float>(p) * unit) << "index " << k;
      }
    });
  }
}

TEST_P(CollectiveTest, AllReduceInt32) {
  const int p = GetParam();
  launch(test_launch(p), [&](Communicator& comm) {
    std::vector<std::int32_t> values(1009, comm.rank() + 1);
    comm.allreduce(std::span(values), ReduceOp::kSum)->wait();
    for (std::int32_t v : values) ASSERT_EQ(v, p * (p + 1) / 2);
  });
}

TEST_P(CollectiveTest, ReduceScatter) {
  const int p = GetParam();
  for (std::size_t shard : kCounts) {
    launch(test_launch(p), [&](Communicator& comm) {
      const std::size_t total = shard * static_cast<std::size_t>(p);
      auto in = rank_values(comm.rank(), total);
      std::vector<float> out(shard, -1.0f);
      comm.reduce_scatter(std::span<const float>(in), std::span(out), ReduceOp::kSum)->wait();
      const float rank_sum = static_cast<float>(p * (p + 1) / 2);
      for (std::size_t k = 0; k < shard; ++k) {
        const std::size_t global = static_cast<std::size_t>(comm.rank()) * shard + k;
        ASSERT_EQ(out[k], rank_sum * static_cast<float>(global % 7 + 1)) << "index " << k;
      }
    });
  }
}

TEST_P(CollectiveTest, AllGather) {
  const int p = GetParam();
  for (std::size_t shard : kCounts) {
    launch(test_launch(p), [&](Communicator& comm) {
      auto in = rank_values(comm.rank(), shard);
      std::vector<float> out(shard * static_cast<std::size_t>(p), -1.0f);
      comm.allgather(std::span<const float>(in), std::span(out))->wait();
      for (int r = 0; r < p; ++r)
        for (std::size_t k = 0; k < shard; ++k)
          ASSERT_EQ(out[static_cast<std::size_t>(r) * shard + k], value_of(r, k))
              << "from rank " << r << " index " << k;
    });
  }
}

TEST_P(CollectiveTest, BroadcastFromEveryRoot) {
  const int p = GetParam();
  for (std::size_t count : kCounts) {
    for (int root = 0; root < p; ++root) {
      launch(test_launch(p), [&](Communicator& comm) {
        auto data = rank_values(comm.rank(), count);
        comm.broadcast(std::span(data), root)->wait();
        for (std::size_t k = 0; k < count; ++k)
          ASSERT_EQ(data[k], value_of(root, k)) << "root " << root << " index " << k;
      });
    }
  }
}

TEST_P(CollectiveTest, RingExchangeWithPointToPoint) {
  const int p = GetParam();
  for (std::size_t count : kCounts) {
    launch(test_launch(p), [&](Communicator& comm) {
      const int right = (comm.rank() + 1) % p;
      const int left = (comm.rank() + p - 1) % p;
      auto outgoing = rank_values(comm.rank(), count);
      std::vector<float> incoming(count, -1.0f);
      // Receive posted after the send on even ranks and before it on odd ones.
      std::unique_ptr<Work> send;
      std::unique_ptr<Work> recv;
      if (comm.rank() % 2 == 0) {
        send = comm.isend(std::span<const float>(outgoing), right, 7);
        recv = comm.irecv(std::span(incoming), left, 7);
      } else {
        recv = comm.irecv(std::span(incoming), left, 7);
        send = comm.isend(std::span<const float>(outgoing), right, 7);
      }
      recv->wait();
      send->wait();
      for (std::size_t k = 0; k < count; ++k) ASSERT_EQ(incoming[k], value_of(left, k));
    });
  }
}

TEST_P(CollectiveTest, TagsKeepMessagesApart) {
  const int p = GetParam();
  if (p < 2) return;  // needs a peer; world size 1 has none to talk to
  launch(test_launch(p), [&](Communicator& comm) {
    if (comm.rank() == 0) {
      std::vector<float> a(16, 1.0f), b(16, 2.0f);
      auto first = comm.isend(std::span<const float>(a), 1, /*tag=*/1);
      auto second = comm.isend(std::span<const float>(b), 1, /*tag=*/2);
      first->wait();
      second->wait();
    } else if (comm.rank() == 1) {
      std::vector<float> got_b(16), got_a(16);
      auto recv_b = comm.irecv(std::span(got_b), 0, /*tag=*/2);
      auto recv_a = comm.irecv(std::span(got_a), 0, /*tag=*/1);
      recv_b->wait();
      recv_a->wait();
      EXPECT_EQ(got_a[0], 1.0f);
      EXPECT_EQ(got_b[0], 2.0f);
    }
  });
}

TEST_P(CollectiveTest, AsyncCallsInFlightWaitedInReverse) {
  const int p = GetParam();
  launch(test_launch(p), [&](Communicator& comm) {
    auto reduced = rank_values(comm.rank(), 1009);
    auto shard = rank_values(comm.rank(), 64);
    std::vector<float> gathered(64 * static_cast<std::size_t>(p));
    auto broadcasted = rank_values(comm.rank(), 33);
    auto first = comm.allreduce(std::span(reduced), ReduceOp::kSum);
    auto second = comm.allgather(std::span<const float>(shard), std::span(gathered));
    auto third = comm.broadcast(std::span(broadcasted), p - 1);
    third->wait();
    while (!second->test()) {
    }
    second->wait();
    first->wait();
    EXPECT_TRUE(first->test());
    const float rank_sum = static_cast<float>(p * (p + 1) / 2);
    EXPECT_EQ(reduced[5], rank_sum * 6.0f);
    EXPECT_EQ(gathered[64 * static_cast<std::size_t>(p - 1)], value_of(p - 1, 0));
    EXPECT_EQ(broadcasted[32], value_of(p - 1, 32));
  });
}

TEST_P(CollectiveTest, ManyCallsInFlightFromRanksOutOfStep) {
  // More collectives in flight than the local backend's rendezvous ring holds (1024), the
  // ranks issuing them out of step, small ones (run by the last rank to arrive) mixed with
  // large ones (run by the communication threads); waited for in reverse. On mpi the same
  // calls are as many nonblocking MPI collectives in flight.
  const int p = GetParam();
  constexpr std::size_t kCalls = 2500;
  launch(test_launch(p), [&](Communicator& comm) {
    std::vector<std::vector<float>> buffers(kCalls);
    std::vector<std::unique_ptr<Work>> works;
    for (std::size_t i = 0; i < kCalls; ++i) {
      buffers[i] = rank_values(comm.rank(), i % 500 == 7 ? 300000 : i % 13);
      works.push_back(comm.allreduce(std::span(buffers[i]), ReduceOp::kSum));
      if (comm.rank() == 0 && i % 100 == 0) std::this_thread::yield();
    }
    while (!works.empty()) {
      works.back()->wait();
      works.pop_back();
    }
    const float rank_sum = static_cast<float>(p * (p + 1) / 2);
    for (std::size_t i = 0; i < kCalls; ++i)
      for (std::size_t k = 0; k < buffers[i].size(); ++k)
        ASSERT_EQ(buffers[i][k], rank_sum * static_cast<float>(k % 7 + 1)) << i << " " << k;
  });
}

TEST_P(CollectiveTest, BarrierOrdersSideEffects) {
  const int p = GetParam();
  std::vector<int> arrived(static_cast<std::size_t>(p), 0);
  launch(test_launch(p), [&](Communicator& comm) {
    // Only meaningful for threads (one address space); under mpi each process sees its own.
    arrived[comm.rank()] = 1;
    comm.barrier();
    if (comm.backend() == "local") {
      EXPECT_EQ(std::accumulate(arrived.begin(), arrived.end(), 0), p);
    }
    comm.barrier();
  });
}

TEST_P(CollectiveTest, AllReduceIsBitwiseIdenticalOnEveryRankAndRun) {
  const int p = GetParam();
  constexpr std::size_t kCount = 4099;
  auto noisy = [](int rank, std::size_t k) {
    // Values whose float sum depends on the order of addition.
    return static_cast<float>(std::sin(0.37 * k + rank)) * (1.0f + 1e-3f * rank);
  };
  std::vector<float> first_run;
  for (int run = 0; run < 2; ++run) {
    launch(test_launch(p), [&](Communicator& comm) {
      std::vector<float> values(kCount);
      for (std::size_t k = 0; k < kCount; ++k) values[k] = noisy(comm.rank(), k);
      comm.allreduce(std::span(values), ReduceOp::kSum)->wait();
      // Every rank compares its bits with rank 0's.
      std::vector<float> rank0 = values;
      comm.broadcast(std::span(rank0), 0)->wait();
      ASSERT_EQ(std::memcmp(values.data(), rank0.data(), kCount * sizeof(float)), 0)
          << "rank " << comm.rank() << " differs from rank 0";
      if (comm.rank() == 0 && run == 0) first_run = values;
      if (comm.rank() == 0 && run == 1) {
        ASSERT_EQ(std::memcmp(values.data(), first_run.data(), kCount * sizeof(float)), 0);
      }
    });
  }
}

TEST_P(CollectiveTest, SumsAddInRankOrderOnEveryBackend) {
  // comm.h promises ((x0 + x1) + x2) + ... for kSum (and that, divided by p, for kAvg):
  // graders emulate data-parallel arithmetic in one process and compare bitwise.
  const int p = GetParam();
  constexpr std::size_t kShard = 1031;  // prime, so all-reduce chunks are uneven
  const std::size_t count = kShard * static_cast<std::size_t>(p);
  auto noisy = [](int rank, std::size_t k) {
    return static_cast<float>(std::sin(0.91 * static_cast<double>(k) + 3.0 * rank)) *
           std::pow(10.0f, static_cast<float>(rank % 3) - 1.0f);
  };
  std::vector<float> expected_sum(count);
  for (std::size_t k = 0; k < count; ++k) {
    float sum = noisy(0, k);
    for (int r = 1; r < p; ++r) sum += noisy(r, k);
    expected_sum[k] = sum;
  }
  launch(test_launch(p), [&](Communicator& comm) {
    std::vector<float> mine(count);
    for (std::size_t k = 0; k < count; ++k) mine[k] = noisy(comm.rank(), k);
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      std::vector<float> reduced = mine;
      comm.allreduce(std::span(reduced), op)->wait();
      std::vector<float> shard(kShard);
      comm.reduce_scatter(std::span<const float>(mine), std::span(shard), op)->wait();
      for (std::size_t k = 0; k < count; ++k) {
        const float want =
            op == ReduceOp::kSum ? expected_sum[k] : expected_sum[k] / static_cast<float>(p);
        ASSERT_EQ(std::memcmp(&reduced[k], &want, sizeof(float)), 0)
            << "allreduce " << to_string(op) << " element " << k << ": " << reduced[k]
            << ", expected " << want;
        const std::size_t owner = k / kShard;
        if (owner == static_cast<std::size_t>(comm.rank())) {
          ASSERT_EQ(std::memcmp(&shard[k % kShard], &want, sizeof(float)), 0)
              << "reduce_scatter " << to_string(op) << " element " << k;
        }
      }
    }
  });
}

// Graders read the counters around lab code; lab code must not be able to hide its calls.
// Counters only grow: there is no way to reset them through the interface labs receive.
template <typename C>
concept ResettableCounters = requires(C& comm) {
  comm.reset_counters();
};
static_assert(!ResettableCounters<Communicator>,
              "lab code receives a Communicator: it must not be able to reset the counters");

TEST_P(CollectiveTest, CountersEqualTheRingFormulas) {
  const int p = GetParam();
  constexpr std::size_t kCount = 1009;  // prime: uneven chunks for p > 1
  launch(test_launch(p), [&](Communicator& comm) {
    const auto chunk = [&](int r) {
      return kCount * static_cast<std::size_t>(r + 1) / static_cast<std::size_t>(p) -
             kCount * static_cast<std::size_t>(r) / static_cast<std::size_t>(p);
    };
    const std::size_t mine = chunk(comm.rank());
    const std::size_t peers = static_cast<std::size_t>(p - 1);
    // Counters only grow: what a call moved is the difference of two snapshots.
    CommCounters before = comm.counters();

    std::vector<float> data(kCount, 1.0f);
    comm.allreduce(std::span(data), ReduceOp::kSum)->wait();
    CommCounters c = comm.counters().since(before);
    // Received: my chunk from every peer, then every other chunk once.
    const std::uint64_t allreduce_bytes = 4 * (peers * mine + (kCount - mine));
    EXPECT_EQ(c.of(CommOp::kAllReduce).calls, 1u);
    EXPECT_EQ(c.of(CommOp::kAllReduce).bytes_received, allreduce_bytes);
    EXPECT_EQ(c.of(CommOp::kAllReduce).bytes_sent, allreduce_bytes);
    EXPECT_EQ(c.of(CommOp::kAllReduce).messages_sent, 2 * peers);
    for (int peer = 0; peer < p; ++peer) {
      const std::uint64_t expected = peer == comm.rank() ? 0 : 4 * (mine + chunk(peer));
      EXPECT_EQ(c.bytes_received_from[peer], expected) << "from peer " << peer;
      EXPECT_EQ(c.bytes_sent_to[peer], expected) << "to peer " << peer;
    }

    before = comm.counters();
    std::vector<float> shard(64), full(64 * static_cast<std::size_t>(p), 1.0f);
    comm.reduce_scatter(std::span<const float>(full), std::span(shard), ReduceOp::kSum)->wait();
    comm.allgather(std::span<const float>(shard), std::span(full))->wait();
    comm.broadcast(std::span(shard), 0)->wait();
    comm.barrier();
    c = comm.counters().since(before);
    EXPECT_EQ(c.of(CommOp::kReduceScatter).bytes_received, 4 * 64 * peers);
    EXPECT_EQ(c.of(CommOp::kAllGather).bytes_sent, 4 * 64 * peers);
    EXPECT_EQ(c.of(CommOp::kBroadcast).bytes_sent, comm.rank() == 0 ? 4 * 64 * peers : 0u);
    EXPECT_EQ(c.of(CommOp::kBroadcast).bytes_received, comm.rank() == 0 || p == 1 ? 0u : 4u * 64);
    EXPECT_EQ(c.of(CommOp::kBarrier).calls, 1u);
    EXPECT_EQ(c.of(CommOp::kBarrier).bytes_sent, 0u);
    EXPECT_EQ(c.collective_calls(), 4u);

    if (p >= 2) {
      before = comm.counters();
      std::vector<float> message(100, 1.0f);
      const int right = (comm.rank() + 1) % p;
      const int left = (comm.rank() + p - 1) % p;
      auto send = comm.isend(std::span<const float>(message), right, 0);
      std::vector<float> incoming(100);
      comm.irecv(std::span(incoming), left, 0)->wait();
      send->wait();
      c = comm.counters().since(before);
      EXPECT_EQ(c.of(CommOp::kSend).bytes_sent, 400u);
      EXPECT_EQ(c.of(CommOp::kRecv).bytes_received, 400u);
      EXPECT_EQ(c.bytes_sent_to[right], 400u);
      EXPECT_EQ(c.bytes_received_from[left], 400u);
      EXPECT_EQ(c.total_bytes_sent(), 400u);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, CollectiveTest, ::testing::Values(1, 2, 3, 4, 5),
                         [](const ::testing::TestParamInfo<int>& param_info) {
                           return "ranks" + std::to_string(param_info.param);
                         });

// Every backend checks a call's arguments with the same functions (comm/argument_checks.h),
// so a mistake reads the same on local and on mpi (and on nccl: test_emulated_nccl.cpp).
TEST(CollectiveArguments, BadArgumentsAreRejectedWithTheSameWordsOnEveryBackend) {
  launch(test_launch(2), [](Communicator& comm) {
    std::vector<float> in(10), out(4);
    EXPECT_EQ(message_of<Error>([&] {
                comm.reduce_scatter(std::span<const float>(in), std::span(out), ReduceOp::kSum);
              }),
              "reduce_scatter: expected the input to hold size() x output = 2 x 4 = 8 float32, "
              "got 10 float32");
    EXPECT_EQ(
        message_of<Error>([&] { comm.allgather(std::span<const float>(out), std::span(in)); }),
        "allgather: expected the output to hold size() x input = 2 x 4 = 8 float32, got 10 "
        "float32");
    EXPECT_EQ(message_of<Error>([&] { comm.isend(std::span<const float>(in), 2, 0); }),
              "isend: peer 2 is out of range: expected 0 <= peer < 2");
    EXPECT_EQ(message_of<Error>([&] { comm.irecv(std::span(in), -1, 0); }),
              "irecv: peer -1 is out of range: expected 0 <= peer < 2");
    EXPECT_EQ(message_of<Error>([&] { comm.broadcast(std::span(in), 5); }),
              "broadcast root: peer 5 is out of range: expected 0 <= peer < 2");
    std::vector<std::uint8_t> bytes(8);
    EXPECT_EQ(message_of<Error>([&] {
                comm.allreduce(MutableBuffer(bytes.data(), bytes.size(), DataType::kUInt8),
                               ReduceOp::kSum);
              }),
              "allreduce: cannot reduce uint8 elements; expected float32, int32, bfloat16 or "
              "float16");
  });
}

}  // namespace
}  // namespace dp
