// The nccl backend emulated on the emulated CUDA device (comm/emulated_nccl.cpp): NCCL's
// contract on the local backend's threads, so that CI, without a GPU, runs every path a
// caller takes on nccl. Each test pins one clause of that contract against the local
// backend, which keeps the opposite one: host buffers refused with the nccl backend's
// message; 2-rank sums bitwise the local backend's and 3- and 4-rank sums in the ring order
// the file states; a mismatch that hangs and is reported after the hang timeout, not at
// once; messages held until the next wait and matched in posted order, sorted by tag
// within a group; the ring counters; at most 8 ranks (the emulated machine's GPUs); split
// communicators with ncclCommSplit's contract, whose failures stop every rank.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dp/comm.h"
#include "dp/error.h"
#include "dp/host_collectives.h"
#include "dp/launch.h"
#include "dp/rng.h"
#include "dp/tensor.h"
#include "test_support.h"

namespace dp {
namespace {

using testing::contains;
using testing::message_of;

/// Turns the emulated CUDA device on for one test, and off after it.
class EmulatedNccl : public ::testing::Test {
 protected:
  void SetUp() override { set_cuda_device_emulated(true); }
  void TearDown() override { set_cuda_device_emulated(false); }
};

/// Rank `rank`'s values: mixed magnitudes (2^-12 to 2^12, both signs), so that float sums
/// depend on the order of the additions.
std::vector<float> values_of(int rank, std::size_t n, std::uint64_t seed) {
  CounterRng rng(seed, static_cast<std::uint64_t>(rank));
  std::vector<float> values(n);
  for (float& value : values)
    value = std::ldexp(rng.uniform(-1.0f, 1.0f), static_cast<int>(rng.below(25)) - 12);
  return values;
}

std::vector<float> host_copy(const Tensor& tensor) {
  const Tensor host = tensor.to(Device::kHost);
  return {host.span().begin(), host.span().end()};
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// Every rank's all-reduce (`op`) of `values_of(rank, n, seed)` on device buffers.
std::vector<std::vector<float>> allreduce_on(Backend backend, int ranks, std::size_t n, ReduceOp op,
                                             std::uint64_t seed) {
  std::vector<std::vector<float>> results(static_cast<std::size_t>(ranks));
  launch({.world_size = ranks, .backend = backend}, [&](Communicator& comm) {
    Tensor data = Tensor::from(values_of(comm.rank(), n, seed), MemoryCategory::kCommunication,
                               Device::kCuda);
    comm.allreduce(data.view(), op)->wait();
    results[static_cast<std::size_t>(comm.rank())] = host_copy(data);
  });
  return results;
}

/// Element k of chunk `chunk` over `p` ranks as the emulation adds it: rank chunk+1 first,
/// round the ring, rank `chunk` last.
float ring_sum(const std::vector<std::vector<float>>& inputs, std::size_t k, int chunk) {
  const int p = static_cast<int>(inputs.size());
  float sum = inputs[static_cast<std::size_t>((chunk + 1) % p)][k];
  for (int step = 2; step <= p; ++step)
    sum += inputs[static_cast<std::size_t>((chunk + step) % p)][k];
  return sum;
}

TEST_F(EmulatedNccl, IsTheNcclBackendAndRefusesHostBuffersWithItsMessage) {
  const std::string expected = fmt::format(
      "allreduce on the nccl backend: expected a buffer in {} memory, got one in "
      "host memory; keep the tensors on Device::kCuda with this backend, or use the "
      "local backend",
      to_string(Device::kCuda));
  std::vector<std::string> names(2);
  const std::string message = message_of<Error>([&] {
    launch({.world_size = 2, .backend = Backend::kNccl}, [&](Communicator& comm) {
      names[static_cast<std::size_t>(comm.rank())] = std::string(comm.backend());
      std::vector<float> host(4, 1.0f);
      comm.allreduce(std::span<float>(host), ReduceOp::kSum)->wait();
    });
  });
  EXPECT_EQ(names, (std::vector<std::string>{"nccl", "nccl"}));
  EXPECT_TRUE(contains(message, expected)) << message;
  // The local backend takes the same host buffer.
  launch({.world_size = 2}, [](Communicator& comm) {
    std::vector<float> host(4, 1.0f);
    comm.allreduce(std::span<float>(host), ReduceOp::kSum)->wait();
  });
  const std::string send = message_of<Error>([&] {
    launch({.world_size = 2, .backend = Backend::kNccl}, [](Communicator& comm) {
      std::vector<float> host(4, 1.0f);
      comm.isend(std::span<float>(host), 1 - comm.rank(), 0)->wait();
    });
  });
  EXPECT_TRUE(contains(send, "isend on the nccl backend: expected a buffer in")) << send;
}

/// The messages of the argument errors of every call on `backend`, with device buffers.
std::vector<std::string> argument_errors_on(Backend backend) {
  std::vector<std::string> messages;
  launch({.world_size = 2, .backend = backend}, [&](Communicator& comm) {
    Tensor in({10}, MemoryCategory::kCommunication, Device::kCuda);
    Tensor out({4}, MemoryCategory::kCommunication, Device::kCuda);
    const std::vector<std::function<void()>> calls = {
        [&] { comm.reduce_scatter(in.view(), out.view(), ReduceOp::kSum); },
        [&] { comm.allgather(out.view(), in.view()); },
        [&] { comm.isend(in.view(), 2, 0); },
        [&] { comm.irecv(in.view(), -1, 0); },
        [&] { comm.broadcast(in.view(), 5); },
    };
    std::vector<std::string> mine;
    for (const auto& call : calls) mine.push_back(message_of<Error>(call));
    if (comm.rank() == 0) messages = mine;
  });
  return messages;
}

TEST_F(EmulatedNccl, ArgumentErrorsReadAsOnTheLocalBackend) {
  const std::vector<std::string> nccl = argument_errors_on(Backend::kNccl);
  EXPECT_EQ(nccl, argument_errors_on(Backend::kLocal));
  ASSERT_EQ(nccl.size(), 5u);
  EXPECT_TRUE(contains(nccl[0], "reduce_scatter: expected the input to hold size() x output"))
      << nccl[0];
  EXPECT_TRUE(contains(nccl[4], "broadcast root: peer 5 is out of range")) << nccl[4];
}

TEST_F(EmulatedNccl, TwoRankSumsAndAveragesAreBitwiseTheLocalBackends) {
  for (const ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
    const auto nccl = allreduce_on(Backend::kNccl, 2, 1001, op, 7);
    const auto local = allreduce_on(Backend::kLocal, 2, 1001, op, 7);
    EXPECT_TRUE(same_bits(nccl[0], local[0])) << to_string(op);
    EXPECT_TRUE(same_bits(nccl[1], local[0])) << to_string(op);
  }
}

TEST_F(EmulatedNccl, SumsOfThreeAndFourRanksAddInTheRingOrder) {
  for (const int p : {3, 4}) {
    const std::size_t n = 60;  // p chunks of n / p elements
    std::vector<std::vector<float>> inputs;
    for (int r = 0; r < p; ++r) inputs.push_back(values_of(r, n, 11));
    const auto sums = allreduce_on(Backend::kNccl, p, n, ReduceOp::kSum, 11);
    const auto averages = allreduce_on(Backend::kNccl, p, n, ReduceOp::kAvg, 11);
    const auto local = allreduce_on(Backend::kLocal, p, n, ReduceOp::kSum, 11);
    std::size_t differ_from_rank_order = 0;
    for (int chunk = 0; chunk < p; ++chunk) {
      for (std::size_t k = n * chunk / p; k < n * (chunk + 1) / p; ++k) {
        const float ring = ring_sum(inputs, k, chunk);
        float rank_order = inputs[0][k];
        for (int r = 1; r < p; ++r) rank_order += inputs[static_cast<std::size_t>(r)][k];
        for (int r = 0; r < p; ++r) {
          const auto rank = static_cast<std::size_t>(r);
          EXPECT_EQ(std::bit_cast<std::uint32_t>(sums[rank][k]), std::bit_cast<std::uint32_t>(ring))
              << p << " ranks, element " << k << " on rank " << r;
          // The average divides that sum afterwards.
          EXPECT_EQ(std::bit_cast<std::uint32_t>(averages[rank][k]),
                    std::bit_cast<std::uint32_t>(ring / static_cast<float>(p)))
              << p << " ranks, element " << k << " on rank " << r;
        }
        EXPECT_EQ(std::bit_cast<std::uint32_t>(local[0][k]),
                  std::bit_cast<std::uint32_t>(rank_order));
        if (std::bit_cast<std::uint32_t>(ring) != std::bit_cast<std::uint32_t>(rank_order))
          ++differ_from_rank_order;
      }
    }
    // The values were chosen so that the order shows: the test would catch rank order.
    EXPECT_GT(differ_from_rank_order, 0U) << p << " ranks";
  }
}

TEST_F(EmulatedNccl, ReduceScatterSumsEachShardRoundTheRingEndingAtItsOwner) {
  const int p = 3;
  const std::size_t shard = 20;
  std::vector<std::vector<float>> inputs;
  for (int r = 0; r < p; ++r) inputs.push_back(values_of(r, shard * p, 5));
  std::vector<std::vector<float>> outputs(p);
  launch({.world_size = p, .backend = Backend::kNccl}, [&](Communicator& comm) {
    const Tensor in = Tensor::from(inputs[static_cast<std::size_t>(comm.rank())],
                                   MemoryCategory::kCommunication, Device::kCuda);
    Tensor out({static_cast<std::int64_t>(shard)}, MemoryCategory::kCommunication, Device::kCuda);
    comm.reduce_scatter(in.view(), out.view(), ReduceOp::kSum)->wait();
    outputs[static_cast<std::size_t>(comm.rank())] = host_copy(out);
  });
  for (int d = 0; d < p; ++d)
    for (std::size_t k = 0; k < shard; ++k)
      EXPECT_EQ(std::bit_cast<std::uint32_t>(outputs[static_cast<std::size_t>(d)][k]),
                std::bit_cast<std::uint32_t>(ring_sum(inputs, d * shard + k, d)))
          << "shard " << d << ", element " << k;
}

TEST_F(EmulatedNccl, AMismatchIsNotValidatedButHangsAndIsReportedAfterTheTimeout) {
  const auto timeout = std::chrono::milliseconds(300);
  // Sizes: rank 0 all-reduces 8 floats, rank 1 4. Order: an all-reduce against a broadcast.
  for (const bool sizes : {true, false}) {
    const auto started = std::chrono::steady_clock::now();
    const std::string message = message_of<CommError>([&] {
      launch({.world_size = 2, .backend = Backend::kNccl, .comm = {.hang_timeout = timeout}},
             [&](Communicator& comm) {
               Tensor data({8}, MemoryCategory::kCommunication, Device::kCuda);
               if (comm.rank() == 0)
                 comm.allreduce(data.view(), ReduceOp::kSum)->wait();
               else if (sizes)
                 comm.allreduce(data.view().slice(0, 4), ReduceOp::kSum)->wait();
               else
                 comm.broadcast(data.view(), 0)->wait();
             });
    });
    const auto waited = std::chrono::steady_clock::now() - started;
    EXPECT_GE(waited, timeout) << message;
    EXPECT_TRUE(contains(message, "(nccl, GPU ")) << message;
    EXPECT_TRUE(contains(message, "hang timeout 300 ms")) << message;
    EXPECT_TRUE(contains(message, "nccl does not validate them")) << message;
    EXPECT_TRUE(contains(message, "collective sequences first differ at collective #0")) << message;
    EXPECT_FALSE(contains(message, "does not match")) << message;
  }
  // The local backend validates: the same size mismatch fails at once, named as one.
  const std::string local = message_of<CommError>([&] {
    launch({.world_size = 2, .comm = {.hang_timeout = std::chrono::seconds(30)}},
           [](Communicator& comm) {
             std::vector<float> data(comm.rank() == 0 ? 8 : 4);
             comm.allreduce(std::span<float>(data), ReduceOp::kSum)->wait();
           });
  });
  EXPECT_TRUE(contains(local, "collective #0 does not match across ranks")) << local;
}

TEST_F(EmulatedNccl, MessagesAreHeldUntilTheSendersNextWait) {
  std::atomic<bool> sender_waits{false};
  std::atomic<bool> received_before_the_senders_wait{false};
  launch({.world_size = 2, .backend = Backend::kNccl}, [&](Communicator& comm) {
    Tensor data =
        Tensor::from(std::vector<float>{1, 2, 3}, MemoryCategory::kCommunication, Device::kCuda);
    if (comm.rank() == 0) {
      auto send = comm.isend(data.view(), 1, 0);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // held all along
      sender_waits = true;
      send->wait();
    } else {
      comm.irecv(data.view(), 0, 0)->wait();
      received_before_the_senders_wait = !sender_waits;
    }
  });
  EXPECT_FALSE(received_before_the_senders_wait);
}

TEST_F(EmulatedNccl, AGroupIsPostedSortedByTagAndMatchedInPostedOrder) {
  std::vector<float> first;
  std::vector<float> second;
  std::vector<float> untagged;
  launch({.world_size = 2, .backend = Backend::kNccl}, [&](Communicator& comm) {
    Tensor a =
        Tensor::from(std::vector<float>{1, 1}, MemoryCategory::kCommunication, Device::kCuda);
    Tensor b =
        Tensor::from(std::vector<float>{2, 2}, MemoryCategory::kCommunication, Device::kCuda);
    if (comm.rank() == 0) {
      // Issued tag 1 then tag 0; the receiver posts tag 0 then tag 1: sorted by tag, the
      // pairs match as on the local and mpi backends.
      auto later = comm.isend(a.view(), 1, 1);
      auto sooner = comm.isend(b.view(), 1, 0);
      later->wait();
      sooner->wait();
      // NCCL knows no tags: one message each way, tags 5 and 6, still pair up.
      comm.isend(a.view(), 1, 5)->wait();
    } else {
      auto tag0 = comm.irecv(a.view(), 0, 0);
      auto tag1 = comm.irecv(b.view(), 0, 1);
      tag0->wait();
      tag1->wait();
      first = host_copy(a);
      second = host_copy(b);
      Tensor c({2}, MemoryCategory::kCommunication, Device::kCuda);
      comm.irecv(c.view(), 0, 6)->wait();
      untagged = host_copy(c);
    }
  });
  EXPECT_EQ(first, (std::vector<float>{2, 2}));   // tag 0
  EXPECT_EQ(second, (std::vector<float>{1, 1}));  // tag 1
  EXPECT_EQ(untagged, (std::vector<float>{1, 1}));
}

TEST_F(EmulatedNccl, CountsWhatARingMovesAsTheOtherBackends) {
  const auto counts_on = [](Backend backend) {
    std::vector<CommCounters> counters(3);
    launch({.world_size = 3, .backend = backend}, [&](Communicator& comm) {
      Tensor data({10}, MemoryCategory::kCommunication, Device::kCuda);
      Tensor gathered({30}, MemoryCategory::kCommunication, Device::kCuda);
      comm.allreduce(data.view(), ReduceOp::kSum)->wait();
      comm.reduce_scatter(gathered.view(), data.view(), ReduceOp::kAvg)->wait();
      comm.allgather(data.view(), gathered.view())->wait();
      comm.broadcast(data.view(), 2)->wait();
      comm.barrier();
      const int next = (comm.rank() + 1) % 3;
      const int previous = (comm.rank() + 2) % 3;
      auto send = comm.isend(data.view().slice(0, 7), next, 0);
      comm.irecv(gathered.view().slice(0, 7), previous, 0)->wait();
      send->wait();
      counters[static_cast<std::size_t>(comm.rank())] = comm.counters();
    });
    return counters;
  };
  const auto nccl = counts_on(Backend::kNccl);
  const auto local = counts_on(Backend::kLocal);
  for (std::size_t rank = 0; rank < 3; ++rank) {
    for (std::size_t op = 0; op < kNumCommOps; ++op) {
      const OpCounters& a = nccl[rank].per_op[op];
      const OpCounters& b = local[rank].per_op[op];
      const std::string what = fmt::format("rank {} {}", rank, to_string(static_cast<CommOp>(op)));
      EXPECT_EQ(a.calls, b.calls) << what;
      EXPECT_EQ(a.bytes_sent, b.bytes_sent) << what;
      EXPECT_EQ(a.bytes_received, b.bytes_received) << what;
      EXPECT_EQ(a.messages_sent, b.messages_sent) << what;
      EXPECT_EQ(a.messages_received, b.messages_received) << what;
    }
    EXPECT_EQ(nccl[rank].bytes_sent_to, local[rank].bytes_sent_to) << rank;
    EXPECT_EQ(nccl[rank].bytes_received_from, local[rank].bytes_received_from) << rank;
  }
  // Rank 0's all-reduce of 10 floats: chunk 0 is 3 elements, so (p-1) 3 + (10 - 3) = 13.
  EXPECT_EQ(nccl[0].of(CommOp::kAllReduce).bytes_sent, 13U * sizeof(float));
}

TEST_F(EmulatedNccl, RunsOneRankPerGpuOfAnEightGpuMachine) {
  EXPECT_EQ(nccl_gpu_count(), kEmulatedGpuCount);
  int ran = 0;
  launch({.world_size = kEmulatedGpuCount, .backend = Backend::kNccl}, [&](Communicator& comm) {
    comm.barrier();
    if (comm.rank() == 0) ran = comm.size();
  });
  EXPECT_EQ(ran, kEmulatedGpuCount);
  const std::string message = message_of<Error>([] {
    launch({.world_size = kEmulatedGpuCount + 1, .backend = Backend::kNccl}, [](Communicator&) {});
  });
  EXPECT_TRUE(contains(message,
                       "asked for 9 ranks, the emulated CUDA device stands for a machine "
                       "of 8 GPUs"))
      << message;
}

TEST_F(EmulatedNccl, ARankThatFailsStopsTheOthersAtOnceAndIsTheErrorLaunchThrows) {
  const auto started = std::chrono::steady_clock::now();
  const std::string message = message_of<Error>([] {
    launch({.world_size = 3,
            .backend = Backend::kNccl,
            .comm = {.hang_timeout = std::chrono::seconds(60)}},
           [](Communicator& comm) {
             Tensor data({4}, MemoryCategory::kCommunication, Device::kCuda);
             if (comm.rank() == 2) throw Error("rank 2's own failure");
             comm.allreduce(data.view(), ReduceOp::kSum)->wait();
           });
  });
  EXPECT_TRUE(contains(message, "rank 2's own failure")) << message;
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(10));
}

TEST_F(EmulatedNccl, SplitMakesNcclCommunicatorsOfEachColorOrderedByKey) {
  // As ncclCommSplit: every rank calls it, ranks of a color form a communicator ranked by
  // key (then rank), NCCL_SPLIT_NOCOLOR (kNoColor) gets none; the new communicator is nccl's
  // (device buffers only) and can be split again.
  launch({.world_size = 4, .backend = Backend::kNccl}, [](Communicator& comm) {
    const int r = comm.rank();
    std::unique_ptr<Communicator> half = comm.split(r % 2, -r);  // {2, 0} and {3, 1}
    ASSERT_NE(half, nullptr);
    EXPECT_EQ(half->backend(), "nccl");
    EXPECT_EQ(half->size(), 2);
    EXPECT_EQ(half->rank(), r < 2 ? 1 : 0);
    Tensor data = Tensor::from(std::vector<float>(3, static_cast<float>(r + 1)),
                               MemoryCategory::kCommunication, Device::kCuda);
    half->allreduce(data.view(), ReduceOp::kSum)->wait();
    EXPECT_EQ(host_copy(data), std::vector<float>(3, r % 2 == 0 ? 1.0f + 3.0f : 2.0f + 4.0f));
    // A message to the other rank of the pair, by its rank in the pair.
    Tensor mine = Tensor::from(std::vector<float>{static_cast<float>(r)},
                               MemoryCategory::kCommunication, Device::kCuda);
    Tensor theirs({1}, MemoryCategory::kCommunication, Device::kCuda);
    auto send = half->isend(mine.view(), 1 - half->rank(), 0);
    auto receive = half->irecv(theirs.view(), 1 - half->rank(), 0);
    receive->wait();
    send->wait();
    EXPECT_EQ(host_copy(theirs), std::vector<float>{static_cast<float>((r + 2) % 4)});
    std::vector<float> host(2);
    EXPECT_TRUE(contains(
        message_of<Error>([&] { half->allreduce(std::span<float>(host), ReduceOp::kSum); }),
        "allreduce on the nccl backend: expected a buffer in cuda"));
    std::unique_ptr<Communicator> alone =
        half->split(half->rank() == 0 ? 0 : Communicator::kNoColor, 0);
    EXPECT_EQ(alone == nullptr, half->rank() != 0);
    if (alone) {
      EXPECT_EQ(alone->size(), 1);
      alone->barrier();
    }
    EXPECT_EQ(half->counters().of(CommOp::kSplit).calls, 1u);
    EXPECT_EQ(comm.counters().of(CommOp::kSplit).calls, 1u);
  });
}

TEST_F(EmulatedNccl, ARankThatFailsStopsTheRanksOfASplitCommunicatorToo) {
  const auto started = std::chrono::steady_clock::now();
  const std::string message = message_of<Error>([] {
    launch({.world_size = 4,
            .backend = Backend::kNccl,
            .comm = {.hang_timeout = std::chrono::seconds(60)}},
           [](Communicator& comm) {
             std::unique_ptr<Communicator> pair = comm.split(comm.rank() / 2, 0);
             Tensor data({4}, MemoryCategory::kCommunication, Device::kCuda);
             if (comm.rank() == 3) throw Error("rank 3's own failure");
             pair->allreduce(data.view(), ReduceOp::kSum)->wait();
             comm.barrier();
           });
  });
  EXPECT_TRUE(contains(message, "rank 3's own failure")) << message;
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(10));
}

TEST_F(EmulatedNccl, HostValuesAreStagedThroughTheDeviceOnNcclOnly) {
  for (const Backend backend : {Backend::kNccl, Backend::kLocal}) {
    std::vector<std::array<float, 2>> sums(2);
    std::vector<std::array<std::int32_t, 1>> counts(2);
    std::vector<std::array<float, 3>> copies(2);
    launch({.world_size = 2, .backend = backend}, [&](Communicator& comm) {
      const auto rank = static_cast<std::size_t>(comm.rank());
      EXPECT_EQ(device_for_host_values(comm),
                backend == Backend::kNccl ? Device::kCuda : Device::kHost);
      sums[rank] = {1.5f + static_cast<float>(rank), 10.0f};
      allreduce_host_values(std::span<float>(sums[rank]), ReduceOp::kSum, comm);
      counts[rank] = {static_cast<std::int32_t>(rank) + 3};
      allreduce_host_values(std::span<std::int32_t>(counts[rank]), ReduceOp::kSum, comm);
      copies[rank] = {static_cast<float>(rank), 7.0f, -1.0f};
      broadcast_host_values(std::span<float>(copies[rank]), 1, comm);
    });
    for (std::size_t rank = 0; rank < 2; ++rank) {
      EXPECT_EQ(sums[rank], (std::array<float, 2>{4.0f, 20.0f})) << to_string(backend);
      EXPECT_EQ(counts[rank], (std::array<std::int32_t, 1>{7})) << to_string(backend);
      EXPECT_EQ(copies[rank], (std::array<float, 3>{1.0f, 7.0f, -1.0f})) << to_string(backend);
    }
  }
}

}  // namespace
}  // namespace dp
