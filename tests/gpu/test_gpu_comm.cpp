// The communicator on device buffers. Needs a CUDA device: without one, main() exits with
// code 77 and ctest reports the program as skipped.
//
// Local backend (ranks are threads sharing GPU 0): every collective and a ring of messages
// on device buffers gives bitwise the host path's results (same reduction order, so float
// sums agree to the bit), the same counters, and with the simulation the same virtual times.
// Nccl backend (one rank per GPU: 1 rank here, more on a machine with more GPUs): every
// collective and a ring of messages against the local host path, on integer-valued floats,
// whose sums are exact in any order (NCCL adds in its ring's order). bfloat16 and float16
// buffers: the same comparisons for their reductions (comm.h's rule at `ReduceOp`).
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "dp/clock.h"
#include "dp/comm.h"
#include "dp/error.h"
#include "dp/float16.h"
#include "dp/launch.h"
#include "dp/rng.h"
#include "dp/tensor.h"
#include "dp/tensor_ops.h"
#include "gpu_test_support.h"

namespace dp {
namespace {

/// What one rank ends with after `exchange`: every output, its counters, its clock.
struct RankResult {
  std::vector<std::vector<float>> outputs;
  CommCounters counters;
  double clock_seconds = 0;
};

/// Values of rank `rank`: random floats of all magnitudes (sums then depend on the order),
/// or small integers (sums exact in any order) when `integers`.
std::vector<float> values_of(int rank, std::size_t n, bool integers) {
  CounterRng rng(1234, static_cast<std::uint64_t>(rank));
  std::vector<float> values(n);
  for (float& value : values) {
    const auto bits = rng.next_u32();
    value = integers ? static_cast<float>(static_cast<int>(bits % 201) - 100)
                     : (static_cast<float>(bits % 100000) - 50000.0f) /
                           static_cast<float>(1u << (bits % 20));
  }
  return values;
}

/// Every collective and a ring of messages on one rank, with its buffers on `device`; the
/// results copied to the host.
std::vector<std::vector<float>> exchange(Communicator& comm, Device device, std::size_t n,
                                         bool integers) {
  const int p = comm.size();
  const int r = comm.rank();
  std::vector<std::vector<float>> results;
  const auto keep = [&](const Tensor& tensor) {
    const Tensor host = tensor.to(Device::kHost);
    results.emplace_back(host.span().begin(), host.span().end());
  };
  const std::vector<float> mine = values_of(r, n * static_cast<std::size_t>(p), integers);
  for (const ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
    Tensor data = Tensor::from(mine, MemoryCategory::kActivations, device);
    comm.allreduce(data.view(), op)->wait();
    keep(data);
    Tensor shard({static_cast<std::int64_t>(n)}, MemoryCategory::kActivations, device);
    comm.reduce_scatter(Tensor::from(mine, MemoryCategory::kActivations, device).view(),
                        shard.view(), op)
        ->wait();
    keep(shard);
  }
  const Tensor piece = Tensor::from(std::span(mine).first(n), MemoryCategory::kActivations, device);
  Tensor gathered({static_cast<std::int64_t>(n) * p}, MemoryCategory::kActivations, device);
  comm.allgather(piece.view(), gathered.view())->wait();
  keep(gathered);
  Tensor broadcast = Tensor::from(mine, MemoryCategory::kActivations, device);
  comm.broadcast(broadcast.view(), p - 1)->wait();
  keep(broadcast);
  // A ring: send to the next rank and receive from the previous one, both in flight.
  Tensor received({static_cast<std::int64_t>(n)}, MemoryCategory::kActivations, device);
  auto send = comm.isend(piece.view(), (r + 1) % p, 7);
  auto receive = comm.irecv(received.view(), (r + p - 1) % p, 7);
  receive->wait();
  send->wait();
  keep(received);
  comm.barrier();
  return results;
}

std::vector<RankResult> run_exchange(LaunchOptions options, Device device, std::size_t n,
                                     bool integers) {
  std::vector<RankResult> results(static_cast<std::size_t>(options.world_size));
  launch(options, [&](Communicator& comm) {
    RankResult& mine = results[static_cast<std::size_t>(comm.rank())];
    mine.outputs = exchange(comm, device, n, integers);
    mine.counters = comm.counters();
    mine.clock_seconds = comm.clock().now();
  });
  return results;
}

void expect_bitwise_equal(const std::vector<RankResult>& expected,
                          const std::vector<RankResult>& seen, const std::string& what) {
  ASSERT_EQ(expected.size(), seen.size()) << what;
  for (std::size_t rank = 0; rank < expected.size(); ++rank) {
    ASSERT_EQ(expected[rank].outputs.size(), seen[rank].outputs.size()) << what;
    for (std::size_t i = 0; i < expected[rank].outputs.size(); ++i) {
      const auto& a = expected[rank].outputs[i];
      const auto& b = seen[rank].outputs[i];
      ASSERT_EQ(a.size(), b.size()) << what << ", rank " << rank << ", output " << i;
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
          << what << ": rank " << rank << ", output " << i << " differs from the host path";
    }
  }
}

void expect_same_counters(const std::vector<RankResult>& expected,
                          const std::vector<RankResult>& seen, const std::string& what) {
  for (std::size_t rank = 0; rank < expected.size(); ++rank) {
    const CommCounters& a = expected[rank].counters;
    const CommCounters& b = seen[rank].counters;
    EXPECT_EQ(a.bytes_sent_to, b.bytes_sent_to) << what << ", rank " << rank;
    EXPECT_EQ(a.bytes_received_from, b.bytes_received_from) << what << ", rank " << rank;
    EXPECT_EQ(a.total_calls(), b.total_calls()) << what << ", rank " << rank;
    EXPECT_EQ(a.total_bytes_sent(), b.total_bytes_sent()) << what << ", rank " << rank;
  }
}

// Elements per shard: 1, a small collective (the eager path), a large one (the pieces path on
// the host: 1 MiB of input per rank and more).
constexpr std::size_t kSizes[] = {1, 1000, 65536};

TEST(GpuLocalComm, EveryCallOnDeviceBuffersIsBitwiseTheHostPath) {
  for (const int p : {2, 3, 4})
    for (const std::size_t n : kSizes) {
      const std::string what = fmt::format("{} ranks, {} elements per shard", p, n);
      const LaunchOptions options{.world_size = p};
      const auto host = run_exchange(options, Device::kHost, n, /*integers=*/false);
      const auto device = run_exchange(options, Device::kCuda, n, /*integers=*/false);
      expect_bitwise_equal(host, device, what);
      expect_same_counters(host, device, what);
    }
}

TEST(GpuLocalComm, WithTheSimulationTheVirtualTimesAreTheHostPaths) {
  LaunchOptions options{.world_size = 4};
  options.simulation = SimulationOptions::preset("ib-ndr");
  const auto host = run_exchange(options, Device::kHost, 4096, false);
  const auto device = run_exchange(options, Device::kCuda, 4096, false);
  expect_bitwise_equal(host, device, "simulated, 4 ranks");
  expect_same_counters(host, device, "simulated, 4 ranks");
  for (std::size_t rank = 0; rank < host.size(); ++rank)
    EXPECT_EQ(host[rank].clock_seconds, device[rank].clock_seconds) << "rank " << rank;
}

TEST(GpuLocalComm, AdversarialCompletionWorksOnDeviceBuffers) {
  LaunchOptions options{.world_size = 3};
  const auto host = run_exchange(options, Device::kHost, 1000, false);
  options.comm.completion = Completion::kAdversarial;
  options.comm.completion_seed = 5;
  const auto device = run_exchange(options, Device::kCuda, 1000, false);
  expect_bitwise_equal(host, device, "adversarial, 3 ranks");
}

/// Runs an all-reduce on device buffers in the adversarial mode on `options` (its backend,
/// its ranks) and checks both sides of the poison: a kernel that divides the buffer before
/// the wait is reported by the wait, naming the call and the rank; one that divides it after
/// the wait is not, and gives the average.
void expect_arithmetic_in_flight_reported(LaunchOptions options) {
  options.comm.completion = Completion::kAdversarial;
  options.comm.completion_seed = 5;
  std::vector<std::string> messages(static_cast<std::size_t>(options.world_size));
  launch(options, [&](Communicator& comm) {
    Tensor early =
        Tensor::from(std::vector<float>(4096, 3.0f), MemoryCategory::kGradients, Device::kCuda);
    auto work = comm.allreduce(early.view(), ReduceOp::kSum);
    const float poison = early.to(Device::kHost).span()[0];  // a read: allowed
    EXPECT_TRUE(std::isfinite(poison) && std::abs(poison) >= 1.0f && std::abs(poison) < 2.0f)
        << poison;
    divide(early.view(), 2.0f);  // a kernel on the compute stream, the call in flight
    try {
      work->wait();
    } catch (const Error& error) {
      messages[static_cast<std::size_t>(comm.rank())] = error.what();
    }

    Tensor honest =
        Tensor::from(std::vector<float>(4096, 3.0f), MemoryCategory::kGradients, Device::kCuda);
    comm.allreduce(honest.view(), ReduceOp::kSum)->wait();
    divide(honest.view(), static_cast<float>(comm.size()));
    const Tensor average = honest.to(Device::kHost);
    EXPECT_TRUE(std::all_of(average.span().begin(), average.span().end(),
                            [](float x) { return x == 3.0f; }));
  });
  for (int rank = 0; rank < options.world_size; ++rank) {
    const std::string expected = fmt::format(
        "rank {}: allreduce (its call #1: 4096 float32 in place): element 0 of its buffer "
        "changed before its wait()",
        rank);
    const std::string& message = messages[static_cast<std::size_t>(rank)];
    EXPECT_NE(message.find(expected), std::string::npos) << message << "\nexpected: " << expected;
  }
}

TEST(GpuLocalComm, AdversarialCompletionReportsAKernelOnAnInFlightBuffer) {
  expect_arithmetic_in_flight_reported({.world_size = 3});
}

// The buffer is written by a kernel on the compute stream and handed to the all-reduce at
// once, with no synchronisation in between: the call must wait for the kernel (the event
// gate). Many rounds, so that a missing gate would show.
TEST(GpuLocalComm, ACollectiveWaitsForTheKernelsThatWroteItsBuffer) {
  constexpr std::size_t kN = 1 << 20;
  launch({.world_size = 2}, [](Communicator& comm) {
    Tensor data({static_cast<std::int64_t>(kN)}, MemoryCategory::kGradients, Device::kCuda);
    for (int round = 1; round <= 20; ++round) {
      fill(data.view(), static_cast<float>(round));
      scale(data.view(), 2.0f);
      comm.allreduce(data.view(), ReduceOp::kSum)->wait();
      const Tensor host = data.to(Device::kHost);
      const float expected = 4.0f * static_cast<float>(round);
      ASSERT_TRUE(std::all_of(host.span().begin(), host.span().end(),
                              [&](float x) { return x == expected; }))
          << "round " << round << ": expected every element " << expected;
    }
  });
}

// A rank's last kernels (an optimizer step, say) are queued on its thread's stream when its
// function returns; the caller reads the tensors they write as soon as launch() returns, on
// its own stream. launch() must have waited for them. Many kernels queued, so that a missing
// wait would show.
TEST(GpuLaunch, ARanksDeviceWorkHasFinishedWhenLaunchReturns) {
  constexpr std::int64_t kN = 1 << 22;
  constexpr int kRounds = 200;
  Tensor written({kN}, MemoryCategory::kActivations, Device::kCuda);
  const Tensor ones =
      Tensor::from(std::vector<float>(kN, 1.0f), MemoryCategory::kActivations, Device::kCuda);
  for (int attempt = 0; attempt < 5; ++attempt) {
    fill(written.view(), 0.0f);
    synchronize_device();
    launch({.world_size = 1}, [&](Communicator&) {
      for (int round = 0; round < kRounds; ++round) add(ones.view(), written.view());
    });
    const Tensor host = written.to(Device::kHost);
    ASSERT_TRUE(std::all_of(host.span().begin(), host.span().end(),
                            [](float x) { return x == static_cast<float>(kRounds); }))
        << "attempt " << attempt << ": launch() returned before the rank's " << kRounds
        << " additions had finished";
  }
}

// Ranks of the local backend on two GPUs (each thread makes its own current): the thread
// that moves the other rank's data works on that rank's GPU for the move and must leave its
// own GPU current, or its next kernels run on the other GPU. Needs 2 GPUs.
TEST(GpuLocalComm, MovingAnotherGpusDataLeavesTheRanksOwnGpuCurrent) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 GPUs (a rank on each)";
  launch({.world_size = 2}, [](Communicator& comm) {
    const int own = comm.rank();
    ASSERT_EQ(cudaSetDevice(own), cudaSuccess);
    Tensor data({1 << 16}, MemoryCategory::kGradients, Device::kCuda);
    for (int round = 1; round <= 4; ++round) {
      fill(data.view(), 1.0f);
      comm.allreduce(data.view(), ReduceOp::kSum)->wait();
      int current = -1;
      ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
      ASSERT_EQ(current, own) << "rank " << own << ", round " << round
                              << ": the all-reduce left another GPU current";
    }
  });
}

TEST(GpuLocalComm, RanksPassingHostAndDeviceBuffersFailLikeMismatchedSizes) {
  std::mutex mutex;
  std::string message;
  try {
    launch({.world_size = 2}, [&](Communicator& comm) {
      Tensor data({16}, MemoryCategory::kActivations,
                  comm.rank() == 0 ? Device::kHost : Device::kCuda);
      comm.allreduce(data.view(), ReduceOp::kSum)->wait();
    });
  } catch (const CommError& error) {
    const std::lock_guard lock(mutex);
    message = error.what();
  }
  EXPECT_NE(message.find("does not match across ranks"), std::string::npos) << message;
  EXPECT_NE(message.find("allreduce(count=16 float32 in cuda memory, op=sum)"), std::string::npos)
      << message;
  EXPECT_NE(message.find("allreduce(count=16 float32, op=sum)"), std::string::npos) << message;
}

TEST(GpuNcclComm, EveryCallOnEveryGpuMatchesTheHostPath) {
  const int gpus = std::min(cuda_device_count(), 4);
  for (int p = 1; p <= gpus; ++p) {
    const std::string what = fmt::format("nccl, {} rank{}", p, p == 1 ? "" : "s");
    const auto host = run_exchange({.world_size = p}, Device::kHost, 1000, /*integers=*/true);
    const auto nccl =
        run_exchange({.world_size = p, .backend = Backend::kNccl}, Device::kCuda, 1000, true);
    expect_bitwise_equal(host, nccl, what);
    expect_same_counters(host, nccl, what);
  }
}

// --- bfloat16 and float16 buffers --------------------------------------------------------

/// Rank `rank`'s `n` values rounded to the 16-bit type of `type`, as bit patterns: random
/// magnitudes, or small integers (sums exact in any order for both types) when `integers`.
std::vector<std::uint16_t> bits_of(DataType type, int rank, std::size_t n, bool integers) {
  const std::vector<float> values = values_of(rank, n, integers);
  std::vector<std::uint16_t> bits(n);
  for (std::size_t k = 0; k < n; ++k) {
    // + 0: fmod keeps the sign of a -31's zero, and maxima of -0 and +0 depend on the order.
    const float value = integers ? std::fmod(values[k], 31.0f) + 0.0f : values[k];
    bits[k] = type == DataType::kBFloat16 ? to_bfloat16(value).bits : to_float16(value).bits;
  }
  return bits;
}

/// A tensor on `device` whose memory holds `bits` (two 16-bit elements per float32 slot).
Tensor tensor_of_bits(const std::vector<std::uint16_t>& bits, Device device) {
  std::vector<float> words((bits.size() + 1) / 2, 0.0f);
  std::memcpy(words.data(), bits.data(), bits.size() * sizeof(std::uint16_t));
  return Tensor::from(words, MemoryCategory::kActivations, device);
}

std::vector<std::uint16_t> bits_in(const Tensor& tensor, std::size_t n) {
  const Tensor host = tensor.to(Device::kHost);
  std::vector<std::uint16_t> bits(n);
  std::memcpy(bits.data(), host.span().data(), n * sizeof(std::uint16_t));
  return bits;
}

/// Every reduction of one rank's 16-bit buffers on `device`, all-reduce and reduce-scatter
/// of each op, as the bits of each output.
std::vector<std::vector<std::uint16_t>> reduce_16bit(Communicator& comm, Device device,
                                                     DataType type, std::size_t n, bool integers) {
  const std::size_t total = n * static_cast<std::size_t>(comm.size());
  const std::vector<std::uint16_t> mine = bits_of(type, comm.rank(), total, integers);
  std::vector<std::vector<std::uint16_t>> results;
  for (const ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
    Tensor data = tensor_of_bits(mine, device);
    comm.allreduce({data.view().data(), total, type, device}, op)->wait();
    results.push_back(bits_in(data, total));
    const Tensor in = tensor_of_bits(mine, device);
    Tensor shard = tensor_of_bits(std::vector<std::uint16_t>(n), device);
    comm.reduce_scatter({in.view().data(), total, type, device},
                        {shard.view().data(), n, type, device}, op)
        ->wait();
    results.push_back(bits_in(shard, n));
  }
  return results;
}

/// Every rank's `reduce_16bit` results.
std::vector<std::vector<std::vector<std::uint16_t>>> run_16bit(LaunchOptions options, Device device,
                                                               DataType type, std::size_t n,
                                                               bool integers) {
  std::vector<std::vector<std::vector<std::uint16_t>>> results(
      static_cast<std::size_t>(options.world_size));
  launch(options, [&](Communicator& comm) {
    results[static_cast<std::size_t>(comm.rank())] = reduce_16bit(comm, device, type, n, integers);
  });
  return results;
}

TEST(GpuLocalComm, SixteenBitReductionsOnDeviceBuffersAreBitwiseTheHostPath) {
  // The kernel converts, adds in float32 and rounds after each rank as the host does (comm.h,
  // ReduceOp); the random values hold no NaN, whose payload CUDA may choose differently.
  for (const DataType type : {DataType::kBFloat16, DataType::kFloat16})
    for (const int p : {2, 3, 4})
      for (const std::size_t n : kSizes) {
        const std::string what =
            fmt::format("{}, {} ranks, {} elements per shard", to_string(type), p, n);
        const LaunchOptions options{.world_size = p};
        EXPECT_EQ(run_16bit(options, Device::kHost, type, n, /*integers=*/false),
                  run_16bit(options, Device::kCuda, type, n, /*integers=*/false))
            << what;
      }
}

TEST(GpuNcclComm, SixteenBitReductionsOnEveryGpuMatchTheHostPath) {
  // Small integers: sums exact in any order (NCCL adds in its ring's order), averages rounded
  // once by the divide after the sum, maxima exact.
  const int gpus = std::min(cuda_device_count(), 4);
  for (const DataType type : {DataType::kBFloat16, DataType::kFloat16})
    for (int p = 1; p <= gpus; ++p) {
      const auto host = run_16bit({.world_size = p}, Device::kHost, type, 1000, true);
      const auto nccl =
          run_16bit({.world_size = p, .backend = Backend::kNccl}, Device::kCuda, type, 1000, true);
      EXPECT_EQ(host, nccl) << to_string(type) << ", nccl, " << p << " ranks";
    }
}

TEST(GpuNcclComm, AdversarialCompletionReportsAKernelOnAnInFlightBuffer) {
  expect_arithmetic_in_flight_reported(
      {.world_size = std::min(cuda_device_count(), 4), .backend = Backend::kNccl});
}

TEST(GpuNcclComm, HostBuffersAreRefusedWithAClearMessage) {
  std::string message;
  try {
    launch({.world_size = 1, .backend = Backend::kNccl}, [](Communicator& comm) {
      EXPECT_EQ(comm.backend(), "nccl");
      std::vector<float> values(4, 1.0f);
      comm.allreduce(std::span<float>(values), ReduceOp::kSum)->wait();
    });
  } catch (const Error& error) {
    message = error.what();
  }
  EXPECT_NE(message.find("allreduce on the nccl backend: expected a buffer in cuda memory, got "
                         "one in host memory"),
            std::string::npos)
      << message;
}

TEST(GpuNcclComm, MoreRanksThanGpusIsAClearError) {
  const int gpus = cuda_device_count();
  std::string message;
  try {
    launch({.world_size = gpus + 1, .backend = Backend::kNccl}, [](Communicator&) {});
  } catch (const Error& error) {
    message = error.what();
  }
  EXPECT_NE(message.find("the nccl backend runs one rank per GPU"), std::string::npos) << message;
}

// Rank 0 sends tag 2 then tag 1; rank 1 receives tag 1 then tag 2: each receive gets the
// message of its tag, on nccl (which knows no tags) as on the local backend.
TEST(GpuNcclComm, MessagesAreMatchedByTagAsOnTheLocalBackend) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 GPUs (one rank per GPU)";
  for (const Backend backend : {Backend::kLocal, Backend::kNccl}) {
    launch({.world_size = 2, .backend = backend}, [&](Communicator& comm) {
      constexpr std::int64_t kN = 1000;
      if (comm.rank() == 0) {
        const Tensor twos =
            Tensor::from(std::vector<float>(kN, 2.0f), MemoryCategory::kActivations, Device::kCuda);
        const Tensor ones =
            Tensor::from(std::vector<float>(kN, 1.0f), MemoryCategory::kActivations, Device::kCuda);
        auto second = comm.isend(twos.view(), 1, /*tag=*/2);
        auto first = comm.isend(ones.view(), 1, /*tag=*/1);
        first->wait();
        second->wait();
        return;
      }
      Tensor tagged_one({kN}, MemoryCategory::kActivations, Device::kCuda);
      Tensor tagged_two({kN}, MemoryCategory::kActivations, Device::kCuda);
      auto first = comm.irecv(tagged_one.view(), 0, /*tag=*/1);
      auto second = comm.irecv(tagged_two.view(), 0, /*tag=*/2);
      first->wait();
      second->wait();
      const Tensor one = tagged_one.to(Device::kHost);
      const Tensor two = tagged_two.to(Device::kHost);
      EXPECT_EQ(one.span()[0], 1.0f) << comm.backend() << ": the receive of tag 1";
      EXPECT_EQ(two.span()[0], 2.0f) << comm.backend() << ": the receive of tag 2";
    });
  }
}

TEST(GpuNcclComm, AMissingBarrierIsReportedAfterTheHangTimeout) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 GPUs (one rank per GPU)";
  std::string message;
  try {
    LaunchOptions options{.world_size = 2, .backend = Backend::kNccl};
    options.comm.hang_timeout = std::chrono::milliseconds(2000);
    launch(options, [](Communicator& comm) {
      comm.barrier();
      if (comm.rank() == 0) comm.barrier();  // rank 1 has returned: never completes
    });
  } catch (const CommError& error) {
    message = error.what();
  }
  EXPECT_NE(message.find("hang: rank 0 (nccl, GPU 0) has waited 2 s"), std::string::npos)
      << message;
  EXPECT_NE(message.find("barrier()"), std::string::npos) << message;
}

}  // namespace
}  // namespace dp

int main(int argc, char** argv) {
  return dp::testing::gpu::run_gpu_tests(argc, argv, "GPU communicator tests");
}
