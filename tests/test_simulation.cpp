// The simulated interconnect and clock of the local backend.
//
// A message holds its sender's and receiver's links for its transfer, n / bandwidth, and
// arrives alpha later; the latency does not hold the link (dp/clock.h). So incast (p-1
// ranks to one), outcast (one to p-1) and a binomial tree take exactly their closed forms,
// and four all-reduce algorithms written here from isend/irecv (ring, binomial tree,
// recursive doubling, one-server parameter server) take exactly the time of their
// alpha-beta formulas (docs/reference.md, gamma = 0: reductions are not charged) for
// p = 2..8 and messages from 4 bytes to 256 MiB; native collectives are charged by their
// documented algorithm. On two levels (NVLink inside a node, 100 GbE between nodes) a
// message takes alpha + n / bandwidth of its pair's fabric, ranks sharing a NIC queue for
// it (j messages through one NIC: j n / bandwidth + alpha), a ring from messages takes
// 2(p-1) times its slowest hop, a hierarchical all-reduce from messages its two-level
// formula, and native collectives what the same algorithms of messages take (the ring at its
// slowest hop by speed, the tree round by round on each round's fabric, the barrier its
// longest chain of latencies);
// communicators split by node and by index in the node talk over the links between their
// ranks' places, and a hierarchical all-reduce of their native collectives takes its
// formula, 2 to 16 nodes of 8 ranks on nvlink + ib-ndr included. Overlap hides
// communication; two runs give the same clocks even when wall-clock timing is perturbed; the
// trace is valid Chrome Trace Event JSON.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "dp/clock.h"
#include "dp/error.h"
#include "dp/launch.h"
#include "dp/model.h"
#include "dp/trace.h"
#include "dp/trainer.h"

