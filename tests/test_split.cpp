// Communicator::split on the backend DPLAB_TEST_BACKEND names (local threads in
// dp_unit_tests, mpi processes under mpiexec in dp_mpi_tests): ranks of one color form a
// communicator ordered by key then rank, kNoColor gets none, a split communicator can be
// split again, its messages and collectives stay apart from its parent's, it counts its own
// calls, and bad colors and mismatched calls fail with clear errors. Values are small
// integers, so float sums are exact. Every test is a few small launches of 4 ranks.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <numeric>
#include <span>
#include <string>
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

/// On mpi the processes past the world size sit a launch out; threads all take part.
bool takes_part(int world_size) {
  return testing::test_backend() != Backend::kMpi || mpi_world_rank() < world_size;
}

/// Every rank's launch rank, gathered over `comm` in its rank order.
std::vector<int> launch_ranks_of(Communicator& comm, int launch_rank) {
  std::vector<std::int32_t> mine{launch_rank};
  std::vector<std::int32_t> all(static_cast<std::size_t>(comm.size()));
  comm.allgather(std::span<const std::int32_t>(mine), std::span(all))->wait();
  return {all.begin(), all.end()};
}

TEST(Split, RanksOfOneColorFormACommunicatorOrderedByKeyThenRank) {
  launch(test_launch(4), [](Communicator& comm) {
    const int r = comm.rank();
    // Colors 0 (ranks 0, 2) and 1 (ranks 1, 3); keys reverse the order within color 0 and
    // tie within color 1 (then the rank decides).
    const int color = r % 2;
    const int key = color == 0 ? -r : 7;
    std::unique_ptr<Communicator> half = comm.split(color, key);
    ASSERT_NE(half, nullptr);
    EXPECT_EQ(half->size(), 2);
    EXPECT_EQ(half->backend(), comm.backend());
    const std::vector<int> expected = color == 0 ? std::vector<int>{2, 0} : std::vector<int>{1, 3};
    EXPECT_EQ(launch_ranks_of(*half, r), expected) << "rank " << r;
    EXPECT_EQ(half->rank(), color == 0 ? (r == 2 ? 0 : 1) : (r == 1 ? 0 : 1));

    // A sum over the new communicator adds its members only.
    std::vector<float> x(5, static_cast<float>(r + 1));
    half->allreduce(std::span(x), ReduceOp::kSum)->wait();
    const float sum = color == 0 ? 1 + 3 : 2 + 4;
    for (float v : x) EXPECT_EQ(v, sum) << "rank " << r;

    // Messages round the new communicator's ring, by its ranks.
    const int next = (half->rank() + 1) % half->size();
    std::vector<float> out{static_cast<float>(r)}, in{-1};
    auto send = half->isend(std::span<const float>(out), next, 3);
    auto receive = half->irecv(std::span(in), next, 3);  // of 2: the previous is the next
    receive->wait();
    send->wait();
    EXPECT_EQ(in[0], static_cast<float>(expected[static_cast<std::size_t>(next)]));
  });
}

TEST(Split, NoColorGetsNoCommunicatorAndTheOthersCarryOn) {
  launch(test_launch(4), [](Communicator& comm) {
    const int r = comm.rank();
    std::unique_ptr<Communicator> rest = comm.split(r == 0 ? Communicator::kNoColor : 5, /*key=*/0);
    if (r == 0) {
      EXPECT_EQ(rest, nullptr);
    } else {
      ASSERT_NE(rest, nullptr);
      EXPECT_EQ(rest->size(), 3);
      EXPECT_EQ(rest->rank(), r - 1);
      rest->barrier();
      std::vector<float> x{static_cast<float>(r)};
      rest->broadcast(std::span(x), 2)->wait();  // from rank 2 of three: launch rank 3
      EXPECT_EQ(x[0], 3.0f);
    }
    // The parent is unchanged and still works with every rank.
    std::vector<float> y{1};
    comm.allreduce(std::span(y), ReduceOp::kSum)->wait();
    EXPECT_EQ(y[0], 4.0f);
  });
}

TEST(Split, ASplitCommunicatorSplitsAgain) {
  launch(test_launch(4), [](Communicator& comm) {
    const int r = comm.rank();
    // Nodes {0, 1} and {2, 3}, then each node split again with its order reversed.
    std::unique_ptr<Communicator> node = comm.split(r / 2, r);
    ASSERT_NE(node, nullptr);
    std::unique_ptr<Communicator> reversed = node->split(0, -node->rank());
    ASSERT_NE(reversed, nullptr);
    EXPECT_EQ(reversed->size(), 2);
    EXPECT_EQ(launch_ranks_of(*reversed, r),
              (r < 2 ? std::vector<int>{1, 0} : std::vector<int>{3, 2}));
    // Across the nodes: the ranks with the same index in their node.
    std::unique_ptr<Communicator> across = comm.split(r % 2, r);
    ASSERT_NE(across, nullptr);
    EXPECT_EQ(launch_ranks_of(*across, r),
              (r % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3}));
  });
}

