// Lab 1's graded checks: the sampler's shards, the broadcast of the initial weights, and
// training without synchronisation (which must make the replicas diverge). rubric.json
// gives each check its points; README.md in labs/lab1_replicated says what each grades.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <set>

#include "dp/data.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "grading.h"
#include "lab1.h"

namespace dp::lab1 {
namespace {

using grading::run_on_ranks;
using grading::Verdict;
using grading::world_sizes;

// Data set sizes that divide evenly and that do not, including fewer samples than ranks.
const std::vector<std::size_t> kDatasetSizes = {1, 3, 7, 10, 64, 97};
constexpr int kMaxRanks = 5;

/// Every rank's shard for one configuration, built the way each rank would build it.
std::vector<std::vector<std::size_t>> shards_of(std::size_t n, int replicas, SamplerOptions options,
                                                std::uint64_t epoch) {
  std::vector<std::vector<std::size_t>> shards;
  for (int rank = 0; rank < replicas; ++rank) {
    DistributedSampler sampler(n, replicas, rank, options);
    sampler.set_epoch(epoch);
    shards.push_back(sampler.indices());
  }
  return shards;
}

std::string describe(std::size_t n, int replicas, const SamplerOptions& options) {
  return fmt::format("n={} ranks={} shuffle={} drop_last={} seed={}", n, replicas, options.shuffle,
                     options.drop_last, options.seed);
}

/// Checks the shards of one configuration with padding; returns "" or what is wrong.
std::string check_padded_shards(std::size_t n, int replicas, const SamplerOptions& options) {
  if (n == 0 || replicas <= 0) return "check set-up: expected a non-empty data set and ranks";
  const std::size_t per_rank =
      (n + static_cast<std::size_t>(replicas) - 1) / static_cast<std::size_t>(replicas);
  const std::size_t total = per_rank * static_cast<std::size_t>(replicas);
  std::map<std::size_t, int> seen;
  for (int rank = 0; rank < replicas; ++rank) {
    DistributedSampler sampler(n, replicas, rank, options);
    sampler.set_epoch(2);
    if (sampler.num_samples() != per_rank)
      return fmt::format("rank {}: num_samples() is {}, expected ceil({}/{}) = {}", rank,
                         sampler.num_samples(), n, replicas, per_rank);
    const std::vector<std::size_t> shard = sampler.indices();
    if (shard.size() != per_rank)
      return fmt::format("rank {}: indices() has {} entries, expected num_samples() = {}", rank,
                         shard.size(), per_rank);
    for (std::size_t index : shard) {
      if (index >= n)
        return fmt::format("rank {}: index {} is past the data set (size {})", rank, index, n);
      ++seen[index];
    }
  }
  for (std::size_t index = 0; index < n; ++index)
    if (seen.count(index) == 0)
      return fmt::format("index {} is in no rank's shard; expected every index at least once",
                         index);
  // Padding repeats the list from its start, so no index can appear more than
  // ceil(total / n) times; more means shards overlap.
  const int most = static_cast<int>((total + n - 1) / n);
  for (const auto& [index, count] : seen)
    if (count > most)
      return fmt::format(
          "index {} appears {} times over all shards; expected at most {} ({} padded positions "
          "for {} samples): the shards overlap",
          index, count, most, total, n);
  return "";
}

TEST(Lab1Sampler, PaddedShardsCoverEveryIndex) {
  for (std::size_t n : kDatasetSizes)
    for (int replicas = 1; replicas <= kMaxRanks; ++replicas)
      for (bool shuffle : {false, true}) {
        const SamplerOptions options{.shuffle = shuffle, .seed = 11, .drop_last = false};
        const std::string problem = check_padded_shards(n, replicas, options);
        EXPECT_EQ(problem, "") << describe(n, replicas, options);
      }
}

TEST(Lab1Sampler, DropLastGivesEqualDisjointShards) {
  for (std::size_t n : kDatasetSizes)
    for (int replicas = 1; replicas <= kMaxRanks && static_cast<std::size_t>(replicas) <= n;
         ++replicas)
      for (bool shuffle : {false, true}) {
        const SamplerOptions options{.shuffle = shuffle, .seed = 5, .drop_last = true};
        const std::size_t per_rank = n / static_cast<std::size_t>(replicas);
        std::set<std::size_t> seen;
        for (int rank = 0; rank < replicas; ++rank) {
          DistributedSampler sampler(n, replicas, rank, options);
          ASSERT_EQ(sampler.num_samples(), per_rank)
              << describe(n, replicas, options) << ": expected floor(n/ranks) per rank";
          const std::vector<std::size_t> shard = sampler.indices();
          ASSERT_EQ(shard.size(), per_rank) << describe(n, replicas, options) << ", rank " << rank;
          for (std::size_t index : shard) {
            ASSERT_LT(index, n) << describe(n, replicas, options) << ", rank " << rank;
            ASSERT_TRUE(seen.insert(index).second)
                << describe(n, replicas, options) << ": index " << index
                << " is in two shards (or twice in one); with drop_last no index may repeat";
          }
        }
      }
}

TEST(Lab1Sampler, UnshuffledShardsAreStrided) {
  // PyTorch's order without shuffle: rank r takes r, r + N, r + 2N, ... (padding wraps).
  for (std::size_t n : kDatasetSizes)
    for (int replicas = 1; replicas <= kMaxRanks; ++replicas) {
      const SamplerOptions options{.shuffle = false};
      const auto shards = shards_of(n, replicas, options, 0);
      for (int rank = 0; rank < replicas; ++rank)
        for (std::size_t i = 0; i < shards[static_cast<std::size_t>(rank)].size(); ++i) {
          const std::size_t expected =
              (static_cast<std::size_t>(rank) + i * static_cast<std::size_t>(replicas)) % n;
          ASSERT_EQ(shards[static_cast<std::size_t>(rank)][i], expected)
              << describe(n, replicas, options) << ": rank " << rank << ", position " << i;
        }
    }
}

TEST(Lab1Sampler, ShuffleIsSeededPerEpochAndReproducible) {
  constexpr std::size_t n = 97;
  constexpr int replicas = 3;
  const SamplerOptions options{.shuffle = true, .seed = 42};
  const auto epoch0 = shards_of(n, replicas, options, 0);
  // The same (seed, epoch) in a fresh sampler gives the same shards: ranks that never
  // talk must agree on the permutation.
  EXPECT_EQ(shards_of(n, replicas, options, 0), epoch0)
      << "two samplers with equal seed and epoch gave different shards";
  // A new epoch is a new permutation, and so is a new seed.
  EXPECT_NE(shards_of(n, replicas, options, 1), epoch0)
      << "epochs 0 and 1 gave the same shards: set_epoch must change the shuffle";
  SamplerOptions other_seed = options;
  other_seed.seed = 43;
  EXPECT_NE(shards_of(n, replicas, other_seed, 0), epoch0)
      << "seeds 42 and 43 gave the same shards: the seed must select the shuffle";
  // Shuffled is not the identity order.
  const SamplerOptions unshuffled{.shuffle = false, .seed = 42};
  EXPECT_NE(epoch0, shards_of(n, replicas, unshuffled, 0))
      << "shuffle=true gave the unshuffled order";
}

// --- the broadcast ------------------------------------------------------------------------

const char* const kSpec = "64-32-16-10";

TEST(Lab1Broadcast, EveryRankHoldsRankZerosWeights) {
  const Model rank0_model = Model::mlp(kSpec, {.seed = 100});
  const std::vector<float> expected = rank0_model.flat_parameters();
  for (int world : world_sizes()) {
    run_on_ranks(world, [&](Communicator& comm, Verdict& verdict) {
      // Each rank starts from its own weights, and one parameter is frozen: the broadcast
      // must copy frozen parameters too.
      Model model = Model::mlp(kSpec, {.seed = 100 + static_cast<std::uint64_t>(comm.rank())});
      model.freeze("fc1.bias");
      if (comm.rank() != 0 && grading::compare_parameters(model, expected, 0).empty())
        verdict.fail("check set-up: this rank's weights equal rank 0's before the broadcast");
      broadcast_initial_weights(model, comm);
      verdict.expect_empty(
          grading::compare_parameters(model, expected, 0),
          "after broadcast_initial_weights, compared with rank 0's initial weights");
    });
  }
}

// --- training without synchronisation -----------------------------------------------------

constexpr std::int64_t kLocalBatch = 8;

/// This rank's model after training alone on the shard the (student's) sampler gives it:
/// the single-process loop of the handout, written out plainly.
std::vector<float> trained_on_own_shard(const Dataset& data, int world, int rank,
                                        const ReplicatedOptions& options, std::size_t& steps) {
  Model model = Model::mlp(kSpec, {.seed = 3});
  Sgd sgd(model.num_parameters(), {.lr = 0.1f});
  steps = 0;
  DistributedSampler sampler(data.size(), world, rank, options.sampler);
  for (int epoch = 0; epoch < options.epochs; ++epoch) {
    sampler.set_epoch(static_cast<std::uint64_t>(epoch));
    const std::vector<std::size_t> shard = sampler.indices();
    for (std::size_t start = 0; start < shard.size(); start += kLocalBatch) {
      const std::size_t count = std::min<std::size_t>(kLocalBatch, shard.size() - start);
      const Batch batch = gather_batch(data, std::span(shard).subspan(start, count));
      model.zero_grad();
      const Tensor logits = model.forward(batch.inputs);
      model.backward(logits, batch.labels);
      sgd.step(model);
      ++steps;
    }
  }
  return model.flat_parameters();
}

TEST(Lab1Replicated, EachReplicaTrainsOnItsOwnShardWithoutCommunicating) {
  const Dataset data = load_dataset("synthetic:100", /*seed=*/1);
  const ReplicatedOptions options{.local_batch = kLocalBatch, .epochs = 2, .sampler = {.seed = 9}};
  for (int world : world_sizes(4)) {
    run_on_ranks(world, [&](Communicator& comm, Verdict& verdict) {
      std::size_t expected_steps = 0;
      const std::vector<float> expected =
          trained_on_own_shard(data, comm.size(), comm.rank(), options, expected_steps);
      Model model = Model::mlp(kSpec, {.seed = 3});
      Sgd sgd(model.num_parameters(), {.lr = 0.1f});
      comm.reset_counters();
      const std::vector<float> losses = train_replicated(model, sgd, data, comm, options);
      const CommCounters counters = comm.counters();
      if (counters.collective_calls() != 0 || counters.total_bytes_sent() != 0)
        verdict.fail(fmt::format(
            "train_replicated communicated ({} collective calls, {} bytes sent); expected no "
            "communication at all in lab 1",
            counters.collective_calls(), counters.total_bytes_sent()));
      if (losses.size() != expected_steps)
        verdict.fail(fmt::format(
            "train_replicated took {} steps over 2 epochs; expected {} (every batch of {} of the "
            "shard, the last shorter one included)",
            losses.size(), expected_steps, kLocalBatch));
      verdict.expect_empty(grading::compare_parameters(model, expected, 0),
                           "compared with this rank's shard trained alone in one process");
    });
  }
}

TEST(Lab1Replicated, ReplicasDivergeAfterOneStepWithoutSync) {
  // The lesson of the lab: equal starting weights, different shards, no exchange of
  // gradients, and after a single step the replicas are different models.
  const Dataset data = load_dataset("synthetic:100", /*seed=*/1);
  const ReplicatedOptions options{.local_batch = kLocalBatch, .max_steps = 1};
  for (int world : world_sizes(4)) {
    if (world == 1) continue;
    run_on_ranks(world, [&](Communicator& comm, Verdict& verdict) {
      Model model = Model::mlp(kSpec, {.seed = 3});
      Sgd sgd(model.num_parameters(), {.lr = 0.1f});
      const std::vector<float> losses = train_replicated(model, sgd, data, comm, options);
      if (losses.size() != 1)
        verdict.fail(
            fmt::format("with max_steps = 1, train_replicated took {} steps", losses.size()));
      if (grading::compare_with_rank0(model, comm).empty() && comm.rank() != 0)
        verdict.fail(
            "after one step on different shards this replica is bitwise equal to rank 0's; "
            "expected the replicas to diverge, since nothing synchronises their gradients");
    });
  }
}

}  // namespace
}  // namespace dp::lab1