namespace dp {
namespace {

// A fabric with round numbers: alpha 2 us, 50 GB/s (the ib-ndr preset).
const NetworkModel kNet = NetworkModel::preset("ib-ndr");

LaunchOptions simulated(int ranks, NetworkModel network = kNet) {
  LaunchOptions options;
  options.world_size = ranks;
  options.simulation.enabled = true;
  options.simulation.network = std::move(network);
  return options;
}

/// Runs `rank_main` on `ranks` simulated ranks; returns the latest clock at the end.
double simulated_time(int ranks, const std::function<void(Communicator&)>& rank_main,
                      const NetworkModel& network = kNet) {
  std::vector<double> ends(static_cast<std::size_t>(ranks), 0.0);
  launch(simulated(ranks, network), [&](Communicator& comm) {
    rank_main(comm);
    ends[static_cast<std::size_t>(comm.rank())] = comm.clock().now();
  });
  return *std::max_element(ends.begin(), ends.end());
}

/// alpha + n / bandwidth: one message of `bytes` alone on its link.
double message(double bytes, const LinkModel& link = kNet.fabric) {
  return link.alpha_seconds + bytes / link.bytes_per_second;
}

/// n / bandwidth: how long a message of `bytes` holds the link.
double transfer(double bytes, const LinkModel& link = kNet.fabric) {
  return bytes / link.bytes_per_second;
}

int ceil_log2(int p) {
  int rounds = 0;
  while ((1 << rounds) < p) ++rounds;
  return rounds;
}

void expect_time(double actual, double expected, const std::string& what) {
  // Exact up to floating-point rounding of the sums.
  EXPECT_NEAR(actual, expected, 1e-12 * expected + 1e-18) << what;
}

float value_of(int rank, std::size_t index) {
  return static_cast<float>((rank + 1) * static_cast<int>(index % 5 + 1));
}

std::vector<float> rank_values(int rank, std::size_t count) {
  std::vector<float> values(count);
  for (std::size_t k = 0; k < count; ++k) values[k] = value_of(rank, k);
  return values;
}

/// Every element must be the sum over ranks (small integers: exact in float32); of large
/// buffers, every 17th element and the last (chunk boundaries are multiples of p <= 8).
void expect_sum(const std::vector<float>& values, int p) {
  const int rank_sum = p * (p + 1) / 2;
  const std::size_t stride = values.size() > (1u << 20) ? 17 : 1;
  for (std::size_t k = (values.size() + stride - 1) % stride; k < values.size(); k += stride)
    ASSERT_EQ(values[k], static_cast<float>(rank_sum * static_cast<int>(k % 5 + 1)))
        << "element " << k;
}

void add_into(std::span<float> into, std::span<const float> from) {
  for (std::size_t k = 0; k < into.size(); ++k) into[k] += from[k];
}

// --- The algorithms, from point-to-point messages only ----------------------------------

/// Ring all-reduce: a reduce-scatter and an all-gather of p-1 steps each; count % p == 0.
void ring_allreduce(Communicator& comm, std::vector<float>& data) {
  const int p = comm.size();
  const int r = comm.rank();
  const std::size_t chunk = data.size() / static_cast<std::size_t>(p);
  const auto part = [&](int index) {
    return std::span<float>(data).subspan(static_cast<std::size_t>((index % p + p) % p) * chunk,
                                          chunk);
  };
  std::vector<float> incoming(chunk);
  const int next = (r + 1) % p;
  const int previous = (r + p - 1) % p;
  for (int step = 0; step < p - 1; ++step) {
    auto send = comm.isend(part(r - step), next, 0);
    auto receive = comm.irecv(std::span(incoming), previous, 0);
    receive->wait();
    send->wait();
    add_into(part(r - step - 1), incoming);
  }
  for (int step = 0; step < p - 1; ++step) {
    auto send = comm.isend(part(r + 1 - step), next, 1);
    auto receive = comm.irecv(part(r - step), previous, 1);
    receive->wait();
    send->wait();
  }
}

/// Binomial-tree reduce to rank 0, then binomial-tree broadcast from rank 0 (any p).
void tree_allreduce(Communicator& comm, std::vector<float>& data) {
  const int p = comm.size();
  const int r = comm.rank();
  std::vector<float> incoming(data.size());
  for (int mask = 1; mask < p; mask <<= 1) {
    if ((r & mask) != 0) {
      comm.isend(std::span(data), r - mask, 0)->wait();
      break;
    }
    if (r + mask < p) {
      comm.irecv(std::span(incoming), r + mask, 0)->wait();
      add_into(data, incoming);
    }
  }
  int mask = 1;
  while (mask < p) {
    if ((r & mask) != 0) {
      comm.irecv(std::span(data), r - mask, 1)->wait();
      break;
    }
    mask <<= 1;
  }
  std::vector<std::unique_ptr<Work>> sends;
  for (mask >>= 1; mask > 0; mask >>= 1)
    if (r + mask < p) sends.push_back(comm.isend(std::span(data), r + mask, 1));
  for (auto& send : sends) send->wait();
}

/// Recursive doubling: lg p exchanges of the whole buffer (p a power of two).
void recursive_doubling_allreduce(Communicator& comm, std::vector<float>& data) {
  const int p = comm.size();
  const int r = comm.rank();
  std::vector<float> incoming(data.size());
  for (int mask = 1; mask < p; mask <<= 1) {
    const int partner = r ^ mask;
    auto send = comm.isend(std::span(data), partner, 0);
    auto receive = comm.irecv(std::span(incoming), partner, 0);
    receive->wait();
    send->wait();
    add_into(data, incoming);  // float addition commutes: both partners get the same bits
  }
}

/// Parameter server on rank 0: every worker pushes its buffer, the server sums them in
/// rank order and sends the sum back to every worker.
void parameter_server_allreduce(Communicator& comm, std::vector<float>& data) {
  const int p = comm.size();
  if (comm.rank() != 0) {
    auto push = comm.isend(std::span(data), 0, 0);
    auto pull = comm.irecv(std::span(data), 0, 1);
    push->wait();
    pull->wait();
    return;
  }
  std::vector<float> incoming(data.size());
  for (int worker = 1; worker < p; ++worker) {
    comm.irecv(std::span(incoming), worker, 0)->wait();
    add_into(data, incoming);
  }
  std::vector<std::unique_ptr<Work>> sends;
  for (int worker = 1; worker < p; ++worker)
    sends.push_back(comm.isend(std::span(data), worker, 1));
  for (auto& send : sends) send->wait();
}

enum class Algorithm { kRing, kTree, kRecursiveDoubling, kParameterServer };

const char* name_of(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::kRing: return "ring";
    case Algorithm::kTree: return "binomial tree";
    case Algorithm::kRecursiveDoubling: return "recursive doubling";
    case Algorithm::kParameterServer: return "parameter server";
  }
  return "?";
}

/// The closed form with gamma = 0, n in bytes, for p a power of two (the tree and recursive
/// doubling) or any p (the ring and the server).
///
/// The ring's p-1 steps of each phase wait for each other: 2(p-1) (alpha + n/p beta). The
/// tree's lg p rounds each way wait for each other too: 2 lg p (alpha + n beta) (its
/// broadcast's root sends its lg p messages back to back, and the child sent to first
/// has the deepest subtree). The server's pushes are an incast and its pulls an outcast:
/// the latencies overlap and only the bandwidth queues, 2 (alpha + (p-1) n beta), where a
/// model that let alpha hold the link would charge 2 (p-1) (alpha + n beta).
double formula(Algorithm algorithm, int p, double n) {
  switch (algorithm) {
    case Algorithm::kRing:
      return 2 * (p - 1) * kNet.fabric.alpha_seconds +
             2 * n * (p - 1) / p / kNet.fabric.bytes_per_second;
    case Algorithm::kTree: return 2 * ceil_log2(p) * message(n);
    case Algorithm::kRecursiveDoubling: return ceil_log2(p) * message(n);
    case Algorithm::kParameterServer: return 2 * message((p - 1) * n);
  }
  return 0;
}

void check_algorithm(Algorithm algorithm, int p, std::size_t count) {
  const double n = static_cast<double>(count * sizeof(float));
  const double seconds = simulated_time(p, [&](Communicator& comm) {
    std::vector<float> data = rank_values(comm.rank(), count);
    switch (algorithm) {
      case Algorithm::kRing: ring_allreduce(comm, data); break;
      case Algorithm::kTree: tree_allreduce(comm, data); break;
      case Algorithm::kRecursiveDoubling: recursive_doubling_allreduce(comm, data); break;
      case Algorithm::kParameterServer: parameter_server_allreduce(comm, data); break;
    }
    expect_sum(data, p);
  });
  expect_time(seconds, formula(algorithm, p, n),
              fmt::format("{} all-reduce, p = {}, n = {} bytes", name_of(algorithm), p, n));
}

class AlgorithmFormula : public ::testing::TestWithParam<int> {};

// Element counts are multiples of p (the ring's chunks are then equal): 4p bytes, about
// 4p KB and 4p MiB.
std::vector<std::size_t> counts_for(int p) {
  const auto q = static_cast<std::size_t>(p);
  return {q, 1000 * q, (std::size_t{1} << 20) * q};
}

TEST_P(AlgorithmFormula, RingAllReduce) {
  for (std::size_t count : counts_for(GetParam()))
    check_algorithm(Algorithm::kRing, GetParam(), count);
}

TEST_P(AlgorithmFormula, OneServerParameterServer) {
  for (std::size_t count : {std::size_t{1}, counts_for(GetParam())[1], counts_for(GetParam())[2]})
    check_algorithm(Algorithm::kParameterServer, GetParam(), count);
}

INSTANTIATE_TEST_SUITE_P(Ranks2To8, AlgorithmFormula, ::testing::Range(2, 9),
                         [](const auto& test) { return fmt::format("p{}", test.param); });

class PowerOfTwoFormula : public ::testing::TestWithParam<int> {};

TEST_P(PowerOfTwoFormula, RecursiveDoubling) {
  const int p = GetParam();
  for (std::size_t count : {std::size_t{1}, counts_for(p)[1], counts_for(p)[2]})
    check_algorithm(Algorithm::kRecursiveDoubling, p, count);
}

TEST_P(PowerOfTwoFormula, BinomialTreeReduceAndBroadcast) {
  const int p = GetParam();
  for (std::size_t count : {std::size_t{1}, counts_for(p)[1], counts_for(p)[2]})
    check_algorithm(Algorithm::kTree, p, count);
}

// Recursive doubling as written needs a power of two; so does the tree's closed form (with
// p = 2^k + r, the r extra ranks' messages share links with the others' and the rounds
// no longer wait for each other one by one: see BinomialTreeOtherSizes).
INSTANTIATE_TEST_SUITE_P(PowersOfTwo, PowerOfTwoFormula, ::testing::Values(2, 4, 8),
                         [](const auto& test) { return fmt::format("p{}", test.param); });

TEST(BinomialTreeOtherSizes, TakesBetweenTheRoundsOfTheNeighbouringPowersOfTwo) {
  for (int p : {3, 5, 6, 7}) {
    for (std::size_t count : {std::size_t{1}, std::size_t{1} << 16}) {
      const double one = message(static_cast<double>(count * sizeof(float)));
      const double seconds = simulated_time(p, [&](Communicator& comm) {
        std::vector<float> data = rank_values(comm.rank(), count);
        tree_allreduce(comm, data);
        expect_sum(data, p);
      });
      EXPECT_GE(seconds, 2 * (ceil_log2(p) - 1) * one * (1 - 1e-12)) << "p = " << p;
      EXPECT_LE(seconds, 2 * ceil_log2(p) * one * (1 + 1e-12)) << "p = " << p;
    }
  }
}

TEST(AlgorithmFormulaHuge, EveryAlgorithmAt256MiBOn8Ranks) {
  const std::size_t count = std::size_t{64} << 20;  // 256 MiB of float32, divisible by 8
  for (Algorithm algorithm : {Algorithm::kRing, Algorithm::kTree, Algorithm::kRecursiveDoubling,
                              Algorithm::kParameterServer})
    check_algorithm(algorithm, 8, count);
}

TEST(AlgorithmFormulaHuge, RingBeatsTheParameterServerByThePredictedFactor) {
  // At 8 ranks and 4 MiB the server's link carries 7 n each way, a ring link (7/8) n.
  const std::size_t count = std::size_t{1} << 20;
  const double ring = simulated_time(8, [&](Communicator& comm) {
    auto data = rank_values(comm.rank(), count);
    ring_allreduce(comm, data);
  });
  const double server = simulated_time(8, [&](Communicator& comm) {
    auto data = rank_values(comm.rank(), count);
    parameter_server_allreduce(comm, data);
  });
  const double n = static_cast<double>(count * sizeof(float));
  expect_time(server / ring,
              formula(Algorithm::kParameterServer, 8, n) / formula(Algorithm::kRing, 8, n),
              "speedup of the ring over the server");
  // Bandwidth terms alone would give p = 8; the ring's 14 latencies against the server's
  // 2 pull it down, to 6.7.
  EXPECT_GT(server / ring, 6.5);
  EXPECT_LT(server / ring, 7.0);
}

// --- Native collectives --------------------------------------------------------------------

/// What the native collectives of `expect_native_times` must take for n bytes on p ranks:
/// one step of the ring (n/p bytes a hop), the broadcast, the barrier.
struct NativeTimes {
  double ring_step;
  double broadcast;
  double barrier;
};

/// Every native collective on `p` ranks of `network` takes `expected(n)`'s times: ring
/// all-reduce 2(p-1) steps, ring reduce-scatter and all-gather p-1 steps, the broadcast and
/// the barrier as they are.
void expect_native_times(int p, const NetworkModel& network,
                         const std::function<NativeTimes(double)>& expected,
                         std::string_view where) {
  const std::size_t count = 1000 * static_cast<std::size_t>(p);
  const double n = static_cast<double>(count * sizeof(float));
  const NativeTimes times = expected(n);
  struct Case {
    const char* name;
    std::function<void(Communicator&)> call;
    double expected;
  };
  std::vector<Case> cases = {
      {"allreduce (ring)",
       [&](Communicator& comm) {
         std::vector<float> x(count, 1.0f);
         comm.allreduce(std::span(x), ReduceOp::kSum)->wait();
       },
       2 * (p - 1) * times.ring_step},
      {"reduce_scatter (ring)",
       [&](Communicator& comm) {
         std::vector<float> in(count, 1.0f);
         std::vector<float> out(count / static_cast<std::size_t>(p));
         comm.reduce_scatter(std::span(in), std::span(out), ReduceOp::kSum)->wait();
       },
       (p - 1) * times.ring_step},
      {"allgather (ring)",
       [&](Communicator& comm) {
         std::vector<float> in(count / static_cast<std::size_t>(p), 1.0f);
         std::vector<float> out(count);
         comm.allgather(std::span(in), std::span(out))->wait();
       },
       (p - 1) * times.ring_step},
      {"broadcast (binomial tree)",
       [&](Communicator& comm) {
         std::vector<float> x(count, 1.0f);
         comm.broadcast(std::span(x), 0)->wait();
       },
       times.broadcast},
      {"barrier (dissemination)", [&](Communicator& comm) { comm.barrier(); }, times.barrier},
  };
  for (const Case& c : cases)
    expect_time(simulated_time(p, c.call, network), c.expected,
                fmt::format("{} at p = {}, {}", c.name, p, where));
}

/// On one fabric (`link`): ring steps of alpha + n/p beta, binomial-tree broadcast
/// ceil(lg p) (alpha + n beta), dissemination barrier ceil(lg p) alpha.
NativeTimes flat_times(int p, const LinkModel& link, double n) {
  return {message(n / p, link), ceil_log2(p) * message(n, link), ceil_log2(p) * link.alpha_seconds};
}

TEST(NativeCollectives, AreChargedByTheirDocumentedAlgorithm) {
  for (int p : {1, 2, 3, 5, 8})
    expect_native_times(
        p, kNet, [&](double n) { return flat_times(p, kNet.fabric, n); }, "one fabric");
}

TEST(NativeCollectives, QueueBehindEachOtherOnTheLinks) {
  // Three async all-reduces issued at once run one after another.
  const std::size_t count = 1 << 16;
  const double one = 2 * 3 * message(static_cast<double>(count * sizeof(float)) / 4);
  const double seconds = simulated_time(4, [&](Communicator& comm) {
    std::vector<std::vector<float>> buffers(3, std::vector<float>(count, 1.0f));
    std::vector<std::unique_ptr<Work>> works;
    for (auto& buffer : buffers) works.push_back(comm.allreduce(std::span(buffer), ReduceOp::kSum));
    for (auto& work : works) work->wait();
  });
  expect_time(seconds, 3 * one, "three queued all-reduces");
}

TEST(NativeCollectives, StartWhenTheLastRankIssues) {
  // Rank 2 computes 1 ms before it joins: everyone finishes at 1 ms + the all-reduce.
  const std::size_t count = 4096;
  const double allreduce = 2 * 2 * message(static_cast<double>(count * sizeof(float)) / 3);
  std::vector<double> ends(3);
  launch(simulated(3), [&](Communicator& comm) {
    if (comm.rank() == 2) comm.clock().compute("late", 1e-3);
    std::vector<float> x(count, 1.0f);
    comm.allreduce(std::span(x), ReduceOp::kSum)->wait();
    ends[static_cast<std::size_t>(comm.rank())] = comm.clock().now();
  });
  for (double end : ends) expect_time(end, 1e-3 + allreduce, "all-reduce after a late rank");
}

// --- Point-to-point contention and topology ---------------------------------------------------

// Closed forms of the three patterns a parameter server and a tree are made of, each on
// a latency-bound and a bandwidth-bound message: alpha is paid by every message but the
// link queues only for the transfers.
const std::size_t kSmallCount = 16;       // 64 B: alpha is 2 us, the transfer 1.3 ns
const std::size_t kLargeCount = 1 << 18;  // 1 MiB: the transfer is 21 us, 10x alpha

/// Rank 0 exchanged a message of `n` bytes with each of ranks 1..7, all issued at time 0:
/// rank k's message must be done at k n beta + alpha, and rank 0 (`rank0`) at 7 n beta +
/// alpha.
void expect_queued_one_after_another(const std::vector<double>& ends, double n,
                                     std::string_view rank0) {
  for (int k = 1; k < 8; ++k)
    expect_time(ends[static_cast<std::size_t>(k)], k * transfer(n) + kNet.fabric.alpha_seconds,
                fmt::format("{} B: the message of rank {}", n, k));
  expect_time(ends[0], message(7 * n), fmt::format("{} B: {}", n, rank0));
}

TEST(PointToPoint, IncastSevenSendersOverlapTheirLatenciesAndQueueForTheBandwidth) {
  for (std::size_t count : {kSmallCount, kLargeCount}) {
    const double n = static_cast<double>(count * sizeof(float));
    std::vector<double> arrivals(8);
    launch(simulated(8), [&](Communicator& comm) {
      std::vector<float> x(count, 1.0f);
      if (comm.rank() != 0) {
        comm.isend(std::span(x), 0, 0)->wait();
        arrivals[static_cast<std::size_t>(comm.rank())] = comm.clock().now();
        return;
      }
      for (int sender = 1; sender < 8; ++sender) comm.irecv(std::span(x), sender, 0)->wait();
      arrivals[0] = comm.clock().now();
    });
    // Messages issued at the same time take the receiver's link in sender-rank order: the
    // k-th arrives at k n beta + alpha, the last at 7 n beta + alpha (a model in which
    // alpha held the link would give 7 (alpha + n beta): 7x too slow at 64 B).
    expect_queued_one_after_another(arrivals, n, "the receiver");
  }
}

TEST(PointToPoint, OutcastOneSenderToSevenQueuesOnItsLinkOnly) {
  for (std::size_t count : {kSmallCount, kLargeCount}) {
    const double n = static_cast<double>(count * sizeof(float));
    std::vector<double> ends(8);
    launch(simulated(8), [&](Communicator& comm) {
      std::vector<float> x(count, 1.0f);
      if (comm.rank() == 0) {
        std::vector<std::unique_ptr<Work>> sends;
        for (int receiver = 1; receiver < 8; ++receiver)
          sends.push_back(comm.isend(std::span<const float>(x), receiver, 0));
        for (auto& send : sends) send->wait();
      } else {
        comm.irecv(std::span(x), 0, 0)->wait();
      }
      ends[static_cast<std::size_t>(comm.rank())] = comm.clock().now();
    });
    expect_queued_one_after_another(ends, n, "the sender");
  }
}

TEST(PointToPoint, BinomialTreeBroadcastTakesLgPRoundsOfAlphaPlusTransfer) {
  // Each rank forwards to its children in order of decreasing subtree, back to back: the
  // i-th child of a rank that has the data at t gets it at t + i n beta + alpha, and the
  // first child's subtree is the deepest, so the last rank has it after
  // lg p (alpha + n beta), while the root is done when its own last message arrives,
  // lg p n beta + alpha.
  for (int p : {2, 4, 8}) {
    for (std::size_t count : {kSmallCount, kLargeCount}) {
      const double n = static_cast<double>(count * sizeof(float));
      std::vector<double> ends(static_cast<std::size_t>(p));
      launch(simulated(p), [&](Communicator& comm) {
        const int r = comm.rank();
        std::vector<float> x(count, r == 0 ? 1.0f : 0.0f);
        int mask = 1;
        while (mask < p && (r & mask) == 0) mask <<= 1;
        if (r != 0) comm.irecv(std::span(x), r - mask, 0)->wait();
        std::vector<std::unique_ptr<Work>> sends;
        for (mask >>= 1; mask > 0; mask >>= 1)
          sends.push_back(comm.isend(std::span<const float>(x), r + mask, 0));
        for (auto& send : sends) send->wait();
        EXPECT_EQ(x[count - 1], 1.0f);
        ends[static_cast<std::size_t>(r)] = comm.clock().now();
      });
      const int rounds = ceil_log2(p);
      expect_time(*std::max_element(ends.begin(), ends.end()), rounds * message(n),
                  fmt::format("p = {}, {} B: the last rank", p, n));
      expect_time(ends[0], message(rounds * n), fmt::format("p = {}, {} B: the root", p, n));
    }
  }
}

TEST(PointToPoint, AReceivePostedLateCompletesWhenPosted) {
  std::vector<double> ends(2);
  launch(simulated(2), [&](Communicator& comm) {
    std::vector<float> x(256, 1.0f);
    if (comm.rank() == 0) {
      comm.isend(std::span(x), 1, 0)->wait();
    } else {
      comm.clock().compute("busy", 1e-3);
      comm.irecv(std::span(x), 0, 0)->wait();
    }
    ends[static_cast<std::size_t>(comm.rank())] = comm.clock().now();
  });
  expect_time(ends[0], message(1024), "the send ends when the message has crossed");
  expect_time(ends[1], 1e-3, "the receive completes when posted (the message is there)");
}

TEST(PointToPoint, AMessageWaitingForABusyReceiverDoesNotHoldBackItsSendersOthers) {
  // Rank 2 sends 1 MiB to rank 1 at time 0. At 1 us rank 0 sends 4 KiB to rank 1, which
  // must wait for the big transfer, then 4 KiB to rank 3, whose link is idle: that one
  // goes at once (the sender's link is free), and arrives 1 us + n beta + alpha.
  const double big = 1 << 20;
  const double small = 4096;
  std::vector<double> ends(4);
  launch(simulated(4), [&](Communicator& comm) {
    std::vector<std::uint8_t> large(static_cast<std::size_t>(big));
    std::vector<std::uint8_t> little(static_cast<std::size_t>(small));
    const MutableBuffer large_buffer(large.data(), large.size(), DataType::kUInt8);
    const MutableBuffer little_buffer(little.data(), little.size(), DataType::kUInt8);
    switch (comm.rank()) {
      case 0: {
        comm.clock().compute("first", 1e-6);
        auto blocked = comm.isend(little_buffer, 1, 0);
        auto free = comm.isend(little_buffer, 3, 0);
        free->wait();
        ends[0] = comm.clock().now();
        blocked->wait();
        break;
      }
      case 1: {
        std::vector<std::uint8_t> other(little.size());
        auto from_two = comm.irecv(large_buffer, 2, 0);
        comm.irecv(MutableBuffer(other.data(), other.size(), DataType::kUInt8), 0, 0)->wait();
        ends[1] = comm.clock().now();
        from_two->wait();
        break;
      }
      case 2: comm.isend(large_buffer, 1, 0)->wait(); break;
      case 3:
        comm.irecv(little_buffer, 0, 0)->wait();
        ends[3] = comm.clock().now();
        break;
    }
  });
  expect_time(ends[3], 1e-6 + message(small), "the message to the idle rank");
  expect_time(ends[0], 1e-6 + message(small), "its send");
  expect_time(ends[1], transfer(big) + message(small), "the message behind the big one");
}

TEST(PointToPoint, ASendDoesNotWaitForItsReceiveToBePosted) {
  // Rank 1's send is complete at alpha + n beta, as the network model says, although rank
  // 0 posts the matching receive only after 1 ms and a send of its own: its wait() returns
  // without it. (With sends that waited for their receive, rank 0 would wait for the
  // virtual time of its send, which waits for rank 1's next calls, which wait for rank
  // 0's receive: a deadlock that only the simulation made.)
  const double one = message(1024);
  std::vector<double> ends(2);
  launch(simulated(2), [&](Communicator& comm) {
    std::vector<float> mine(256, 1.0f);
    std::vector<float> theirs(256);
    if (comm.rank() == 1) {
      auto receive = comm.irecv(std::span(theirs), 0, /*tag=*/2);
      comm.isend(std::span<const float>(mine), 0, /*tag=*/1)->wait();
      ends[1] = comm.clock().now();
      receive->wait();
    } else {
      comm.clock().compute("busy", 1e-3);
      comm.isend(std::span<const float>(mine), 1, /*tag=*/2)->wait();
      comm.irecv(std::span(theirs), 1, /*tag=*/1)->wait();
      EXPECT_EQ(theirs[255], 1.0f);
      ends[0] = comm.clock().now();
    }
  });
  expect_time(ends[1], one, "the send, complete on arrival");
  expect_time(ends[0], 1e-3 + one, "the late receive, complete when posted");
}

TEST(PointToPoint, TwoLevelTopologyUsesTheFabricOfEachPair) {
  NetworkModel network = NetworkModel::preset("100gbe");
  network.fabric = NetworkModel::preset("nvlink").fabric;
  network.ranks_per_node = 2;
  const double n = 1 << 20;
  std::vector<double> ends(4);
  std::vector<TraceLane> lanes_of_rank0;
  launch(simulated(4, network), [&](Communicator& comm) {
    std::vector<std::uint8_t> x(static_cast<std::size_t>(n));
    std::vector<std::uint8_t> y(static_cast<std::size_t>(n));
    const MutableBuffer buffer(x.data(), x.size(), DataType::kUInt8);
    const MutableBuffer other(y.data(), y.size(), DataType::kUInt8);
    // 0 -> 1 inside node 0, 2 -> 0 across nodes; rank 3 idles.
    if (comm.rank() == 1) comm.irecv(buffer, 0, 0)->wait();
    if (comm.rank() == 2) comm.isend(buffer, 0, 0)->wait();
    if (comm.rank() == 0) {
      auto within = comm.isend(buffer, 1, 0);
      auto across = comm.irecv(other, 2, 0);
      within->wait();
      across->wait();
    }
    ends[static_cast<std::size_t>(comm.rank())] = comm.clock().now();
    if (comm.rank() == 0)
      for (const TraceEvent& event : comm.clock().trace().events)
        lanes_of_rank0.push_back(event.lane);
  });
  // The two ports of rank 0 are busy at the same time: separate trace threads.
  EXPECT_EQ(lanes_of_rank0,
            (std::vector<TraceLane>{TraceLane::kSend, TraceLane::kInterNodeReceive}));
  expect_time(ends[1], message(n, network.fabric), "within a node: the fast fabric");
  expect_time(ends[2], message(n, network.inter_node), "across nodes: the slow fabric");
  EXPECT_EQ(ends[3], 0.0);
  // A flat ring over both nodes is paced by its slowest hop.
  const double ring = simulated_time(
      4,
      [&](Communicator& comm) {
        std::vector<float> x(1024, 1.0f);
        comm.allreduce(std::span(x), ReduceOp::kSum)->wait();
      },
      network);
  expect_time(ring, 2 * 3 * message(4096.0 / 4, network.inter_node), "two-level ring");
}

// --- Two levels: the closed forms of "Two levels" in dp/clock.h -------------------------------

/// `nodes` x `ranks_per_node` ranks: NVLink inside a node, 100 GbE between nodes, `nics`
/// NICs per node (0: one per rank).
NetworkModel two_levels(int ranks_per_node, int nics = 0) {
  NetworkModel network = NetworkModel::preset("100gbe");
  network.fabric = NetworkModel::preset("nvlink").fabric;
  network.ranks_per_node = ranks_per_node;
  network.nics_per_node = nics;
  return network;
}

/// The time of one step of a ring whose hops cross both fabrics: its slowest hop.
double slowest_hop(double bytes, const NetworkModel& network) {
  return std::max(message(bytes, network.fabric), message(bytes, network.inter_node));
}

TEST(TwoLevels, AMessageTakesAlphaPlusNOverBandwidthOfItsPairsFabric) {
  const NetworkModel network = two_levels(2);
  // Every ordered pair of 2 nodes x 2 ranks, alone on the network, latency- and
  // bandwidth-bound: inside a node NVLink's alpha and bandwidth, across nodes 100 GbE's.
  for (double n : {64.0, double(1 << 20)}) {
    for (int from = 0; from < 4; ++from) {
      for (int to = 0; to < 4; ++to) {
        if (from == to) continue;
        std::vector<double> ends(4);
        launch(simulated(4, network), [&](Communicator& comm) {
          std::vector<std::uint8_t> x(static_cast<std::size_t>(n));
          const MutableBuffer buffer(x.data(), x.size(), DataType::kUInt8);
          if (comm.rank() == from) comm.isend(buffer, to, 0)->wait();
          if (comm.rank() == to) comm.irecv(buffer, from, 0)->wait();
          ends[static_cast<std::size_t>(comm.rank())] = comm.clock().now();
        });
        const bool across = from / 2 != to / 2;
        const LinkModel& link = across ? network.inter_node : network.fabric;
        const std::string what =
            fmt::format("{} B from {} to {} ({})", n, from, to, across ? "across nodes" : "inside");
        EXPECT_EQ(network.crosses_nodes(from, to), across) << what;
        expect_time(ends[static_cast<std::size_t>(from)], message(n, link), what + ": the send");
        expect_time(ends[static_cast<std::size_t>(to)], message(n, link), what + ": the receive");
      }
    }
  }
}

TEST(TwoLevels, RanksOfANodeShareItsNicsAndQueueForThem) {
  // 2 nodes x 4 ranks; rank l of node 0 sends n bytes to rank l of node 1, all at time 0.
  // With m NICs, rank l uses NIC l mod m (both nodes), the 4/m ranks of one NIC take it in
  // rank order: rank l's message arrives at (l / m + 1) n / bandwidth + alpha, the last at
  // (4/m) n / bandwidth + alpha: 4 n / bw + alpha through 1 NIC, n / bw + alpha through 4.
  // Meanwhile node 0's ranks 0 and 1 also exchange n bytes over NVLink, untouched by the
  // NICs' queues (a rank's two ports are independent).
  const int k = 4;
  for (double n : {64.0, double(1 << 20)}) {
    for (int nics : {1, 2, 4, 0}) {
      const NetworkModel network = two_levels(k, nics);
      const int m = nics == 0 ? k : nics;
      std::vector<double> ends(2 * k);
      std::vector<double> intra_ends(2);
      launch(simulated(2 * k, network), [&](Communicator& comm) {
        std::vector<std::uint8_t> x(static_cast<std::size_t>(n));
        std::vector<std::uint8_t> y(static_cast<std::size_t>(n));
        const MutableBuffer buffer(x.data(), x.size(), DataType::kUInt8);
        const MutableBuffer local(y.data(), y.size(), DataType::kUInt8);
        const int r = comm.rank();
        std::unique_ptr<Work> inside;
        if (r == 0) inside = comm.isend(local, 1, 7);
        if (r == 1) inside = comm.irecv(local, 0, 7);
        auto across = r < k ? comm.isend(buffer, r + k, 0) : comm.irecv(buffer, r - k, 0);
        if (inside) {
          inside->wait();
          intra_ends[static_cast<std::size_t>(r)] = comm.clock().now();
        }
        across->wait();
        ends[static_cast<std::size_t>(r)] = comm.clock().now();
      });
      for (double end : intra_ends)
        expect_time(end, message(n, network.fabric),
                    fmt::format("{} B, {} NICs per node: NVLink beside the NICs", n, m));
      for (int l = 0; l < k; ++l) {
        const double expected =
            (l / m + 1) * transfer(n, network.inter_node) + network.inter_node.alpha_seconds;
        const std::string what =
            fmt::format("{} B, {} NICs per node: rank {} of the node", n, m, l);
        expect_time(ends[static_cast<std::size_t>(l)], expected, what + " (sender)");
        expect_time(ends[static_cast<std::size_t>(l + k)], expected, what + " (receiver)");
      }
      const double last = *std::max_element(ends.begin(), ends.end());
      expect_time(last,
                  (k / m) * transfer(n, network.inter_node) + network.inter_node.alpha_seconds,
                  fmt::format("{} B through {} NICs: the last", n, m));
    }
  }
}

TEST(TwoLevels, ARingOfMessagesStepsAtThePaceOfItsSlowestHop) {
  // The ring all-reduce of AlgorithmFormula, from isend/irecv over node-contiguous ranks:
  // each of its 2(p-1) steps waits for the previous one, and the rank before the slowest hop
  // takes that hop's alpha + n/p beta every step, so the ring takes 2(p-1) times the slowest
  // hop. Its hops across nodes are one per node and direction, so one NIC per node is
  // enough: the NIC count does not change it.
  struct Topology {
    int nodes;
    int ranks_per_node;
    int nics;
  };
  for (const Topology& topology :
       {Topology{2, 2, 0}, Topology{2, 2, 1}, Topology{2, 4, 1}, Topology{4, 2, 0}}) {
    const NetworkModel network = two_levels(topology.ranks_per_node, topology.nics);
    const int p = topology.nodes * topology.ranks_per_node;
    for (std::size_t count : counts_for(p)) {
      if (count > 100000 * static_cast<std::size_t>(p)) continue;  // 4p MiB: the first test's
      const double n = static_cast<double>(count * sizeof(float));
      const double seconds = simulated_time(
          p,
          [&](Communicator& comm) {
            std::vector<float> data = rank_values(comm.rank(), count);
            ring_allreduce(comm, data);
            expect_sum(data, p);
          },
          network);
      expect_time(seconds, 2 * (p - 1) * slowest_hop(n / p, network),
                  fmt::format("ring over {} nodes x {} ranks, {} NICs per node, n = {} B",
                              topology.nodes, topology.ranks_per_node, topology.nics, n));
    }
  }
  // Which hop is slowest depends on the size: with a 20 us NVLink, small chunks are paced
  // by the NVLink hops (20 us against 10 us) and 4 MiB chunks by 100 GbE's (335 us
  // against 29 us); a model charging the inter-node fabric alone would miss the first.
  NetworkModel slow_start = two_levels(2);
  slow_start.fabric.alpha_seconds = 20e-6;
  for (std::size_t count : {std::size_t{4}, std::size_t{4} << 20}) {
    const double n = static_cast<double>(count * sizeof(float));
    const double seconds = simulated_time(
        4,
        [&](Communicator& comm) {
          std::vector<float> data = rank_values(comm.rank(), count);
          ring_allreduce(comm, data);
          expect_sum(data, 4);
        },
        slow_start);
    expect_time(seconds, 6 * slowest_hop(n / 4, slow_start),
                fmt::format("ring with a 20 us NVLink, n = {} B", n));
  }
}

/// Part `index` (mod the group's size) of `data` cut into one equal part per group member.
std::span<float> group_part(std::span<float> data, std::size_t members, int index) {
  const int g = static_cast<int>(members);
  const std::size_t chunk = data.size() / members;
  return data.subspan(static_cast<std::size_t>((index % g + g) % g) * chunk, chunk);
}

/// The ring reduce-scatter of `ring_allreduce` over `group` (ranks in ring order, the
/// caller among them): afterwards the member at index i holds the group's sum of part
/// i + 1 (mod the group's size).
void group_reduce_scatter(Communicator& comm, const std::vector<int>& group, std::span<float> data,
                          int tag) {
  const int g = static_cast<int>(group.size());
  const int i =
      static_cast<int>(std::find(group.begin(), group.end(), comm.rank()) - group.begin());
  std::vector<float> incoming(data.size() / group.size());
  for (int step = 0; step < g - 1; ++step) {
    auto send = comm.isend(group_part(data, group.size(), i - step),
                           group[static_cast<std::size_t>((i + 1) % g)], tag);
    auto receive =
        comm.irecv(std::span(incoming), group[static_cast<std::size_t>((i + g - 1) % g)], tag);
    receive->wait();
    send->wait();
    add_into(group_part(data, group.size(), i - step - 1), incoming);
  }
}

/// The ring all-gather of `ring_allreduce` over `group`, from the parts that
/// `group_reduce_scatter` leaves.
void group_allgather(Communicator& comm, const std::vector<int>& group, std::span<float> data,
                     int tag) {
  const int g = static_cast<int>(group.size());
  const int i =
      static_cast<int>(std::find(group.begin(), group.end(), comm.rank()) - group.begin());
  for (int step = 0; step < g - 1; ++step) {
    auto send = comm.isend(group_part(data, group.size(), i + 1 - step),
                           group[static_cast<std::size_t>((i + 1) % g)], tag);
    auto receive = comm.irecv(group_part(data, group.size(), i - step),
                              group[static_cast<std::size_t>((i + g - 1) % g)], tag);
    receive->wait();
    send->wait();
  }
}

/// Hierarchical all-reduce over nodes of `k` ranks: a ring reduce-scatter inside the node,
/// a ring all-reduce of the node's part across the nodes (among the ranks with the same
/// index in their node), a ring all-gather inside the node.
void hierarchical_allreduce(Communicator& comm, std::vector<float>& data, int k) {
  const int node = comm.rank() / k;
  const int local = comm.rank() % k;
  const int nodes = comm.size() / k;
  std::vector<int> inside;
  std::vector<int> across;
  for (int j = 0; j < k; ++j) inside.push_back(node * k + j);
  for (int m = 0; m < nodes; ++m) across.push_back(m * k + local);
  group_reduce_scatter(comm, inside, data, 0);
  const std::span<float> shard = group_part(data, inside.size(), local + 1);
  group_reduce_scatter(comm, across, shard, 1);
  group_allgather(comm, across, shard, 2);
  group_allgather(comm, inside, data, 3);
}

TEST(TwoLevels, AHierarchicalAllReduceOfMessagesTakesItsFormula) {
  // N nodes of k ranks, a NIC per rank: the phases follow each other, and in each all
  // hops cross one fabric, so 2(k-1) (alpha_f + n/k / bw_f) inside the nodes plus
  // 2(N-1) (alpha_i + n/(kN) / bw_i) across them.
  struct Topology {
    int nodes;
    int ranks_per_node;
  };
  for (const Topology& topology :
       {Topology{2, 2}, Topology{2, 4}, Topology{4, 2}, Topology{3, 2}}) {
    const int k = topology.ranks_per_node;
    const int nodes = topology.nodes;
    const int p = nodes * k;
    const NetworkModel network = two_levels(k);
    for (std::size_t count : counts_for(p)) {
      if (count > 100000 * static_cast<std::size_t>(p)) continue;
      const double n = static_cast<double>(count * sizeof(float));
      const double seconds = simulated_time(
          p,
          [&](Communicator& comm) {
            std::vector<float> data = rank_values(comm.rank(), count);
            hierarchical_allreduce(comm, data, k);
            expect_sum(data, p);
          },
          network);
      const double expected = 2 * (k - 1) * message(n / k, network.fabric) +
                              2 * (nodes - 1) * message(n / (k * nodes), network.inter_node);
      expect_time(
          seconds, expected,
          fmt::format("hierarchical all-reduce over {} nodes x {} ranks, n = {} B", nodes, k, n));
    }
  }
}

TEST(TwoLevels, NativeCollectivesAreChargedByWhereTheirRanksAre) {
  // NVLink inside a node, 100 GbE between (alpha 1 and 10 us): a ring spanning nodes steps
  // at its slowest hop, 100 GbE's at these sizes (4 KB a hop); a broadcast spends its
  // rounds across nodes on 100 GbE and the rest on NVLink (from rank 0 the first lg N
  // rounds cross nodes, the last lg k stay inside them); a barrier spanning nodes takes
  // ceil(lg p) alpha_i (a rank last in its node sends across nodes every round). Inside
  // one node: NVLink's flat formulas. The NIC count changes none of them.
  struct Case {
    int p;
    int ranks_per_node;
    int nics;
    int broadcast_rounds_across;  // the rest inside nodes
  };
  for (const Case& c : {Case{4, 2, 0, 1}, Case{4, 2, 1, 1}, Case{8, 4, 1, 1}, Case{8, 4, 2, 1},
                        Case{8, 2, 0, 2}, Case{6, 2, 0, 2}, Case{3, 4, 0, 0}, Case{4, 4, 1, 0}}) {
    const NetworkModel network = two_levels(c.ranks_per_node, c.nics);
    const bool spans_nodes = c.p > c.ranks_per_node;
    EXPECT_EQ(&network.slowest_link(c.p), spans_nodes ? &network.inter_node : &network.fabric);
    const auto expected = [&](double n) {
      if (!spans_nodes) return flat_times(c.p, network.fabric, n);
      const int rounds = ceil_log2(c.p);
      return NativeTimes{
          std::max(message(n / c.p, network.fabric), message(n / c.p, network.inter_node)),
          c.broadcast_rounds_across * message(n, network.inter_node) +
              (rounds - c.broadcast_rounds_across) * message(n, network.fabric),
          rounds * network.inter_node.alpha_seconds};
    };
    expect_native_times(c.p, network, expected,
                        fmt::format("{} ranks, {} per node, {} NICs per node", c.p,
                                    c.ranks_per_node, c.nics == 0 ? c.ranks_per_node : c.nics));
  }
}

/// The binomial-tree broadcast of PointToPoint.BinomialTreeBroadcastTakesLgPRoundsOfAlphaPlus-
/// Transfer from `root`, from messages: each rank receives from its parent, then sends to its
/// children largest subtree first, back to back.
void tree_broadcast(Communicator& comm, std::span<float> data, int root) {
  const int p = comm.size();
  const int relative = (comm.rank() - root + p) % p;
  int mask = 1;
  while (mask < p && (relative & mask) == 0) mask <<= 1;
  if (relative != 0) comm.irecv(data, (relative - mask + root) % p, 0)->wait();
  std::vector<std::unique_ptr<Work>> sends;
  for (mask >>= 1; mask > 0; mask >>= 1)
    if (relative + mask < p)
      sends.push_back(comm.isend(std::span<const float>(data), (relative + mask + root) % p, 0));
  for (auto& send : sends) send->wait();
}

/// A dissemination barrier from empty messages: in round i each rank sends to the rank 2^i
/// after it and receives from the one 2^i before it, and waits for both.
void dissemination_barrier(Communicator& comm) {
  const int p = comm.size();
  const int r = comm.rank();
  std::vector<float> none;
  for (int distance = 1; distance < p; distance *= 2) {
    auto send = comm.isend(std::span<const float>(none), (r + distance) % p, 1);
    auto receive = comm.irecv(std::span(none), (r - distance + p) % p, 1);
    receive->wait();
    send->wait();
  }
}

TEST(TwoLevels, NativeCollectivesTakeWhatTheirAlgorithmsTakeFromMessages) {
  // The native collectives are charged what the same algorithms built from isend/irecv
  // take: the ring at its slowest hop, also when a 20 us NVLink makes the intra-node hop the
  // slowest for small chunks (a charge of the inter-node fabric alone, by layout, missed
  // it); the tree over nodes of k ranks from a node's first rank; the dissemination barrier
  // on any layout, also with that NVLink.
  NetworkModel slow_nvlink = two_levels(2);
  slow_nvlink.fabric.alpha_seconds = 20e-6;
  struct Topology {
    int nodes;
    int ranks_per_node;
    bool slow_nvlink;
  };
  for (const Topology& t : {Topology{2, 2, false}, Topology{2, 4, false}, Topology{4, 2, false},
                            Topology{2, 2, true}, Topology{3, 2, true}}) {
    NetworkModel network = two_levels(t.ranks_per_node);
    if (t.slow_nvlink) network.fabric = slow_nvlink.fabric;
    const int p = t.nodes * t.ranks_per_node;
    const std::string where = fmt::format("{} nodes x {} ranks{}", t.nodes, t.ranks_per_node,
                                          t.slow_nvlink ? ", 20 us NVLink" : "");
    for (std::size_t count : {static_cast<std::size_t>(p), static_cast<std::size_t>(p) << 15}) {
      const auto both = [&](const std::function<void(Communicator&)>& messages,
                            const std::function<void(Communicator&)>& native,
                            const std::string& what) {
        expect_time(simulated_time(p, native, network), simulated_time(p, messages, network),
                    fmt::format("{} of {} floats, {}", what, count, where));
      };
      both(
          [&](Communicator& comm) {
            std::vector<float> data = rank_values(comm.rank(), count);
            ring_allreduce(comm, data);
          },
          [&](Communicator& comm) {
            std::vector<float> data = rank_values(comm.rank(), count);
            comm.allreduce(std::span(data), ReduceOp::kSum)->wait();
          },
          "ring all-reduce");
      // A node's first rank as the root: rank 0 and the first rank of the last node.
      for (int root : {0, p - t.ranks_per_node}) {
        const bool powers_of_two = (t.nodes & (t.nodes - 1)) == 0;
        if (!powers_of_two) continue;  // there the native rounds are an upper bound
        both(
            [&](Communicator& comm) {
              std::vector<float> data(count);
              tree_broadcast(comm, data, root);
            },
            [&](Communicator& comm) {
              std::vector<float> data(count);
              comm.broadcast(std::span(data), root)->wait();
            },
            fmt::format("broadcast from rank {}", root));
      }
    }
    expect_time(simulated_time(
                    p, [](Communicator& comm) { comm.barrier(); }, network),
                simulated_time(p, dissemination_barrier, network), "barrier, " + where);
  }
}

// --- Two levels: communicators split from the launch's -----------------------------------------

/// 2(k-1) (alpha_f + n/k / bw_f) + 2(N-1) (alpha_i + n/(kN) / bw_i): a hierarchical
/// all-reduce of n bytes over N nodes of k ranks, a NIC per rank.
double hierarchical_formula(int nodes, int k, double n, const NetworkModel& network) {
  return 2 * (k - 1) * message(n / k, network.fabric) +
         2 * (nodes - 1) * message(n / (k * nodes), network.inter_node);
}

/// The communicators of a hierarchical algorithm over nodes of `k` ranks, split from
/// `comm`: the ranks of this rank's node, and the ranks with its index in every node.
struct NodeAndAcross {
  std::unique_ptr<Communicator> node;
  std::unique_ptr<Communicator> across;
};

NodeAndAcross split_by_node(Communicator& comm, int k) {
  NodeAndAcross split;
  split.node = comm.split(comm.rank() / k, comm.rank());
  split.across = comm.split(comm.rank() % k, comm.rank());
  return split;
}

/// Hierarchical all-reduce from the native collectives of split communicators: a
/// reduce-scatter inside the node (each rank keeps 1/k of its node's sum), an all-reduce of
/// that part across the nodes (among the ranks with the same index), an all-gather inside
/// the node. data.size() must be a multiple of the node's size.
void hierarchical_allreduce_on_splits(Communicator& node, Communicator& across,
                                      std::vector<float>& data) {
  std::vector<float> part(data.size() / static_cast<std::size_t>(node.size()));
  node.reduce_scatter(std::span<const float>(data), std::span(part), ReduceOp::kSum)->wait();
  across.allreduce(std::span(part), ReduceOp::kSum)->wait();
  node.allgather(std::span<const float>(part), std::span(data))->wait();
}

TEST(TwoLevels, SplitCommunicatorsTalkOverTheLinksBetweenTheirRanksPlaces) {
  // 2 nodes x 4 ranks. A split is charged as a barrier over the communicator split (every
  // rank waits for all): two splits of the launch's 8 ranks, 2 x 3 alpha_i. Then, at once,
  // rank 0 of each node sends to rank 1 of its node over NVLink (ranks 0 and 1 of the
  // node's communicator are ranks 4j and 4j+1 of the launch), and each rank of node 0 sends
  // to the rank of its index in node 1 over 100 GbE (ranks 0 and 1 of the communicator
  // across nodes are ranks l and 4 + l of the launch, in two nodes).
  const int k = 4;
  const NetworkModel network = two_levels(k);
  const double n = 1 << 16;
  const double after_splits = 2 * 3 * network.inter_node.alpha_seconds;
  launch(simulated(2 * k, network), [&](Communicator& comm) {
    auto [node, across] = split_by_node(comm, k);
    expect_time(comm.clock().now(), after_splits, "after the two splits");
    std::vector<std::uint8_t> x(static_cast<std::size_t>(n));
    const MutableBuffer buffer(x.data(), x.size(), DataType::kUInt8);
    std::vector<std::uint8_t> y(static_cast<std::size_t>(n));
    const MutableBuffer other(y.data(), y.size(), DataType::kUInt8);
    // Both issued at once: a rank's two ports are independent.
    std::unique_ptr<Work> inside;
    if (node->rank() < 2)
      inside = node->rank() == 0 ? node->isend(buffer, 1, 0) : node->irecv(buffer, 0, 0);
    auto between = across->rank() == 0 ? across->isend(other, 1, 0) : across->irecv(other, 0, 0);
    if (inside) {
      inside->wait();
      expect_time(comm.clock().now(), after_splits + message(n, network.fabric),
                  fmt::format("rank {}: a message inside its node", comm.rank()));
    }
    between->wait();
    expect_time(comm.clock().now(), after_splits + message(n, network.inter_node),
                fmt::format("rank {}: a message across nodes", comm.rank()));
  });
}

TEST(TwoLevels, CollectivesOfSplitCommunicatorsAreChargedByWhereTheirRanksAre) {
  // 2 nodes x 4 ranks, 16 KiB. Both nodes all-reduce at once on NVLink, each in
  // 2 (k-1) (alpha_f + n/k / bw_f); then the 4 communicators across nodes all-reduce at once
  // in 2 (N-1) (alpha_i + n/N / bw_i) with a NIC per rank, while through one NIC per node
  // they take it in turn (they hold the NICs): the one of index l ends (l+1) times later.
  // Then a broadcast across the 2 nodes (one round on 100 GbE) and a barrier inside a node
  // (2 rounds of NVLink's alpha).
  const int k = 4;
  const int nodes = 2;
  const std::size_t count = 4096;
  const double n = static_cast<double>(count * sizeof(float));
  for (int nics : {0, 1}) {
    const NetworkModel network = two_levels(k, nics);
    launch(simulated(nodes * k, network), [&](Communicator& comm) {
      auto [node, across] = split_by_node(comm, k);
      const double start = comm.clock().now();
      const std::string where =
          fmt::format("rank {}, {} NICs per node", comm.rank(), nics == 0 ? k : nics);
      std::vector<float> data = rank_values(comm.rank(), count);
      node->allreduce(std::span(data), ReduceOp::kSum)->wait();
      const double inside = 2 * (k - 1) * message(n / k, network.fabric);
      expect_time(comm.clock().now() - start, inside, where + ": all-reduce inside the node");
      across->allreduce(std::span(data), ReduceOp::kSum)->wait();
      const double between = 2 * (nodes - 1) * message(n / nodes, network.inter_node);
      const int turn = nics == 0 ? 1 : node->rank() + 1;
      expect_time(comm.clock().now() - start, inside + turn * between,
                  where + ": all-reduce across nodes");
      expect_sum(data, nodes * k);
      const double before_broadcast = comm.clock().now();
      across->broadcast(std::span(data), 1)->wait();
      node->barrier();
      if (nics == 0)
        expect_time(comm.clock().now() - before_broadcast,
                    message(n, network.inter_node) + 2 * network.fabric.alpha_seconds,
                    where + ": broadcast across nodes, barrier inside");
    });
  }
}

TEST(TwoLevels, AHierarchicalAllReduceOnSplitCommunicatorsTakesItsFormula) {
  // As the hierarchical all-reduce of messages above, from the native collectives of the
  // communicators split by node and by index in the node: the same formula with a NIC per
  // rank. With m NICs per node the k all-reduces across nodes hold the NICs they use, so
  // those of one NIC take turns: k/m of them one after another, (k/m) 2(N-1) (alpha_i +
  // n/(kN) / bw_i) for the phase across nodes.
  struct Topology {
    int nodes;
    int ranks_per_node;
    int nics;
  };
  for (const Topology& topology :
       {Topology{2, 2, 0}, Topology{2, 4, 0}, Topology{4, 2, 0}, Topology{3, 2, 0},
        Topology{2, 2, 1}, Topology{2, 4, 1}, Topology{2, 4, 2}, Topology{3, 2, 1}}) {
    const int k = topology.ranks_per_node;
    const int nodes = topology.nodes;
    const int p = nodes * k;
    const int turns = topology.nics == 0 ? 1 : k / topology.nics;
    const NetworkModel network = two_levels(k, topology.nics);
    for (std::size_t count : counts_for(p)) {
      if (count > 100000 * static_cast<std::size_t>(p)) continue;
      const double n = static_cast<double>(count * sizeof(float));
      std::vector<double> took(static_cast<std::size_t>(p));
      launch(simulated(p, network), [&](Communicator& comm) {
        auto [node, across] = split_by_node(comm, k);
        const double start = comm.clock().now();
        std::vector<float> data = rank_values(comm.rank(), count);
        hierarchical_allreduce_on_splits(*node, *across, data);
        expect_sum(data, p);
        took[static_cast<std::size_t>(comm.rank())] = comm.clock().now() - start;
      });
      const double expected =
          2 * (k - 1) * message(n / k, network.fabric) +
          turns * 2 * (nodes - 1) * message(n / (k * nodes), network.inter_node);
      if (topology.nics == 0)
        expect_time(expected, hierarchical_formula(nodes, k, n, network), "the formula");
      expect_time(*std::max_element(took.begin(), took.end()), expected,
                  fmt::format("hierarchical all-reduce on split communicators, {} nodes x {} "
                              "ranks, {} NICs per node, n = {} B",
                              nodes, k, topology.nics == 0 ? k : topology.nics, n));
    }
  }
}

TEST(TwoLevels, HierarchicalAllReduceOf2To16NodesOf8RanksOnNvlinkAndIbNdr) {
  // The hierarchical all-reduce on split communicators against its formula for 2, 4, 8 and
  // 16 nodes of 8 ranks (NVLink inside the nodes, InfiniBand NDR between them, a NIC per
  // GPU as on a DGX), 1 MiB per rank; beside it the flat ring's formula (its slowest hop is
  // NDR's) and the ratio. Printed as a table.
  const int k = 8;
  const std::size_t count = std::size_t{1} << 18;  // 1 MiB of float32
  const double n = static_cast<double>(count * sizeof(float));
  NetworkModel network = NetworkModel::preset("ib-ndr");
  network.fabric = NetworkModel::preset("nvlink").fabric;
  network.ranks_per_node = k;
  std::string table =
      "| nodes x ranks | simulated (us) | formula (us) | flat ring formula (us) | flat / "
      "hierarchical |\n|---|---|---|---|---|\n";
  for (int nodes : {2, 4, 8, 16}) {
    const int p = nodes * k;
    std::vector<double> took(static_cast<std::size_t>(p));
    LaunchOptions options = simulated(p, network);
    options.simulation.record_trace = false;
    launch(options, [&](Communicator& comm) {
      auto [node, across] = split_by_node(comm, k);
      const double start = comm.clock().now();
      std::vector<float> data = rank_values(comm.rank(), count);
      hierarchical_allreduce_on_splits(*node, *across, data);
      took[static_cast<std::size_t>(comm.rank())] = comm.clock().now() - start;
      EXPECT_EQ(data[count - 1], static_cast<float>(p * (p + 1) / 2 * ((count - 1) % 5 + 1)));
    });
    const double simulated_seconds = *std::max_element(took.begin(), took.end());
    const double formula = hierarchical_formula(nodes, k, n, network);
    expect_time(simulated_seconds, formula, fmt::format("{} nodes x {} ranks", nodes, k));
    const double flat =
        2 * (p - 1) * std::max(message(n / p, network.fabric), message(n / p, network.inter_node));
    table +=
        fmt::format("| {} x {} | {:.3f} | {:.3f} | {:.3f} | {:.2f} |\n", nodes, k,
                    simulated_seconds * 1e6, formula * 1e6, flat * 1e6, flat / simulated_seconds);
  }
  std::printf("hierarchical all-reduce of 1 MiB per rank, nvlink + ib-ndr:\n%s", table.c_str());
}

TEST(TwoLevels, EachRankUsesNicRankModNicsOfItsNode) {
  const NetworkModel shared = two_levels(4, 2);
  EXPECT_EQ(shared.effective_nics_per_node(), 2);
  std::vector<int> nics;
  for (int rank = 0; rank < 8; ++rank) nics.push_back(shared.nic_of(rank));
  EXPECT_EQ(nics, (std::vector<int>{0, 1, 0, 1, 2, 3, 2, 3}));
  const NetworkModel own = two_levels(4);
  EXPECT_EQ(own.effective_nics_per_node(), 4);
  for (int rank = 0; rank < 8; ++rank) EXPECT_EQ(own.nic_of(rank), rank);
  EXPECT_NE(shared.describe().find("2 NICs per node"), std::string::npos) << shared.describe();
}

TEST(TwoLevels, NicsPerNodeMustBeAPositiveDivisorOfTheRanksPerNode) {
  struct Bad {
    int ranks_per_node;
    int nics;
    const char* says;
  };
  for (const Bad& bad :
       {Bad{4, 3, "NICs per node must divide the ranks per node, got 3 NICs for 4"},
        Bad{4, -1, "NICs per node must be >= 0 (0: one per rank), got -1"},
        Bad{0, 2, "2 NICs per node on a flat network"}}) {
    std::string message;
    try {
      launch(simulated(8, two_levels(bad.ranks_per_node, bad.nics)), [](Communicator&) {});
    } catch (const Error& error) {
      message = error.what();
    }
    EXPECT_NE(message.find(bad.says), std::string::npos) << "got: '" << message << "'";
  }
  for (int nics : {0, 1, 2, 4}) EXPECT_NO_THROW(two_levels(4, nics).validate());
}

// --- Overlap -------------------------------------------------------------------------------

TEST(Overlap, AnAllReduceHiddenByComputeCostsNothingAndOneAfterComputeCostsAll) {
  const std::size_t count = 1 << 20;
  const double allreduce = 2 * 3 * message(static_cast<double>(count * sizeof(float)) / 4);
  const double compute = 2 * allreduce;
  std::vector<RankTrace> traces(4);
  std::vector<double> overlapped(4);
  std::vector<double> serial(4);
  launch(simulated(4), [&](Communicator& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    std::vector<float> x(count, 1.0f);
    comm.clock().mark_step();
    auto work = comm.allreduce(std::span(x), ReduceOp::kSum);
    comm.clock().compute("backward", compute);
    work->wait();
    overlapped[r] = comm.clock().now();
    comm.clock().mark_step();
    comm.clock().compute("backward", compute);
    comm.allreduce(std::span(x), ReduceOp::kSum)->wait();
    serial[r] = comm.clock().now() - overlapped[r];
    comm.clock().mark_step();
    traces[r] = comm.clock().trace();
  });
  for (std::size_t r = 0; r < 4; ++r) {
    expect_time(overlapped[r], compute, "fully overlapped: no extra time");
    expect_time(serial[r], compute + allreduce, "after compute: all of it");
    const std::vector<StepSummary> steps = summarize_steps(traces[r]);
    ASSERT_EQ(steps.size(), 2u);
    expect_time(steps[0].communication, allreduce, "step 1 communication");
    EXPECT_NEAR(steps[0].exposed_communication, 0.0, 1e-15);
    EXPECT_NEAR(steps[0].overlap_fraction, 1.0, 1e-12);
    expect_time(steps[1].exposed_communication, allreduce, "step 2 exposed");
    EXPECT_NEAR(steps[1].overlap_fraction, 0.0, 1e-12);
    expect_time(steps[1].total, compute + allreduce, "step 2 total");
  }
}

TEST(Overlap, ComputeAndLinkAreTwoTimelines) {
  std::vector<double> now(2);
  std::vector<double> link(2);
  launch(simulated(2), [&](Communicator& comm) {
    std::vector<float> x(1 << 16, 1.0f);
    auto work = comm.rank() == 0 ? comm.isend(std::span<const float>(x), 1, 0)
                                 : comm.irecv(std::span(x), 0, 0);
    comm.clock().compute("busy", 1.0);
    work->wait();
    now[static_cast<std::size_t>(comm.rank())] = comm.clock().now();
    link[static_cast<std::size_t>(comm.rank())] = comm.clock().link_free();
  });
  for (std::size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(now[r], 1.0) << "the message crossed while the rank computed";
    expect_time(link[r], transfer(4.0 * (1 << 16)), "the link was busy only for the transfer");
  }
}

TEST(Overlap, WaitNeverMovesTheClockBackwards) {
  const double seconds = simulated_time(2, [&](Communicator& comm) {
    std::vector<float> x(16, 1.0f);
    auto work = comm.allreduce(std::span(x), ReduceOp::kSum);
    comm.clock().compute("long", 1.0);
    work->wait();
  });
  EXPECT_EQ(seconds, 1.0);
}

// --- Compute model ----------------------------------------------------------------------------

TEST(ComputeModel, RooflineChargesEveryLayerOfTheModel) {
  const DeviceModel device = DeviceModel::preset("a100");
  EXPECT_EQ(device.time_of({0, 0}), device.launch_seconds);
  EXPECT_DOUBLE_EQ(device.time_of({1e9, 1}), 1e9 / device.flops_per_second + device.launch_seconds);
  EXPECT_DOUBLE_EQ(device.time_of({1, 1e9}), 1e9 / device.bytes_per_second + device.launch_seconds);

  std::vector<double> seconds(1);
  std::vector<std::size_t> compute_events(1);
  double first_layer_backward_flops = 0;
  launch(simulated(1), [&](Communicator& comm) {
    Model model = Model::mlp("8-16-4", {.seed = 1});
    Tensor x({5, 8}, MemoryCategory::kActivations);
    x.fill(0.5f);
    const Tensor logits = model.forward(x);
    const std::vector<int> labels = {0, 1, 2, 3, 0};
    model.backward(logits, labels);
    seconds[0] = comm.clock().now();
    for (const TraceEvent& event : comm.clock().trace().events) {
      compute_events[0] += event.lane == TraceLane::kCompute ? 1 : 0;
      if (event.name == "fc1 backward") first_layer_backward_flops = event.flops;
    }
  });
  Model model = Model::mlp("8-16-4", {.seed = 1});
  double expected = 0;
  // The first layer's backward skips its input gradient: dW and db only.
  for (Layer* layer : model.layers())
    expected +=
        device.time_of(layer->forward_cost(5)) +
        device.time_of(layer == model.layers().front() ? layer->backward_parameters_only_cost(5)
                                                       : layer->backward_cost(5));
  EXPECT_DOUBLE_EQ(first_layer_backward_flops, 2.0 * 5 * 8 * 16 + 5 * 16);
  expected += device.time_of(SoftmaxCrossEntropy::forward_cost(5, 4)) +
              device.time_of(SoftmaxCrossEntropy::backward_cost(5, 4));
  expect_time(seconds[0], expected, "3 layers forward and backward plus the loss");
  EXPECT_EQ(compute_events[0], 2 * model.layers().size() + 2);
}

TEST(ComputeModel, AGptIsChargedItsLayersOnTheBatchOfSequences) {
  // Every GPT layer's cost takes sequences of `context` tokens; the head's gradient has a
  // row per token (B T), which backward must not take for the batch (it charged the head's
  // backward T times over before).
  const DeviceModel device = DeviceModel::preset("a100");
  const GptSpec spec{.layers = 1, .dim = 8, .heads = 2, .context = 4};
  constexpr std::int64_t kSequences = 3, kVocab = 5;
  std::vector<double> seconds(1);
  launch(simulated(1), [&](Communicator& comm) {
    Model model = Model::gpt(spec, kVocab, {.seed = 1});
    Tensor ids({kSequences, spec.context});  // token 0 everywhere
    const Tensor logits = model.forward(ids);
    const std::vector<int> labels(static_cast<std::size_t>(kSequences * spec.context), 1);
    model.backward(logits, labels);
    seconds[0] = comm.clock().now();
  });
  Model model = Model::gpt(spec, kVocab, {.seed = 1});
  double expected = 0;
  for (Layer* layer : model.layers())
    expected += device.time_of(layer->forward_cost(kSequences)) +
                device.time_of(layer == model.layers().front()
                                   ? layer->backward_parameters_only_cost(kSequences)
                                   : layer->backward_cost(kSequences));
  const std::int64_t tokens = kSequences * spec.context;
  expected += device.time_of(SoftmaxCrossEntropy::forward_cost(tokens, kVocab)) +
              device.time_of(SoftmaxCrossEntropy::backward_cost(tokens, kVocab));
  expect_time(seconds[0], expected, "embed, a block and the head forward and backward, the loss");
}

TEST(ComputeModel, WithoutSimulationTheClockIsWallTimeAndNothingIsCharged) {
  launch({.world_size = 2}, [&](Communicator& comm) {
    EXPECT_FALSE(comm.clock().simulated());
    EXPECT_EQ(this_thread_clock(), nullptr);
    std::vector<float> x(4, 1.0f);
    comm.allreduce(std::span(x), ReduceOp::kSum)->wait();
    EXPECT_TRUE(comm.clock().trace().events.empty());
  });
}

TEST(ComputeModel, MeasuredModeChargesThreadCpuTime) {
  LaunchOptions options = simulated(1);
  options.simulation.compute = ComputeModel::kMeasured;
  launch(options, [&](Communicator& comm) {
    const double before = comm.clock().now();
    timed_compute("spin", "", OpCost{}, [] {
      volatile double sink = 0;
      for (int i = 0; i < 2'000'000; ++i) sink = sink + 1.0;
    });
    EXPECT_GT(comm.clock().now(), before);  // some CPU time, whatever this machine's speed
  });
}

// --- Determinism and unchanged numerics ---------------------------------------------------------

struct TrainingRun {
  std::vector<RankTrace> traces;
  std::vector<std::vector<float>> parameters;
};

TrainingRun train_simulated(int ranks, bool overlap, bool simulate = true, int steps = 8,
                            bool record_trace = true) {
  TrainOptions options;
  options.steps = steps;
  options.global_batch = 64;
  options.overlap = overlap;
  const Dataset data = load_dataset(options.dataset, options.seed);
  TrainingRun run;
  run.traces.resize(static_cast<std::size_t>(ranks));
  run.parameters.resize(static_cast<std::size_t>(ranks));
  LaunchOptions launch_options = simulated(ranks);
  launch_options.simulation.enabled = simulate;
  launch_options.simulation.record_trace = record_trace;
  launch(launch_options, [&](Communicator& comm) {
    const TrainResult result = train_data_parallel(options, data, comm);
    run.traces[static_cast<std::size_t>(comm.rank())] = comm.clock().trace();
    run.parameters[static_cast<std::size_t>(comm.rank())] = result.model.flat_parameters();
  });
  return run;
}

void expect_same_clocks(const std::vector<RankTrace>& a, const std::vector<RankTrace>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t r = 0; r < a.size(); ++r) {
    ASSERT_EQ(a[r].events.size(), b[r].events.size()) << "rank " << r;
    ASSERT_EQ(a[r].step_marks, b[r].step_marks) << "rank " << r;
    for (std::size_t i = 0; i < a[r].events.size(); ++i) {
      const TraceEvent& x = a[r].events[i];
      const TraceEvent& y = b[r].events[i];
      ASSERT_EQ(x.name, y.name) << "rank " << r << " event " << i;
      ASSERT_EQ(x.start, y.start) << "rank " << r << " event " << i << " " << x.name;
      ASSERT_EQ(x.duration, y.duration) << "rank " << r << " event " << i << " " << x.name;
      ASSERT_EQ(x.bytes, y.bytes) << "rank " << r << " event " << i;
    }
  }
}

