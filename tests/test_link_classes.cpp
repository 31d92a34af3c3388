// Bytes per link class (dp/comm.h, "Link classes" at CommCounters): every byte a rank sends or
// receives is intra-node or inter-node by the launch's `ranks_per_node`, along the links the
// simulated network charges (a collective's ring in its communicator's rank order, a
// broadcast's root to each rank, a message's two ranks). Checked against closed forms: a flat
// ring on 2 nodes x 4 (only the ranks next to a node boundary send across), the hierarchical
// all-reduce on 2, 3 and 4 nodes of 4 (reduce-scatter and all-gather inside, all-reduce of a
// shard across), messages inside and across nodes on the launch's communicator and on split
// ones, a broadcast; one flat network counts everything intra-node; the simulation on or off
// and the emulated nccl count the same; `sum_counters` adds communicators up.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "dp/clock.h"
#include "dp/comm.h"
#include "dp/error.h"
#include "dp/launch.h"
#include "dp/tensor.h"

namespace dp {
namespace {

constexpr std::uint64_t kFloat = sizeof(float);

/// `nodes` x `ranks_per_node` ranks on NVLink inside a node and InfiniBand NDR across,
/// simulated or not (the layout classifies bytes either way).
LaunchOptions two_levels(int nodes, int ranks_per_node, bool simulated = true) {
  LaunchOptions options;
  options.world_size = nodes * ranks_per_node;
  options.simulation = SimulationOptions::preset("ib-ndr");
  options.simulation.enabled = simulated;
  options.simulation.network.fabric = NetworkModel::preset("nvlink").fabric;
  options.simulation.network.inter_node = NetworkModel::preset("ib-ndr").fabric;
  options.simulation.network.ranks_per_node = ranks_per_node;
  options.simulation.record_trace = false;
  return options;
}

/// Elements a ring all-reduce of `n` elements over `p` ranks sends from rank `i` (and
/// receives): (p-1) |c_i| + (n - |c_i|), chunk c_i = [n i/p, n (i+1)/p).
std::uint64_t ring_allreduce_elements(std::uint64_t n, int p, int i) {
  const auto q = static_cast<std::uint64_t>(p);
  const auto r = static_cast<std::uint64_t>(i);
  const std::uint64_t chunk = n * (r + 1) / q - n * r / q;
  return (q - 1) * chunk + (n - chunk);
}

/// Every kind of call splits its bytes exactly into the two classes.
void expect_classes_add_up(const CommCounters& counters, const std::string& what) {
  for (std::size_t op = 0; op < kNumCommOps; ++op) {
    const OpCounters& c = counters.per_op[op];
    EXPECT_EQ(c.intra_node_bytes_sent + c.inter_node_bytes_sent, c.bytes_sent)
        << what << ", " << to_string(static_cast<CommOp>(op));
    EXPECT_EQ(c.intra_node_bytes_received + c.inter_node_bytes_received, c.bytes_received)
        << what << ", " << to_string(static_cast<CommOp>(op));
  }
}

/// Rank r's counters after a flat all-reduce, reduce-scatter and all-gather on `options`.
std::vector<CommCounters> flat_ring_counters(const LaunchOptions& options, std::size_t n) {
  std::vector<CommCounters> counters(static_cast<std::size_t>(options.world_size));
  launch(options, [&](Communicator& comm) {
    const auto p = static_cast<std::size_t>(comm.size());
    std::vector<float> data(n, 1.0f);
    std::vector<float> shard(n / p);
    comm.allreduce(std::span(data), ReduceOp::kSum)->wait();
    comm.reduce_scatter(std::span<const float>(data), std::span(shard), ReduceOp::kSum)->wait();
    comm.allgather(std::span<const float>(shard), std::span(data))->wait();
    counters[static_cast<std::size_t>(comm.rank())] = comm.counters();
  });
  return counters;
}

TEST(LinkClasses, AFlatRingOnTwoNodesOfFourSendsAcrossOnlyFromTheRanksBeforeABoundary) {
  // 2 nodes x 4: the ring 0 -> 1 -> ... -> 7 -> 0 crosses nodes at 3 -> 4 and 7 -> 0.
  constexpr std::size_t n = 1000;  // not a multiple of 8: uneven chunks
  for (const bool simulated : {true, false}) {
    const std::vector<CommCounters> counters = flat_ring_counters(two_levels(2, 4, simulated), n);
    for (int r = 0; r < 8; ++r) {
      const CommCounters& c = counters[static_cast<std::size_t>(r)];
      const std::string what = "rank " + std::to_string(r) + (simulated ? " simulated" : "");
      expect_classes_add_up(c, what);
      const bool sends_across = r % 4 == 3;
      const bool receives_across = r % 4 == 0;
      const std::uint64_t allreduce = ring_allreduce_elements(n, 8, r) * kFloat;
      const OpCounters& a = c.of(CommOp::kAllReduce);
      EXPECT_EQ(a.inter_node_bytes_sent, sends_across ? allreduce : 0) << what;
      EXPECT_EQ(a.intra_node_bytes_sent, sends_across ? 0 : allreduce) << what;
      // Rank r receives as many as it sends (its own chunk's partial sums and results).
      EXPECT_EQ(a.inter_node_bytes_received, receives_across ? allreduce : 0) << what;
      EXPECT_EQ(a.intra_node_bytes_received, receives_across ? 0 : allreduce) << what;
      // Reduce-scatter and all-gather: (p-1) n/p each way.
      const std::uint64_t half = 7 * (n / 8) * kFloat;
      for (const CommOp op : {CommOp::kReduceScatter, CommOp::kAllGather}) {
        EXPECT_EQ(c.of(op).inter_node_bytes_sent, sends_across ? half : 0) << what;
        EXPECT_EQ(c.of(op).intra_node_bytes_sent, sends_across ? 0 : half) << what;
        EXPECT_EQ(c.of(op).inter_node_bytes_received, receives_across ? half : 0) << what;
      }
      EXPECT_EQ(c.inter_node_bytes_sent(), sends_across ? allreduce + 2 * half : 0) << what;
    }
  }
}

TEST(LinkClasses, OneFlatNetworkCountsEveryByteIntraNode) {
  LaunchOptions options = two_levels(2, 4);
  options.simulation.network = NetworkModel::preset("ib-ndr");  // ranks_per_node 0
  const std::vector<CommCounters> counters = flat_ring_counters(options, 1000);
  for (std::size_t r = 0; r < counters.size(); ++r) {
    const CommCounters& c = counters[r];
    expect_classes_add_up(c, "rank " + std::to_string(r));
    EXPECT_GT(c.total_bytes_sent(), 0u);
    EXPECT_EQ(c.intra_node_bytes_sent(), c.total_bytes_sent()) << r;
    EXPECT_EQ(c.inter_node_bytes_sent(), 0u) << r;
    EXPECT_EQ(c.inter_node_bytes_received(), 0u) << r;
  }
}

/// Rank by rank: the counters of the launch's communicator, of the node's and of the one
/// across nodes after a hierarchical all-reduce of `n` floats.
struct Hierarchical {
  CommCounters launch;
  CommCounters node;
  CommCounters across;
};

std::vector<Hierarchical> run_hierarchical(const LaunchOptions& options, std::size_t n) {
  const int k = options.simulation.network.ranks_per_node;
  std::vector<Hierarchical> counters(static_cast<std::size_t>(options.world_size));
  launch(options, [&](Communicator& comm) {
    const int r = comm.rank();
    const std::unique_ptr<Communicator> node = comm.split(r / k, r);
    const std::unique_ptr<Communicator> across = comm.split(r % k, r);
    std::vector<float> data(n);
    for (std::size_t i = 0; i < n; ++i) data[i] = static_cast<float>(r + 1);
    std::vector<float> shard(n / static_cast<std::size_t>(k));
    node->reduce_scatter(std::span<const float>(data), std::span(shard), ReduceOp::kSum)->wait();
    across->allreduce(std::span(shard), ReduceOp::kSum)->wait();
    node->allgather(std::span<const float>(shard), std::span(data))->wait();
    const auto p = static_cast<float>(comm.size());
    for (float v : data) ASSERT_EQ(v, p * (p + 1) / 2) << "rank " << r;  // exact: small ints
    counters[static_cast<std::size_t>(r)] = {comm.counters(), node->counters(), across->counters()};
  });
  return counters;
}

TEST(LinkClasses, AHierarchicalAllReduceSendsItsShardAcrossFromEveryRank) {
  constexpr int k = 4;
  for (int nodes = 2; nodes <= 4; ++nodes) {
    const std::size_t n = 4 * 1000;  // n/k = 1000 floats: uneven chunks over 3 nodes
    const std::size_t m = n / k;
    const std::vector<Hierarchical> counters = run_hierarchical(two_levels(nodes, k), n);
    std::uint64_t across_total = 0;
    for (int r = 0; r < nodes * k; ++r) {
      const Hierarchical& c = counters[static_cast<std::size_t>(r)];
      const std::string what = fmt::format("{} nodes, rank {}", nodes, r);
      // The launch's communicator counted the two splits and nothing else.
      EXPECT_EQ(c.launch.total_calls(), 2u) << what;
      EXPECT_EQ(c.launch.of(CommOp::kSplit).calls, 2u) << what;
      EXPECT_EQ(c.launch.total_bytes_sent(), 0u) << what;
      // Inside the node: (k-1) m out, twice; across: the ring all-reduce of m over the nodes,
      // its rank there being the node's index.
      const std::uint64_t inside = 2 * (k - 1) * m * kFloat;
      const std::uint64_t outside = ring_allreduce_elements(m, nodes, r / k) * kFloat;
      expect_classes_add_up(c.node, what + " node");
      expect_classes_add_up(c.across, what + " across");
      EXPECT_EQ(c.node.intra_node_bytes_sent(), inside) << what;
      EXPECT_EQ(c.node.inter_node_bytes_sent(), 0u) << what;
      EXPECT_EQ(c.node.intra_node_bytes_received(), inside) << what;
      EXPECT_EQ(c.across.inter_node_bytes_sent(), outside) << what;
      EXPECT_EQ(c.across.intra_node_bytes_sent(), 0u) << what;
      EXPECT_EQ(c.across.inter_node_bytes_received(), outside) << what;
      // All three together, as a grader adds them up.
      const CommCounters all = sum_counters({c.launch, c.node, c.across});
      EXPECT_EQ(all.intra_node_bytes_sent(), inside) << what;
      EXPECT_EQ(all.inter_node_bytes_sent(), outside) << what;
      EXPECT_EQ(all.of(CommOp::kReduceScatter).intra_node_bytes_sent, inside / 2) << what;
      EXPECT_EQ(all.of(CommOp::kAllReduce).inter_node_bytes_sent, outside) << what;
      EXPECT_EQ(all.total_calls(), 5u) << what;
      EXPECT_TRUE(all.bytes_sent_to.empty()) << what;
      across_total += outside;
    }
    // Every rank sends 2 (N-1)/N of its shard across: 2 (N-1) m k floats in all over the
    // launch, the shards' chunks summing to m per node.
    EXPECT_EQ(across_total, 2u * static_cast<std::uint64_t>(nodes - 1) * m * k * kFloat)
        << nodes << " nodes";
  }
}

TEST(LinkClasses, TheHierarchicalAllReduceSendsKTimesLessAcrossFromTheBusiestRank) {
  // 2 nodes x 4, 4096 floats: the flat ring's rank 3 sends 2 (7/8) n across; the
  // hierarchical all-reduce sends 2 (1/2) n/4 across from every rank.
  constexpr std::size_t n = 4096;
  const std::vector<CommCounters> flat = flat_ring_counters(two_levels(2, 4), n);
  const std::vector<Hierarchical> hierarchical = run_hierarchical(two_levels(2, 4), n);
  std::uint64_t flat_busiest = 0;
  std::uint64_t hierarchical_busiest = 0;
  for (std::size_t r = 0; r < 8; ++r) {
    flat_busiest = std::max(flat_busiest, flat[r].of(CommOp::kAllReduce).inter_node_bytes_sent);
    hierarchical_busiest =
        std::max(hierarchical_busiest, hierarchical[r].across.inter_node_bytes_sent());
  }
  EXPECT_EQ(flat_busiest, 2 * 7 * (n / 8) * kFloat);
  EXPECT_EQ(hierarchical_busiest, 2 * (n / 4 / 2) * kFloat);
}

TEST(LinkClasses, MessagesCountByTheirTwoRanksPlacesOnEveryCommunicator) {
  // 2 nodes x 2: launch ranks 0, 1 | 2, 3.
  std::vector<CommCounters> launch_counts(4);
  std::vector<CommCounters> split_counts(4);
  launch(two_levels(2, 2), [&](Communicator& comm) {
    const int r = comm.rank();
    std::vector<float> out(10, 1.0f);
    std::vector<float> in(10);
    // Rank 0 sends 10 floats to 1 (inside) and to 2 (across).
    if (r == 0) {
      auto a = comm.isend(std::span<const float>(out), 1, 0);
      auto b = comm.isend(std::span<const float>(out), 2, 0);
      a->wait();
      b->wait();
    } else if (r == 1 || r == 2) {
      comm.irecv(std::span(in), 0, 0)->wait();
    }
    // A communicator of launch ranks 3, 0, 2, 1 (by key): its ranks 0 and 1 are on different
    // nodes, its ranks 1 and 3 on one.
    const int key = r == 3 ? 0 : r == 0 ? 1 : r == 2 ? 2 : 3;
    const std::unique_ptr<Communicator> mixed = comm.split(0, key);
    // Its ranks: 0 = launch 3, 1 = launch 0, 2 = launch 2, 3 = launch 1.
    const int me = mixed->rank();
    std::vector<float> small(3, 2.0f);
    if (me == 0) mixed->isend(std::span<const float>(small), 1, 7)->wait();  // 3 -> 0: across
    if (me == 1) mixed->irecv(std::span(small), 0, 7)->wait();
    if (me == 1) mixed->isend(std::span<const float>(small), 3, 7)->wait();  // 0 -> 1: inside
    if (me == 3) mixed->irecv(std::span(small), 1, 7)->wait();
    launch_counts[static_cast<std::size_t>(r)] = comm.counters();
    split_counts[static_cast<std::size_t>(r)] = mixed->counters();
  });
  const OpCounters& sent0 = launch_counts[0].of(CommOp::kSend);
  EXPECT_EQ(sent0.intra_node_bytes_sent, 10 * kFloat);
  EXPECT_EQ(sent0.inter_node_bytes_sent, 10 * kFloat);
  EXPECT_EQ(launch_counts[1].of(CommOp::kRecv).intra_node_bytes_received, 10 * kFloat);
  EXPECT_EQ(launch_counts[1].of(CommOp::kRecv).inter_node_bytes_received, 0u);
  EXPECT_EQ(launch_counts[2].of(CommOp::kRecv).inter_node_bytes_received, 10 * kFloat);
  EXPECT_EQ(launch_counts[2].of(CommOp::kRecv).intra_node_bytes_received, 0u);
  // On the split communicator, by the launch ranks behind its ranks.
  EXPECT_EQ(split_counts[3].of(CommOp::kSend).inter_node_bytes_sent, 3 * kFloat);
  EXPECT_EQ(split_counts[0].of(CommOp::kRecv).inter_node_bytes_received, 3 * kFloat);
  EXPECT_EQ(split_counts[0].of(CommOp::kSend).intra_node_bytes_sent, 3 * kFloat);
  EXPECT_EQ(split_counts[0].of(CommOp::kSend).inter_node_bytes_sent, 0u);
  EXPECT_EQ(split_counts[1].of(CommOp::kRecv).intra_node_bytes_received, 3 * kFloat);
  for (std::size_t r = 0; r < 4; ++r) {
    expect_classes_add_up(launch_counts[r], "launch, rank " + std::to_string(r));
    expect_classes_add_up(split_counts[r], "split, rank " + std::to_string(r));
  }
}

TEST(LinkClasses, ABroadcastCountsTheRootsBytesToEachRankByWhereThatRankIs) {
  std::vector<CommCounters> counters(4);
  launch(two_levels(2, 2), [&](Communicator& comm) {
    std::vector<float> data(6, static_cast<float>(comm.rank()));
    comm.broadcast(std::span(data), 1)->wait();
    EXPECT_EQ(data[0], 1.0f);
    counters[static_cast<std::size_t>(comm.rank())] = comm.counters();
  });
  const OpCounters& root = counters[1].of(CommOp::kBroadcast);
  EXPECT_EQ(root.intra_node_bytes_sent, 6 * kFloat);      // to rank 0
  EXPECT_EQ(root.inter_node_bytes_sent, 2 * 6 * kFloat);  // to ranks 2 and 3
  EXPECT_EQ(counters[0].of(CommOp::kBroadcast).intra_node_bytes_received, 6 * kFloat);
  for (std::size_t r : {2u, 3u}) {
    EXPECT_EQ(counters[r].of(CommOp::kBroadcast).inter_node_bytes_received, 6 * kFloat) << r;
    EXPECT_EQ(counters[r].of(CommOp::kBroadcast).bytes_sent, 0u) << r;
  }
}

TEST(LinkClasses, SinceSubtractsTheLinkClassesToo) {
  launch(two_levels(2, 2), [](Communicator& comm) {
    std::vector<float> data(8, 1.0f);
    comm.allreduce(std::span(data), ReduceOp::kSum)->wait();
    const CommCounters before = comm.counters();
    comm.allreduce(std::span(data), ReduceOp::kSum)->wait();
    const CommCounters once = comm.counters().since(before);
    EXPECT_EQ(once.intra_node_bytes_sent() + once.inter_node_bytes_sent(),
              ring_allreduce_elements(8, 4, comm.rank()) * kFloat);
    // The ring 0 -> 1 -> 2 -> 3 -> 0 crosses nodes after ranks 1 and 3.
    EXPECT_EQ(once.inter_node_bytes_sent(),
              comm.rank() % 2 == 1 ? ring_allreduce_elements(8, 4, comm.rank()) * kFloat : 0);
  });
}

TEST(LinkClasses, ANegativeRanksPerNodeIsRefused) {
  LaunchOptions options = two_levels(1, 2, /*simulated=*/false);
  options.simulation.network.ranks_per_node = -2;
  EXPECT_THROW(launch(options, [](Communicator&) {}), Error);
}

TEST(LinkClasses, TheEmulatedNcclCountsTheSameClassesAsTheLocalBackend) {
  // 2 nodes x 4 (the emulated machine's 8 GPUs) without the simulation (nccl has none): the
  // flat ring and the hierarchical all-reduce on device buffers.
  const auto counts_on = [](Backend backend) {
    LaunchOptions options = two_levels(2, 4, /*simulated=*/false);
    options.backend = backend;
    std::vector<CommCounters> counters(8);
    launch(options, [&](Communicator& comm) {
      const int r = comm.rank();
      Tensor data({1000}, MemoryCategory::kCommunication, Device::kCuda);
      Tensor shard({250}, MemoryCategory::kCommunication, Device::kCuda);
      comm.allreduce(data.view(), ReduceOp::kSum)->wait();
      const std::unique_ptr<Communicator> node = comm.split(r / 4, r);
      const std::unique_ptr<Communicator> across = comm.split(r % 4, -r);  // reversed
      node->reduce_scatter(data.view(), shard.view(), ReduceOp::kSum)->wait();
      across->allreduce(shard.view(), ReduceOp::kSum)->wait();
      node->allgather(shard.view(), data.view())->wait();
      across->broadcast(shard.view(), 0)->wait();
      counters[static_cast<std::size_t>(r)] =
          sum_counters({comm.counters(), node->counters(), across->counters()});
    });
    return counters;
  };
  const bool was_emulated = cuda_device_emulated();
  set_cuda_device_emulated(true);
  const std::vector<CommCounters> nccl = counts_on(Backend::kNccl);
  const std::vector<CommCounters> local = counts_on(Backend::kLocal);
  set_cuda_device_emulated(was_emulated);
  for (std::size_t r = 0; r < 8; ++r) {
    for (std::size_t op = 0; op < kNumCommOps; ++op) {
      const OpCounters& a = nccl[r].per_op[op];
      const OpCounters& b = local[r].per_op[op];
      const std::string what = fmt::format("rank {} {}", r, to_string(static_cast<CommOp>(op)));
      EXPECT_EQ(a.intra_node_bytes_sent, b.intra_node_bytes_sent) << what;
      EXPECT_EQ(a.inter_node_bytes_sent, b.inter_node_bytes_sent) << what;
      EXPECT_EQ(a.intra_node_bytes_received, b.intra_node_bytes_received) << what;
      EXPECT_EQ(a.inter_node_bytes_received, b.inter_node_bytes_received) << what;
    }
    expect_classes_add_up(nccl[r], "nccl, rank " + std::to_string(r));
  }
  // The across communicator is ordered by -rank: node 1's rank first, so the broadcast's root
  // is on node 1 and sends 250 floats across.
  EXPECT_EQ(nccl[4].of(CommOp::kBroadcast).inter_node_bytes_sent, 250 * kFloat);
  EXPECT_EQ(nccl[0].of(CommOp::kBroadcast).inter_node_bytes_received, 250 * kFloat);
}

}  // namespace
}  // namespace dp