TEST(Split, MessagesAndCollectivesStayApartFromTheParents) {
  launch(test_launch(4), [](Communicator& comm) {
    const int r = comm.rank();
    std::unique_ptr<Communicator> pair = comm.split(r / 2, 0);  // {0, 1} and {2, 3}
    ASSERT_NE(pair, nullptr);
    // The same pair of ranks, the same tag, on both communicators: each receive gets the
    // message of its own communicator, whatever order they were sent in.
    const int partner = r ^ 1;
    std::vector<float> on_parent{100.0f + r}, on_pair{200.0f + r};
    std::vector<float> from_parent{-1}, from_pair{-1};
    auto receive_pair = pair->irecv(std::span(from_pair), pair->rank() ^ 1, 0);
    auto receive_parent = comm.irecv(std::span(from_parent), partner, 0);
    auto send_parent = comm.isend(std::span<const float>(on_parent), partner, 0);
    auto send_pair = pair->isend(std::span<const float>(on_pair), pair->rank() ^ 1, 0);
    receive_parent->wait();
    receive_pair->wait();
    send_parent->wait();
    send_pair->wait();
    EXPECT_EQ(from_parent[0], 100.0f + partner);
    EXPECT_EQ(from_pair[0], 200.0f + partner);
    // Collectives of both in flight at once, waited in reverse.
    std::vector<float> a(3, 1.0f), b(3, 1.0f);
    auto on_comm = comm.allreduce(std::span(a), ReduceOp::kSum);
    auto on_half = pair->allreduce(std::span(b), ReduceOp::kSum);
    on_half->wait();
    on_comm->wait();
    EXPECT_EQ(a, std::vector<float>(3, 4.0f));
    EXPECT_EQ(b, std::vector<float>(3, 2.0f));
  });
}

TEST(Split, EachCommunicatorCountsItsOwnCallsByItsOwnRanks) {
  launch(test_launch(4), [](Communicator& comm) {
    const int r = comm.rank();
    const CommCounters before = comm.counters();
    std::unique_ptr<Communicator> pair = comm.split(r / 2, 0);
    ASSERT_NE(pair, nullptr);
    const CommCounters after_split = comm.counters().since(before);
    EXPECT_EQ(after_split.of(CommOp::kSplit).calls, 1u);
    EXPECT_EQ(after_split.total_bytes_sent(), 0u);
    EXPECT_EQ(after_split.collective_calls(), 1u);

    std::vector<float> x(8, 1.0f);
    pair->allreduce(std::span(x), ReduceOp::kSum)->wait();
    std::vector<float> message(16, 0.0f);
    if (pair->rank() == 0) pair->isend(std::span<const float>(message), 1, 0)->wait();
    if (pair->rank() == 1) pair->irecv(std::span(message), 0, 0)->wait();

    const CommCounters own = pair->counters();
    ASSERT_EQ(own.bytes_sent_to.size(), 2u);
    EXPECT_EQ(own.of(CommOp::kAllReduce).calls, 1u);
    // A ring all-reduce of 8 floats over 2 ranks: 4 out and 4 back per peer, 32 bytes.
    EXPECT_EQ(own.of(CommOp::kAllReduce).bytes_sent, 32u);
    const int peer = pair->rank() ^ 1;
    EXPECT_EQ(own.bytes_sent_to[static_cast<std::size_t>(peer)],
              32u + (pair->rank() == 0 ? 64u : 0u));
    // The parent saw none of it.
    EXPECT_EQ(comm.counters().since(before).total_bytes_sent(), 0u);
    EXPECT_EQ(comm.counters().since(before).total_calls(), 1u);
  });
}