TEST(Determinism, TrainingOn8RanksGivesTheSameClocksEveryRun) {
  for (bool overlap : {false, true}) {
    const TrainingRun first = train_simulated(8, overlap);
    ASSERT_FALSE(first.traces[0].events.empty());
    for (int again = 0; again < 3; ++again) {
      const TrainingRun next = train_simulated(8, overlap);
      expect_same_clocks(first.traces, next.traces);
    }
    const std::vector<StepSummary> steps = summarize_steps(first.traces[0]);
    ASSERT_EQ(steps.size(), 8u);
    EXPECT_GT(steps.back().total, 0.0);
    if (overlap)
      EXPECT_GT(steps.back().overlap_fraction, 0.0) << "hooks issue all-reduces in backward";
    else
      EXPECT_EQ(steps.back().overlap_fraction, 0.0) << "all-reduces issued after backward";
  }
}

TEST(Determinism, WithoutATraceMemoryStaysFlatAndTheStepSummaryIsTheSame) {
  // Before: every op of every step was kept, about 20 KB per step on 8 ranks, trace or not.
  for (bool overlap : {false, true}) {
    const TrainingRun recorded = train_simulated(4, overlap, true, 40, /*record_trace=*/true);
    const TrainingRun folded = train_simulated(4, overlap, true, 40, /*record_trace=*/false);
    for (std::size_t r = 0; r < 4; ++r) {
      const RankTrace& trace = folded.traces[r];
      EXPECT_EQ(trace.folded.step, 40) << "rank " << r << ": every finished step is folded";
      EXPECT_TRUE(trace.events.empty()) << "rank " << r;
      EXPECT_EQ(trace.step_marks.size(), 1u) << "rank " << r;
      const StepSummary expected = mean_of(summarize_steps(recorded.traces[r]));
      const StepSummary seen = mean_step(trace);
      EXPECT_EQ(seen.step, expected.step);
      EXPECT_EQ(seen.total, expected.total) << "rank " << r;
      EXPECT_EQ(seen.compute, expected.compute) << "rank " << r;
      EXPECT_EQ(seen.communication, expected.communication) << "rank " << r;
      EXPECT_EQ(seen.exposed_communication, expected.exposed_communication) << "rank " << r;
      EXPECT_EQ(seen.overlap_fraction, expected.overlap_fraction) << "rank " << r;
      EXPECT_EQ(seen.link_bytes, expected.link_bytes) << "rank " << r;
    }
  }
}

TEST(Determinism, SimulationDoesNotChangeTheResultsBitwise) {
  for (bool overlap : {false, true}) {
    const TrainingRun plain = train_simulated(4, overlap, /*simulate=*/false);
    const TrainingRun timed = train_simulated(4, overlap, /*simulate=*/true);
    for (std::size_t r = 0; r < 4; ++r)
      ASSERT_EQ(std::memcmp(plain.parameters[r].data(), timed.parameters[r].data(),
                            plain.parameters[r].size() * sizeof(float)),
                0)
          << "rank " << r << (overlap ? " with overlap" : "");
  }
}

/// An irregular exchange: every round each rank computes for a rank- and round-dependent
/// virtual time, sends messages of varied sizes to every other rank and a collective
/// follows every third round; the wall-clock timing is perturbed at random.
std::vector<RankTrace> irregular_exchange(unsigned jitter_seed) {
  constexpr int kRanks = 6;
  std::vector<RankTrace> traces(kRanks);
  std::mutex random_mutex;
  std::mt19937 random(jitter_seed);
  launch(simulated(kRanks), [&](Communicator& comm) {
    const int r = comm.rank();
    const auto jitter = [&] {
      int microseconds = 0;
      {
        std::lock_guard lock(random_mutex);
        microseconds = static_cast<int>(random() % 300);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(microseconds));
    };
    for (int round = 0; round < 6; ++round) {
      comm.clock().compute("work", 1e-6 * ((r * 7 + round * 3) % 11));
      jitter();
      std::vector<std::vector<float>> out(kRanks);
      std::vector<std::vector<float>> in(kRanks);
      std::vector<std::unique_ptr<Work>> works;
      for (int peer = 0; peer < kRanks; ++peer) {
        if (peer == r) continue;
        const auto to = static_cast<std::size_t>(peer);
        out[to].assign(static_cast<std::size_t>(1000 * ((r + peer + round) % 5 + 1)), 1.0f);
        in[to].resize(static_cast<std::size_t>(1000 * ((peer + r + round) % 5 + 1)));
        works.push_back(comm.isend(std::span(out[to]), peer, round));
        jitter();
        works.push_back(comm.irecv(std::span(in[to]), peer, round));
      }
      for (auto& work : works) {
        jitter();
        work->wait();
      }
      if (round % 3 == 2) {
        std::vector<float> x(5000, 1.0f);
        comm.allreduce(std::span(x), ReduceOp::kSum)->wait();
      }
    }
    traces[static_cast<std::size_t>(r)] = comm.clock().trace();
  });
  return traces;
}