TEST(Split, LinkClassesFollowTheLaunchsNodesOnEveryCommunicator) {
  // 2 nodes of 2 (launch ranks 0, 1 | 2, 3) by the layout alone: mpi has no simulation, and
  // the local backend classifies the same without it (dp/comm.h, "Link classes").
  LaunchOptions options = test_launch(4);
  options.simulation.network.ranks_per_node = 2;
  launch(options, [](Communicator& comm) {
    const int r = comm.rank();
    constexpr std::uint64_t kFloat = sizeof(float);
    // The flat ring 0 -> 1 -> 2 -> 3 -> 0 of 8 floats: 2 (p-1)/p 8 = 12 floats from each
    // rank, across nodes from ranks 1 and 3, into ranks 2 and 0.
    std::vector<float> x(8, 1.0f);
    comm.allreduce(std::span(x), ReduceOp::kSum)->wait();
    const OpCounters flat = comm.counters().of(CommOp::kAllReduce);
    EXPECT_EQ(flat.inter_node_bytes_sent, r % 2 == 1 ? 12 * kFloat : 0);
    EXPECT_EQ(flat.intra_node_bytes_sent, r % 2 == 1 ? 0 : 12 * kFloat);
    EXPECT_EQ(flat.inter_node_bytes_received, r % 2 == 0 ? 12 * kFloat : 0);

    // Hierarchical: reduce-scatter in the node, all-reduce of the shard across, all-gather.
    const CommCounters before = comm.counters();
    std::unique_ptr<Communicator> node = comm.split(r / 2, r);
    std::unique_ptr<Communicator> across = comm.split(r % 2, r);
    ASSERT_NE(node, nullptr);
    ASSERT_NE(across, nullptr);
    std::vector<float> shard(4);
    node->reduce_scatter(std::span<const float>(x), std::span(shard), ReduceOp::kSum)->wait();
    across->allreduce(std::span(shard), ReduceOp::kSum)->wait();
    node->allgather(std::span<const float>(shard), std::span(x))->wait();
    EXPECT_EQ(x, std::vector<float>(8, 16.0f));
    // Inside: 4 floats out in each of the two node collectives; across: 2 (1/2) 4 = 4.
    const CommCounters all =
        sum_counters({comm.counters().since(before), node->counters(), across->counters()});
    EXPECT_EQ(all.intra_node_bytes_sent(), 8 * kFloat);
    EXPECT_EQ(all.inter_node_bytes_sent(), 4 * kFloat);
    EXPECT_EQ(all.intra_node_bytes_received(), 8 * kFloat);
    EXPECT_EQ(all.inter_node_bytes_received(), 4 * kFloat);
    // The parent counted the two splits only.
    EXPECT_EQ(comm.counters().since(before).total_bytes_sent(), 0u);

    // Messages: on the communicator across nodes, its ranks 0 and 1 are launch ranks r % 2
    // and r % 2 + 2; on the node's, both of one node.
    std::vector<float> message(5, 0.0f);
    auto to = across->isend(std::span<const float>(message), across->rank() ^ 1, 0);
    across->irecv(std::span(message), across->rank() ^ 1, 0)->wait();
    to->wait();
    auto inside = node->isend(std::span<const float>(message), node->rank() ^ 1, 0);
    node->irecv(std::span(message), node->rank() ^ 1, 0)->wait();
    inside->wait();
    EXPECT_EQ(across->counters().of(CommOp::kSend).inter_node_bytes_sent, 5 * kFloat);
    EXPECT_EQ(across->counters().of(CommOp::kRecv).inter_node_bytes_received, 5 * kFloat);
    EXPECT_EQ(node->counters().of(CommOp::kSend).intra_node_bytes_sent, 5 * kFloat);
    EXPECT_EQ(node->counters().of(CommOp::kSend).inter_node_bytes_sent, 0u);
  });
}

TEST(Split, ANegativeColorOtherThanNoColorIsRefusedOnTheRankThatPassedIt) {
  launch(test_launch(2), [](Communicator& comm) {
    EXPECT_EQ(message_of<Error>([&] { comm.split(-5, 0); }),
              "split: expected a color >= 0 or Communicator::kNoColor (-1) for a rank that joins "
              "no communicator, got -5");
    // Nothing was issued: the ranks are still in step.
    std::unique_ptr<Communicator> all = comm.split(0, 0);
    ASSERT_NE(all, nullptr);
    EXPECT_EQ(all->size(), 2);
  });
}

TEST(Split, ASplitThatOtherRanksDoNotCallFailsOnEveryRankNamingBoth) {
  std::string message;
  try {
    launch(test_launch(3), [](Communicator& comm) {
      if (comm.rank() == 1) {
        comm.split(0, 0);
      } else {
        comm.barrier();
      }
    });
  } catch (const CommError& error) {
    message = error.what();
  }
  if (!takes_part(3)) return;
  EXPECT_NE(message.find("collective #0 does not match across ranks"), std::string::npos)
      << message;
  EXPECT_NE(message.find("rank 1 called split()"), std::string::npos) << message;
  EXPECT_NE(message.find("ranks 0, 2 called barrier()"), std::string::npos) << message;
}

TEST(Split, AMismatchOnASplitCommunicatorNamesItsRanks) {
  std::string message;
  try {
    launch(test_launch(4), [](Communicator& comm) {
      std::unique_ptr<Communicator> pair = comm.split(comm.rank() / 2, 0);
      std::vector<float> x(pair->rank() == 0 ? 4 : 8, 1.0f);
      pair->allreduce(std::span(x), ReduceOp::kSum)->wait();
    });
  } catch (const CommError& error) {
    message = error.what();
  }
  if (!takes_part(4)) return;
  EXPECT_NE(message.find("does not match across ranks"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 0 called allreduce(count=4 float32, op=sum)"), std::string::npos)
      << message;
  EXPECT_NE(message.find("rank 1 called allreduce(count=8 float32, op=sum)"), std::string::npos)
      << message;
}

}  // namespace
}  // namespace dp