TEST(Determinism, VirtualTimesDoNotDependOnThreadTiming) {
  const std::vector<RankTrace> first = irregular_exchange(1);
  for (unsigned seed = 2; seed < 6; ++seed) expect_same_clocks(first, irregular_exchange(seed));
}

// --- Trace ---------------------------------------------------------------------------------

TEST(Trace, IsChromeTraceEventJsonWithOneProcessPerRank) {
  const TrainingRun run = train_simulated(4, /*overlap=*/true);
  const nlohmann::json trace = nlohmann::json::parse(chrome_trace_json(run.traces));
  ASSERT_TRUE(trace.contains("traceEvents"));
  ASSERT_TRUE(trace["traceEvents"].is_array());
  std::set<int> processes;
  std::set<std::pair<int, int>> named_threads;
  std::set<std::pair<int, int>> used_threads;
  std::size_t complete_events = 0;
  for (const nlohmann::json& event : trace["traceEvents"]) {
    ASSERT_TRUE(event.contains("ph") && event.contains("pid") && event.contains("name"));
    const int pid = event["pid"].get<int>();
    if (event["ph"] == "M") {
      if (event["name"] == "process_name") {
        processes.insert(pid);
        EXPECT_EQ(event["args"]["name"], fmt::format("rank {}", pid));
      }
      if (event["name"] == "thread_name") named_threads.insert({pid, event["tid"].get<int>()});
      continue;
    }
    ASSERT_EQ(event["ph"], "X");
    for (const char* field : {"name", "cat", "ts", "dur", "pid", "tid", "args"})
      ASSERT_TRUE(event.contains(field)) << field << " missing in " << event.dump();
    EXPECT_TRUE(event["cat"] == "compute" || event["cat"] == "communication");
    EXPECT_GE(event["ts"].get<double>(), 0.0);
    EXPECT_GE(event["dur"].get<double>(), 0.0);
    EXPECT_TRUE(event["args"].contains("wall_ts_us") && event["args"].contains("wall_dur_us"));
    used_threads.insert({pid, event["tid"].get<int>()});
    ++complete_events;
  }
  EXPECT_EQ(processes, (std::set<int>{0, 1, 2, 3}));
  // Perfetto nests the slices of a thread: on each thread they must not partly overlap
  // (they never overlap at all: each timeline is serial).
  std::map<std::pair<int, int>, std::vector<std::pair<double, double>>> slices;
  for (const nlohmann::json& event : trace["traceEvents"])
    if (event["ph"] == "X")
      slices[{event["pid"].get<int>(), event["tid"].get<int>()}].emplace_back(
          event["ts"].get<double>(), event["dur"].get<double>());
  for (auto& [thread, list] : slices) {
    std::sort(list.begin(), list.end());
    for (std::size_t i = 1; i < list.size(); ++i)
      ASSERT_GE(list[i].first, list[i - 1].first + list[i - 1].second - 1e-6)
          << "rank " << thread.first << " thread " << thread.second << " slice " << i;
  }
  for (const auto& thread : used_threads) EXPECT_TRUE(named_threads.contains(thread));
  std::size_t recorded = 0;
  for (const RankTrace& rank : run.traces) recorded += rank.events.size();
  EXPECT_EQ(complete_events, recorded);
  // Compute and communication are separate threads of each process.
  EXPECT_TRUE(used_threads.contains({0, 0}));
  EXPECT_TRUE(used_threads.contains({0, 1}));
  const nlohmann::json& other = trace["otherData"];
  EXPECT_TRUE(other["simulated"].get<bool>());
  ASSERT_EQ(other["ranks"].size(), 4u);
  ASSERT_EQ(other["ranks"][0]["steps"].size(), 8u);
  for (const char* field : {"total_us", "compute_us", "communication_us",
                            "exposed_communication_us", "overlap_fraction", "link_bytes"})
    EXPECT_TRUE(other["ranks"][0]["steps"][0].contains(field)) << field;
}

TEST(Trace, StepSummaryOfAHandMadeTrace) {
  RankTrace trace;
  trace.step_marks = {0.0, 10.0, 20.0};
  trace.events = {
      {"fwd", TraceLane::kCompute, 0.0, 4.0, 0, 0, 0, 0, -1},
      {"allreduce", TraceLane::kSend, 3.0, 4.0, 0, 0, 0, 100, -1},    // 3..7: 1 hidden
      {"recv from 1", TraceLane::kReceive, 5.0, 1.0, 0, 0, 0, 8, 1},  // inside the above
      {"bwd", TraceLane::kCompute, 7.0, 2.0, 0, 0, 0, 0, -1},
      {"allreduce", TraceLane::kSend, 9.0, 3.0, 0, 0, 0, 50, -1},  // 9..12: split at 10
  };
  const std::vector<StepSummary> steps = summarize_steps(trace);
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_DOUBLE_EQ(steps[0].total, 10.0);
  EXPECT_DOUBLE_EQ(steps[0].compute, 6.0);
  EXPECT_DOUBLE_EQ(steps[0].communication, 5.0);          // 3..7 and 9..10
  EXPECT_DOUBLE_EQ(steps[0].exposed_communication, 4.0);  // 4..7 and 9..10
  EXPECT_DOUBLE_EQ(steps[0].overlap_fraction, 1.0 - 4.0 / 5.0);
  EXPECT_EQ(steps[0].link_bytes, 158u);
  EXPECT_DOUBLE_EQ(steps[1].communication, 2.0);
  EXPECT_DOUBLE_EQ(steps[1].exposed_communication, 2.0);
  EXPECT_EQ(steps[1].link_bytes, 0u);
}

// --- Errors are reported as without the simulation ------------------------------------------

std::string comm_error_of(const LaunchOptions& options,
                          const std::function<void(Communicator&)>& rank_main) {
  try {
    launch(options, rank_main);
  } catch (const CommError& e) {
    return e.what();
  }
  return "(no CommError)";
}

TEST(SimulatedErrors, DeadlockIsStillDetectedAtOnce) {
  const auto start = std::chrono::steady_clock::now();
  const std::string message = comm_error_of(simulated(2), [](Communicator& comm) {
    std::vector<float> in(4), out(4);
    const int peer = 1 - comm.rank();
    comm.irecv(std::span(in), peer, 0)->wait();
    comm.isend(std::span<const float>(out), peer, 0)->wait();
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_NE(message.find("deadlock"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 0: waits for call #0 recv(from=1, tag=0, count=4 float32)"),
            std::string::npos)
      << message;
}

TEST(SimulatedErrors, MismatchedCollectiveFailsOnEveryRankAndLaterCallsWork) {
  std::vector<std::string> seen(3);
  std::vector<double> ends(3);
  launch(simulated(3), [&](Communicator& comm) {
    std::vector<float> data(comm.rank() == 1 ? 512 : 1024, 1.0f);
    try {
      comm.allreduce(std::span(data), ReduceOp::kSum)->wait();
    } catch (const CommError& e) {
      seen[static_cast<std::size_t>(comm.rank())] = e.what();
    }
    // The simulation forgot the failed call: the next one completes and is timed.
    std::vector<float> ok(30, 1.0f);
    comm.allreduce(std::span(ok), ReduceOp::kSum)->wait();
    ends[static_cast<std::size_t>(comm.rank())] = comm.clock().now();
  });
  for (const std::string& message : seen)
    EXPECT_NE(message.find("does not match"), std::string::npos) << message;
  for (double end : ends) EXPECT_GT(end, 0.0);
}

TEST(SimulatedErrors, AFailingRankEndsTheOthers) {
  const auto start = std::chrono::steady_clock::now();
  try {
    launch(simulated(4), [](Communicator& comm) {
      std::vector<float> data(4);
      if (comm.rank() == 2) throw std::runtime_error("rank 2 broke");
      comm.allreduce(std::span(data), ReduceOp::kSum)->wait();
    });
    FAIL() << "expected the rank's exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "rank 2 broke");
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST(SimulatedErrors, PointToPointSizeMismatchFailsBothSides) {
  const std::string message = comm_error_of(simulated(2), [](Communicator& comm) {
    std::vector<float> data(comm.rank() == 0 ? 8 : 4);
    if (comm.rank() == 0)
      comm.isend(std::span<const float>(data), 1, 0)->wait();
    else
      comm.irecv(std::span(data), 0, 0)->wait();
  });
  EXPECT_NE(message.find("8"), std::string::npos) << message;
  EXPECT_NE(message.find("4"), std::string::npos) << message;
}

TEST(Presets, NamesAndErrors) {
  for (const std::string& name : NetworkModel::preset_names())
    EXPECT_GT(NetworkModel::preset(name).fabric.bytes_per_second, 0);
  EXPECT_DOUBLE_EQ(NetworkModel::preset("ib-ndr").fabric.bytes_per_second, 50e9);
  EXPECT_DOUBLE_EQ(NetworkModel::preset("10gbe").fabric.bytes_per_second, 1.25e9);
  EXPECT_THROW(NetworkModel::preset("carrier-pigeon"), Error);
  EXPECT_THROW(DeviceModel::preset("abacus"), Error);
  LaunchOptions bad = simulated(2);
  bad.simulation.network.fabric.bytes_per_second = 0;
  EXPECT_THROW(launch(bad, [](Communicator&) {}), Error);
}

}  // namespace
}  // namespace dp
