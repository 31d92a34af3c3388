// Lab 1's graded checks: the sampler's shards, its shuffle (a uniform random permutation,
// tested statistically), the broadcast of the initial weights, and training without
// synchronisation (which must make the replicas diverge). Every check draws its
// configurations from the run's grading seed; rubric.json gives the points, the ranges drawn
// and the false-failure bound of the shuffle's test, and labs/lab1_replicated/README.md what
// each check grades.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "compare.h"
#include "dp/data.h"
#include "dp/error.h"
#include "dp/host_collectives.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "dp/rng.h"
#include "grading.h"
#include "lab1.h"

namespace dp::lab1 {
namespace {

using grading::Draws;
using grading::run_on_ranks;
using grading::Verdict;

/// Configurations each sampler check tries.
constexpr int kSamplerConfigurations = 40;

/// The checks insist that two shuffled orders differ only for data sets of at least this
/// many samples, where two random orders coincide with probability 1/n! < 5e-19, so that a
/// correct shuffle fails by chance less than once in 10^9 grades (rubric.json).
constexpr std::size_t kDistinctOrdersFrom = 20;

/// Consecutive epochs whose left-out samples must not all be the same with drop_last.
constexpr std::uint64_t kDropLastEpochs = 12;

/// For data sets of 2 to 19 samples, where two random orders coincide too often for the
/// checks to insist that two differ, this many epochs (or seeds) may not all give one order:
/// a uniform shuffle gives them one order with probability (1/n!)^63 <= 2^-63 < 1.1e-19.
constexpr std::uint64_t kSmallDataSetOrders = 64;

/// The side of the square of neighbouring (seed, epoch) pairs, seeds s..s+63 and epochs
/// e..e+63, whose orders must all differ. A shuffle seeded by a mix a seed + b epoch (the
/// sum, seed * 10 + epoch, seed ^ epoch, ...) gives (s, e + a) and (s + b, e) one order, so
/// the square catches every such mix with |a| and |b| (over their gcd) below 64. Its
/// 4,096 orders of n >= 20 samples coincide by chance with probability below
/// C(4096, 2) / 20! < 3.5e-12.
constexpr std::uint64_t kPairSquareSide = 64;

/// Large factors C of the mixes seed * C + epoch and seed + C * epoch that the square above
/// cannot reach (a check compares (s + 1, e) with (s, e + C), and (s + C, e) with
/// (s, e + 1)): round numbers a student might pick as "larger than any epoch" or "than any
/// seed"; each check adds a drawn one.
constexpr std::array<std::uint64_t, 11> kMixingFactors = {100,
                                                          256,
                                                          1000,
                                                          1024,
                                                          10'000,
                                                          65'536,
                                                          100'000,
                                                          1'000'000,
                                                          1u << 20,
                                                          1'000'000'000,
                                                          std::uint64_t{1} << 32};

/// One sampler configuration: data set size, ranks, options and epoch.
struct SamplerCase {
  std::size_t n = 1;
  int replicas = 1;
  SamplerOptions options;
  std::uint64_t epoch = 0;

  std::string describe() const {
    return fmt::format("n={} ranks={} shuffle={} drop_last={} seed={} epoch={}", n, replicas,
                       options.shuffle, options.drop_last, options.seed, epoch);
  }
};

/// A configuration drawn from `draws`: half of them small (n <= 12, so fewer samples than
/// ranks and heavy padding are common), the rest up to 200 samples.
SamplerCase draw_case(Draws& draws, bool drop_last) {
  SamplerCase c;
  const bool small = draws.coin("small");
  c.replicas = static_cast<int>(draws.integer("ranks", 1, 8));
  const std::int64_t smallest = drop_last ? c.replicas : 1;  // drop_last needs n >= ranks
  c.n = static_cast<std::size_t>(
      draws.integer("n", smallest, std::max<std::int64_t>(smallest, small ? 12 : 200)));
  c.options.shuffle = draws.coin("shuffle");
  c.options.drop_last = drop_last;
  c.options.seed = draws.seed("sampler seed");
  c.epoch = static_cast<std::uint64_t>(draws.integer("epoch", 0, 1000));
  return c;
}

/// Every rank's shard, each from a sampler of its own, as the ranks would build them.
std::vector<std::vector<std::size_t>> shards_of(const SamplerCase& c) {
  std::vector<std::vector<std::size_t>> shards;
  for (int rank = 0; rank < c.replicas; ++rank) {
    DistributedSampler sampler(c.n, c.replicas, rank, c.options);
    sampler.set_epoch(c.epoch);
    shards.push_back(sampler.indices());
  }
  return shards;
}

/// The interleaved list L[r + N i] = shard r's i-th index, or "" in `problem` when the
/// shards cannot be interleaved (unequal lengths).
std::vector<std::size_t> interleave(const std::vector<std::vector<std::size_t>>& shards,
                                    std::string& problem) {
  const std::size_t length = shards.front().size();
  for (std::size_t r = 0; r < shards.size(); ++r)
    if (shards[r].size() != length) {
      problem = fmt::format(
          "rank {}'s shard has {} indices but rank 0's has {}; expected equal "
          "lengths",
          r, shards[r].size(), length);
      return {};
    }
  std::vector<std::size_t> list(length * shards.size());
  for (std::size_t r = 0; r < shards.size(); ++r)
    for (std::size_t i = 0; i < length; ++i) list[r + shards.size() * i] = shards[r][i];
  return list;
}

/// The epoch's order of `c`: the indices of one rank's sampler with the same shuffle, seed
/// and epoch, without drop_last. The contract makes the order a function of (seed, epoch)
/// alone, so N ranks' interleaved shards must follow it, with or without drop_last.
std::vector<std::size_t> one_rank_order(const SamplerCase& c) {
  SamplerCase one_rank = c;
  one_rank.replicas = 1;
  one_rank.options.drop_last = false;
  return shards_of(one_rank).front();
}

/// "" when the first `count` entries of `list` are distinct indices below n, in the epoch's
/// order (`one_rank_order`; without shuffle 0, 1, 2, ...), else what is wrong.
std::string check_epoch_order(const std::vector<std::size_t>& list, std::size_t count,
                              const SamplerCase& c) {
  std::vector<char> seen(c.n, 0);
  for (std::size_t i = 0; i < count; ++i) {
    const std::size_t index = list[i];
    if (index >= c.n)
      return fmt::format(
          "position {} of the interleaved list holds index {}, past the data set "
          "of {}",
          i, index, c.n);
    if (!c.options.shuffle && index != i)
      return fmt::format(
          "without shuffle, position {} of the interleaved list (rank {}, entry {}) "
          "must hold index {}, not {}",
          i, i % static_cast<std::size_t>(c.replicas), i / static_cast<std::size_t>(c.replicas), i,
          index);
    if (seen[index] != 0)
      return fmt::format(
          "index {} appears twice among the first {} entries of the interleaved "
          "list (rank {} entry {}); expected every index at most once before the "
          "padding: shards overlap, or the ranks shuffled differently",
          index, count, i % static_cast<std::size_t>(c.replicas),
          i / static_cast<std::size_t>(c.replicas));
    seen[index] = 1;
  }
  // The same order on any number of ranks: a shuffle that is uniform on one rank and not on
  // several (the uniformity test below draws both) still fails here.
  const std::vector<std::size_t> order = one_rank_order(c);
  if (order.size() != c.n)
    return fmt::format(
        "one rank's sampler (the same seed and epoch, without drop_last) returned {} indices; "
        "expected all {}",
        order.size(), c.n);
  const auto replicas = static_cast<std::size_t>(c.replicas);
  for (std::size_t i = 0; i < count; ++i)
    if (list[i] != order[i])
      return fmt::format(
          "position {} of the interleaved list (rank {}, entry {}) holds index {}, but one "
          "rank's sampler (the same seed and epoch, without drop_last) puts index {} there; "
          "expected the epoch's order, which depends on (seed, epoch) alone: the same for "
          "every number of ranks, {}",
          i, i % replicas, i / replicas, list[i], order[i],
          c.options.drop_last ? "and with drop_last its head, the tail left out"
                              : "with or without drop_last");
  return "";
}

/// Runs `check` on `kSamplerConfigurations` drawn configurations and fails the test on the
/// first problem, naming the configuration; notes how many passed.
void for_drawn_cases(const char* check_name, bool drop_last,
                     const std::function<std::string(const SamplerCase&)>& check,
                     bool always_shuffle = false) {
  // Its own stream for each setting of drop_last, so that the two loops draw differently.
  Draws draws(fmt::format("{}/drop_last={}", check_name, drop_last));
  for (int i = 0; i < kSamplerConfigurations; ++i) {
    SamplerCase c = draw_case(draws, drop_last);
    if (always_shuffle) c.options.shuffle = true;
    std::string problem;
    try {
      problem = check(c);
    } catch (const NotImplemented& error) {
      FAIL() << error.what();
    } catch (const std::exception& error) {
      problem = fmt::format("{}: {}", grading::type_name(error), error.what());
    }
    if (!problem.empty())
      FAIL() << c.describe() << ": " << problem << "\n(grading seed " << grading::grade_seed()
             << ")";
  }
  grading::note_measured(
      fmt::format("{} drawn configurations {} drop_last (n up to 200, 1 to 8 ranks)",
                  kSamplerConfigurations, drop_last ? "with" : "without"));
}

TEST(Lab1Sampler, ShardLengths) {
  for (bool drop_last : {false, true})
    for_drawn_cases("Lab1Sampler.ShardLengths", drop_last, [](const SamplerCase& c) -> std::string {
      const auto n = c.n;
      const auto replicas = static_cast<std::size_t>(c.replicas);
      const std::size_t expected =
          c.options.drop_last ? n / replicas : (n + replicas - 1) / replicas;
      for (int rank = 0; rank < c.replicas; ++rank) {
        DistributedSampler sampler(c.n, c.replicas, rank, c.options);
        sampler.set_epoch(c.epoch);
        if (sampler.num_samples() != expected)
          return fmt::format("rank {}: num_samples() is {}; expected {}({}/{}) = {}", rank,
                             sampler.num_samples(), c.options.drop_last ? "floor" : "ceil", n,
                             replicas, expected);
        if (sampler.indices().size() != expected)
          return fmt::format("rank {}: indices() has {} entries; expected num_samples() = {}", rank,
                             sampler.indices().size(), expected);
      }
      return "";
    });
}

TEST(Lab1Sampler, PaddingRepeatsTheEpochOrderFromItsStart) {
  for_drawn_cases(
      "Lab1Sampler.PaddingRepeatsTheEpochOrderFromItsStart", false,
      [](const SamplerCase& c) -> std::string {
        std::string problem;
        const std::vector<std::size_t> list = interleave(shards_of(c), problem);
        if (!problem.empty()) return problem;
        const std::size_t per_rank =
            (c.n + static_cast<std::size_t>(c.replicas) - 1) / static_cast<std::size_t>(c.replicas);
        if (list.size() != per_rank * static_cast<std::size_t>(c.replicas))
          return fmt::format("the shards hold {} indices in all; expected {} (ceil(n/N) per rank)",
                             list.size(), per_rank * static_cast<std::size_t>(c.replicas));
        problem = check_epoch_order(list, c.n, c);
        if (!problem.empty()) return problem;
        for (std::size_t j = c.n; j < list.size(); ++j)
          if (list[j] != list[j % c.n])
            return fmt::format(
                "padding position {} (rank {}) holds index {}; expected {}, the entry at position "
                "{}: "
                "padding repeats the epoch's (shuffled) order from its start",
                j, j % static_cast<std::size_t>(c.replicas), list[j], list[j % c.n], j % c.n);
        return "";
      });
}

TEST(Lab1Sampler, DropLastLeavesOutTheTailOfTheEpochOrder) {
  for_drawn_cases(
      "Lab1Sampler.DropLastLeavesOutTheTailOfTheEpochOrder", true,
      [](const SamplerCase& c) -> std::string {
        std::string problem;
        const std::vector<std::size_t> list = interleave(shards_of(c), problem);
        if (!problem.empty()) return problem;
        const std::size_t total =
            c.n / static_cast<std::size_t>(c.replicas) * static_cast<std::size_t>(c.replicas);
        if (list.size() != total)
          return fmt::format("the shards hold {} indices in all; expected {} (floor(n/N) per rank)",
                             list.size(), total);
        // The kept samples are the head of the epoch's order, the order without drop_last:
        // check_epoch_order compares them with one rank's, so the samples left out are that
        // order's tail, exactly (cutting the unshuffled order, at either end, fails).
        problem = check_epoch_order(list, total, c);
        if (!problem.empty() || !c.options.shuffle || total == c.n || c.n < kDistinctOrdersFrom)
          return problem;
        // Shuffled, the samples left out must change with the epoch (implied by the above
        // when one rank's order changes with the epoch; said apart, since cutting before
        // shuffling leaves out the same samples every epoch). A random order leaves out
        // the same r = n - total samples as another epoch with probability 1/C(n, r) <= 1/20,
        // so 12 epochs all alike happen by chance with probability below 20^-11 = 5e-15.
        std::set<std::vector<std::size_t>> left_out_sets;
        for (std::uint64_t epoch = c.epoch; epoch < c.epoch + kDropLastEpochs; ++epoch) {
          SamplerCase other = c;
          other.epoch = epoch;
          std::vector<char> kept(c.n, 0);
          for (const auto& shard : shards_of(other))
            for (std::size_t index : shard)
              if (index < c.n) kept[index] = 1;
          std::vector<std::size_t> left_out;
          for (std::size_t index = 0; index < c.n; ++index)
            if (kept[index] == 0) left_out.push_back(index);
          left_out_sets.insert(left_out);
        }
        if (left_out_sets.size() == 1)
          return fmt::format(
              "epochs {} to {} all leave out the same samples; expected the tail of each epoch's "
              "shuffled order, which changes from epoch to epoch",
              c.epoch, c.epoch + kDropLastEpochs - 1);
        return "";
      });
}

/// Two (seed, epoch) pairs that a plausible mix of seed and epoch into one number makes
/// equal, and that mix.
struct FoldedPairs {
  SamplerCase first;
  SamplerCase second;
  std::string mix;
};

/// The pairs around `c` that the sum seed + epoch (offset 1 and `sum_offset`), seed * C +
/// epoch and seed + C * epoch (C of kMixingFactors and `factor`) fold together.
std::vector<FoldedPairs> folded_pairs(const SamplerCase& c, std::uint64_t sum_offset,
                                      std::uint64_t factor) {
  const auto at = [&c](std::uint64_t seed_offset, std::uint64_t epoch_offset) {
    SamplerCase moved = c;
    moved.options.seed += seed_offset;
    moved.epoch += epoch_offset;
    return moved;
  };
  std::vector<FoldedPairs> pairs;
  for (const std::uint64_t k : {std::uint64_t{1}, sum_offset})
    pairs.push_back({at(k, 0), at(0, k), "seed + epoch"});
  std::vector<std::uint64_t> factors(kMixingFactors.begin(), kMixingFactors.end());
  factors.push_back(factor);
  for (const std::uint64_t f : factors) {
    pairs.push_back({at(1, 0), at(0, f), fmt::format("seed * {} + epoch", f)});
    pairs.push_back({at(f, 0), at(0, 1), fmt::format("seed + {} * epoch", f)});
  }
  return pairs;
}

/// Whether the `count` orders of `vary(0)`, ..., `vary(count - 1)` (cases around `c`) are all
/// one order; sets `all_unshuffled` to whether they are all the unshuffled order.
bool all_give_one_order(const SamplerCase& c, std::uint64_t count,
                        const std::function<SamplerCase(std::uint64_t)>& vary,
                        bool& all_unshuffled) {
  SamplerCase unshuffled = c;
  unshuffled.options.shuffle = false;
  const auto unshuffled_shards = shards_of(unshuffled);
  const auto first = shards_of(vary(0));
  bool alike = true;
  all_unshuffled = first == unshuffled_shards;
  for (std::uint64_t k = 1; k < count; ++k) {
    const auto shards = shards_of(vary(k));
    alike = alike && shards == first;
    all_unshuffled = all_unshuffled && shards == unshuffled_shards;
  }
  return alike;
}

TEST(Lab1Sampler, ShuffleDependsOnSeedAndEpochOnly) {
  // The square of neighbouring pairs, and the offsets beyond it, drawn apart from the 40
  // configurations.
  Draws square_draws("Lab1Sampler.ShuffleDependsOnSeedAndEpochOnly/pairs");
  const auto sum_offset = static_cast<std::uint64_t>(
      square_draws.integer("seed + epoch offset", kPairSquareSide, 1'000'000));
  const auto factor =
      static_cast<std::uint64_t>(square_draws.integer("factor", kPairSquareSide, 1LL << 40));
  for_drawn_cases(
      "Lab1Sampler.ShuffleDependsOnSeedAndEpochOnly", false,
      [&](const SamplerCase& c) -> std::string {
        const auto shards = shards_of(c);
        if (shards_of(c) != shards)
          return "two samplers with equal seed and epoch gave different shards; expected the order "
                 "to depend on (seed, epoch) alone";
        if (c.n < kDistinctOrdersFrom) {
          // Two random orders of a few samples coincide often, but 64 of them all alike, or
          // all unshuffled, happen to a uniform shuffle with probability below 2^-63 < 1.1e-19
          // (n >= 2), 3 x 40 times per grade: below 1e-17.
          if (c.n < 2) return "";
          bool all_unshuffled = false;
          const bool epochs_alike = all_give_one_order(
              c, kSmallDataSetOrders,
              [&c](std::uint64_t k) {
                SamplerCase other = c;
                other.epoch += k;
                return other;
              },
              all_unshuffled);
          if (all_unshuffled)
            return fmt::format(
                "the {} epochs {} to {} all gave the unshuffled order with shuffle=true; a "
                "uniform shuffle of {} samples does so with probability (1/{}!)^{} < 2^-63: "
                "shuffle small data sets too",
                kSmallDataSetOrders, c.epoch, c.epoch + kSmallDataSetOrders - 1, c.n, c.n,
                kSmallDataSetOrders);
          if (epochs_alike)
            return fmt::format(
                "the {} epochs {} to {} all gave the same order; expected set_epoch to change "
                "it (a uniform shuffle of {} samples repeats one order {} times with "
                "probability below 2^-63)",
                kSmallDataSetOrders, c.epoch, c.epoch + kSmallDataSetOrders - 1, c.n,
                kSmallDataSetOrders);
          const bool seeds_alike = all_give_one_order(
              c, kSmallDataSetOrders,
              [&c](std::uint64_t k) {
                SamplerCase other = c;
                other.options.seed += k;
                return other;
              },
              all_unshuffled);
          if (seeds_alike)
            return fmt::format(
                "the {} seeds {} to {} all gave the same order at epoch {}; expected the seed "
                "to select it (a uniform shuffle of {} samples repeats one order {} times "
                "with probability below 2^-63)",
                kSmallDataSetOrders, c.options.seed, c.options.seed + kSmallDataSetOrders - 1,
                c.epoch, c.n, kSmallDataSetOrders);
          return "";
        }
        // Two random orders of n >= 20 samples coincide with probability 1/n! < 4.2e-19:
        // only then may the check insist that they differ (about 30 comparisons in each of
        // 40 configurations: below 1e-15 per grade).
        SamplerCase next_epoch = c;
        ++next_epoch.epoch;
        if (shards_of(next_epoch) == shards)
          return fmt::format(
              "epochs {} and {} gave the same shards; expected set_epoch to change the "
              "order",
              c.epoch, next_epoch.epoch);
        SamplerCase next_seed = c;
        ++next_seed.options.seed;
        if (shards_of(next_seed) == shards)
          return fmt::format(
              "seeds {} and {} gave the same shards; expected the seed to select the "
              "order",
              c.options.seed, next_seed.options.seed);
        // (seed, epoch) select the order as a pair: a mix of the two into one number gives
        // two pairs one order (seed + epoch: seed s at epoch e + 1 and seed s + 1 at epoch e).
        for (const FoldedPairs& pair : folded_pairs(c, sum_offset, factor))
          if (shards_of(pair.first) == shards_of(pair.second))
            return fmt::format(
                "seed {} at epoch {} and seed {} at epoch {} gave the same shards; expected the "
                "pair (seed, epoch) to select the order, not one number mixed from both (these "
                "two pairs have the same {})",
                pair.first.options.seed, pair.first.epoch, pair.second.options.seed,
                pair.second.epoch, pair.mix);
        SamplerCase unshuffled = c;
        unshuffled.options.shuffle = false;
        if (shards_of(unshuffled) == shards) return "shuffle=true gave the unshuffled order";
        return "";
      },
      /*always_shuffle=*/true);
  if (HasFailure()) return;

  // The square of 64 x 64 neighbouring pairs (seed + i, epoch + j): every order distinct.
  SamplerCase corner;
  corner.n = static_cast<std::size_t>(square_draws.integer("n", kDistinctOrdersFrom, 200));
  corner.replicas = static_cast<int>(square_draws.integer("ranks", 1, 8));
  corner.options.shuffle = true;
  corner.options.seed = square_draws.seed("first seed");
  corner.epoch = static_cast<std::uint64_t>(square_draws.integer("first epoch", 0, 1000));
  std::map<std::vector<std::size_t>, std::pair<std::uint64_t, std::uint64_t>> first_seen;
  for (std::uint64_t i = 0; i < kPairSquareSide; ++i)
    for (std::uint64_t j = 0; j < kPairSquareSide; ++j) {
      SamplerCase c = corner;
      c.options.seed += i;
      c.epoch += j;
      std::string problem;
      std::vector<std::size_t> list;
      try {
        list = interleave(shards_of(c), problem);
      } catch (const std::exception& error) {
        problem = fmt::format("{}: {}", grading::type_name(error), error.what());
      }
      if (!problem.empty())
        FAIL() << c.describe() << ": " << problem << "\n(" << square_draws.describe() << ")";
      const auto [earlier, inserted] = first_seen.try_emplace(list, c.options.seed, c.epoch);
      if (!inserted)
        FAIL() << fmt::format(
            "n={} ranks={}: seed {} at epoch {} and seed {} at epoch {} gave the same shards; "
            "expected the pair (seed, epoch) to select the order: no two of the {} x {} pairs "
            "of seeds {} to {} and epochs {} to {} may give one order (by chance below 3.5e-12), "
            "but a mix of seed and epoch into one number (a seed + b epoch, seed ^ epoch) folds "
            "some of them together\n({})",
            c.n, c.replicas, earlier->second.first, earlier->second.second, c.options.seed, c.epoch,
            kPairSquareSide, kPairSquareSide, corner.options.seed,
            corner.options.seed + kPairSquareSide - 1, corner.epoch,
            corner.epoch + kPairSquareSide - 1, square_draws.describe());
    }
  grading::note_measured(fmt::format(
      "the {} orders of seeds {} to {} at epochs {} to {} (n = {}, {} rank(s)) all differ; so "
      "do the pairs that seed * C + epoch and seed + C * epoch fold together for C up to 2^32",
      kPairSquareSide * kPairSquareSide, corner.options.seed,
      corner.options.seed + kPairSquareSide - 1, corner.epoch, corner.epoch + kPairSquareSide - 1,
      corner.n, corner.replicas));
}

// --- the shuffle's randomness ---------------------------------------------------------------
//
// A shuffle must be a uniform random permutation: every one of the n! orders equally likely.
// Orders that merely differ from epoch to epoch are not enough: a rotation by a number drawn
// from (seed, epoch), a reversal, Fisher-Yates with below(i) (Sattolo's algorithm: one long
// cycle, never a sample left in place), a handful of random swaps, a riffle, an involution or
// a shuffle seeded from a few values of the seed all pass the checks above.
//
// The test. For two data sets, one of even size n in [20, 200] on 1 to 8 ranks and one of
// odd size in [21, 199] on 2 to 8, it takes the order of each of 40 drawn seeds at 200
// consecutive epochs (the first n entries of the interleaved shards): M = 16,000
// permutations. (It used to take one rank and n in [20, 31] only, and a shuffle that was
// uniform only in that shape scored full marks.) Under the null hypothesis (a correct shuffle,
// whose orders for distinct (seed, epoch) are independent and uniform) it knows exactly how often
// each of six events happens, and it fails when a count leaves the interval that a uniform shuffle
// leaves with probability below 5e-11 on each side:
//
//   event                         P(event) for a uniform permutation of n
//   no fixed point                d(n)   = sum_{j=0..n} (-1)^j / j!          (about 1/e)
//   exactly one fixed point       d(n-1)                                     (about 1/e)
//   no 2-cycle                    sum_{j=0..n/2} (-1)^j / (2^j j!)           (about e^-1/2)
//   no v followed by v + 1        sum_{j=0..n-1} (-1)^j (n-j) / (n j!)        (about 1/e)
//   no v followed by v - 1        the same (reverse the order)
//   a cycle longer than n/2       sum_{k=n/2+1..n} 1/k                        (about ln 2)
//
// (Inclusion-exclusion: j given points are all fixed with probability (n-j)!/n!, and there
// are C(n, j) sets of them; j disjoint 2-cycles can be chosen n!/(2^j j! (n-2j)!) ways, each
// present with probability (n-2j)!/n!; j of the n-1 successions v, v+1 glue the values into
// n-j blocks, (n-j)! orders of C(n-1, j) sets; a k-cycle with k > n/2 is unique if present,
// and present with probability 1/k. Exactly one fixed point: n choices times the
// derangements of the other n-1.)
//
// The bound. A count X of an event over M independent permutations whose probabilities
// average p obeys Chernoff's bound P(X >= M q) <= exp(-M KL(q || p)) for q > p, and the same
// below p (KL: the Kullback-Leibler divergence of Bernoulli distributions; it holds for
// unequal probabilities too, since log(1 - p + p e^t) is concave in p). The interval
// [M q_low, M q_high] solves M KL(q || p) = ln(1 / 5e-11), so each of the 12 tails is below
// 5e-11. Any two of the 8,000 permutations of one size coincide with probability below
// C(8000, 2) / 20! < 1.4e-11 (the check fails on a repeat: a shuffle with few possible orders
// repeats). A correct shuffle therefore fails this check with probability below
// 12 x 5e-11 + 2 x 1.4e-11 < 6.3e-10 per grade. With M = 16,000 the intervals are about
// +-0.026 wide around p = 0.37: a shuffle that moves an event's frequency by 3 points fails.

/// What the six events of the uniformity test read off one permutation.
struct PermutationShape {
  std::size_t fixed_points = 0;
  bool has_two_cycle = false;
  bool has_rising_succession = false;   // some v is followed by v + 1
  bool has_falling_succession = false;  // some v is followed by v - 1
  std::size_t longest_cycle = 0;
};

/// The shape of `order`, a permutation of 0..n-1 (position i holds order[i]).
PermutationShape shape_of(const std::vector<std::size_t>& order) {
  PermutationShape shape;
  const std::size_t n = order.size();
  for (std::size_t i = 0; i < n; ++i) {
    shape.fixed_points += order[i] == i ? 1 : 0;
    if (order[i] != i && order[order[i]] == i) shape.has_two_cycle = true;
    if (i + 1 < n && order[i + 1] == order[i] + 1) shape.has_rising_succession = true;
    if (i + 1 < n && order[i + 1] + 1 == order[i]) shape.has_falling_succession = true;
  }
  std::vector<char> visited(n, 0);
  for (std::size_t start = 0; start < n; ++start) {
    std::size_t length = 0;
    for (std::size_t i = start; visited[i] == 0; i = order[i]) {
      visited[i] = 1;
      ++length;
    }
    shape.longest_cycle = std::max(shape.longest_cycle, length);
  }
  return shape;
}

/// One event of the test, its probability for a uniform permutation of n (the derivations
/// are above), and what a shuffle that shows it too often or too rarely likely does.
struct PermutationEvent {
  const char* name;
  bool (*holds)(const PermutationShape& shape, std::size_t n);
  double (*probability)(std::size_t n);
  const char* too_often;
  const char* too_rarely;
};

/// sum_{j=0..last} term(j) / j!, added from the smallest term up.
template <typename Term>
double exponential_series(std::size_t last, Term term) {
  std::vector<double> terms;
  double factorial = 1;
  for (std::size_t j = 0; j <= last; ++j) {
    if (j > 0) factorial *= static_cast<double>(j);
    terms.push_back(term(j) / factorial);
  }
  double sum = 0;
  for (std::size_t j = terms.size(); j-- > 0;) sum += terms[j];
  return sum;
}

double no_fixed_point_probability(std::size_t n) {
  return exponential_series(n, [](std::size_t j) { return j % 2 == 0 ? 1.0 : -1.0; });
}

/// P(no v followed by v + 1) for a uniform permutation of n: sum_j (-1)^j (n - j) / (n j!)
/// over j < n. By symmetry (reverse every value) it is also P(no v followed by v - 1).
double no_succession_probability(std::size_t n) {
  return exponential_series(n - 1, [n](std::size_t j) {
    return (j % 2 == 0 ? 1.0 : -1.0) * static_cast<double>(n - j) / static_cast<double>(n);
  });
}

const std::array<PermutationEvent, 6> kPermutationEvents = {{
    {"no fixed point", [](const PermutationShape& s, std::size_t) { return s.fixed_points == 0; },
     no_fixed_point_probability,
     "a shuffle that never leaves a sample in place (Fisher-Yates with below(i) instead of "
     "below(i + 1), or a rotation)",
     "a shuffle that leaves many samples in place (a few random swaps)"},
    {"exactly one fixed point",
     [](const PermutationShape& s, std::size_t) { return s.fixed_points == 1; },
     [](std::size_t n) { return no_fixed_point_probability(n - 1); },
     "a shuffle with a fixed point by construction (a reversal of an odd number of samples)",
     "a shuffle whose fixed points come all or none (a rotation, the identity now and then)"},
    {"no 2-cycle", [](const PermutationShape& s, std::size_t) { return !s.has_two_cycle; },
     [](std::size_t n) {
       return exponential_series(n / 2, [](std::size_t j) {
         return (j % 2 == 0 ? 1.0 : -1.0) / std::pow(2.0, static_cast<double>(j));
       });
     },
     "a shuffle that avoids swapping two samples with each other",
     "a shuffle made of swapped pairs (a reversal, a product of disjoint swaps)"},
    {"no v followed by v + 1",
     [](const PermutationShape& s, std::size_t) { return !s.has_rising_succession; },
     no_succession_probability, "a shuffle that breaks up every run of consecutive samples",
     "a shuffle that keeps runs of the unshuffled order (a rotation, a riffle, a few swaps)"},
    {"no v followed by v - 1",
     [](const PermutationShape& s, std::size_t) { return !s.has_falling_succession; },
     no_succession_probability, "a shuffle that breaks up every reversed run",
     "a shuffle that keeps runs of the reversed order (a reversal)"},
    {"a cycle longer than n/2",
     [](const PermutationShape& s, std::size_t n) { return 2 * s.longest_cycle > n; },
     [](std::size_t n) {
       double sum = 0;
       for (std::size_t k = n; k > n / 2; --k) sum += 1.0 / static_cast<double>(k);
       return sum;
     },
     "a shuffle that makes one long cycle (Fisher-Yates with below(i), a rotation)",
     "a shuffle of short cycles (swapped pairs, a few swaps)"},
}};

/// The probability of each tail of each event's count that a uniform shuffle reaches.
constexpr double kTailProbability = 5e-11;

/// KL(q || p) of two Bernoulli distributions.
double bernoulli_divergence(double q, double p) {
  double divergence = 0;
  if (q > 0) divergence += q * std::log(q / p);
  if (q < 1) divergence += (1 - q) * std::log((1 - q) / (1 - p));
  return divergence;
}

/// The interval of frequencies [q_low, q_high] around p that M independent trials of mean
/// probability p leave, on each side, with probability below `tail` (Chernoff: M KL(q || p) =
/// ln(1 / tail) at both ends, found by bisection).
std::pair<double, double> chernoff_interval(double p, double trials, double tail) {
  const double limit = std::log(1 / tail);
  const auto solve = [&](double inside, double outside) {
    for (int i = 0; i < 200; ++i) {
      const double middle = (inside + outside) / 2;
      (trials * bernoulli_divergence(middle, p) > limit ? outside : inside) = middle;
    }
    return outside;
  };
  return {solve(p, 0.0), solve(p, 1.0)};
}

TEST(Lab1Sampler, ShuffleIsUniform) {
  Draws draws("Lab1Sampler.ShuffleIsUniform");
  constexpr int kSeeds = 40;
  constexpr std::uint64_t kEpochs = 200;
  // One even and one odd size, the first on 1 to 8 ranks and the second on 2 to 8: code
  // that shuffles well only in some shapes (one rank, a few sizes) meets others, and the
  // checks above compare every number of ranks with one.
  const auto even_n = 2 * static_cast<std::size_t>(draws.integer("even n / 2", 10, 100));
  draws.overrule("even n / 2", fmt::format("even n={}", even_n));
  const auto odd_n = 2 * static_cast<std::size_t>(draws.integer("odd n / 2", 10, 99)) + 1;
  draws.overrule("odd n / 2", fmt::format("odd n={}", odd_n));
  const std::array<std::size_t, 2> sizes = {even_n, odd_n};
  const std::array<int, 2> ranks = {static_cast<int>(draws.integer("ranks for even n", 1, 8)),
                                    static_cast<int>(draws.integer("ranks for odd n", 2, 8))};
  const std::uint64_t first_epoch =
      static_cast<std::uint64_t>(draws.integer("first epoch", 0, 1'000'000));
  // 40 distinct sampler seeds below 10^6, from a stream of the drawn one.
  const std::uint64_t seed_stream = draws.seed("sampler seeds from");
  std::vector<std::uint64_t> seeds;
  CounterRng seed_rng(seed_stream, 0x5eed);
  while (seeds.size() < kSeeds) {
    const std::uint64_t seed = seed_rng.below(1'000'000);
    if (std::find(seeds.begin(), seeds.end(), seed) == seeds.end()) seeds.push_back(seed);
  }
  const auto where = [&](std::size_t n, std::uint64_t seed, std::uint64_t epoch) {
    return fmt::format("n={} seed={} epoch={}", n, seed, epoch);
  };

  std::array<std::size_t, kPermutationEvents.size()> counts{};
  std::array<double, kPermutationEvents.size()> expected_sum{};
  std::size_t permutations = 0;
  for (std::size_t size = 0; size < sizes.size(); ++size) {
    const std::size_t n = sizes[size];
    const int replicas = ranks[size];
    std::map<std::vector<std::size_t>, std::pair<std::uint64_t, std::uint64_t>> first_seen;
    for (const std::uint64_t seed : seeds)
      for (std::uint64_t epoch = first_epoch; epoch < first_epoch + kEpochs; ++epoch) {
        // The epoch's order: the first n entries of the interleaved shards (n > 8 >= N).
        std::vector<std::size_t> order;
        try {
          SamplerCase c{.n = n,
                        .replicas = replicas,
                        .options = {.shuffle = true, .seed = seed},
                        .epoch = epoch};
          std::string problem;
          order = interleave(shards_of(c), problem);
          if (!problem.empty())
            FAIL() << where(n, seed, epoch) << ", " << replicas << " rank(s): " << problem << "\n("
                   << draws.describe() << ")";
          if (order.size() > n) order.resize(n);
        } catch (const NotImplemented& error) {
          FAIL() << error.what();
        } catch (const std::exception& error) {
          FAIL() << where(n, seed, epoch) << ", " << replicas
                 << " rank(s): " << grading::type_name(error) << ": " << error.what() << "\n("
                 << draws.describe() << ")";
        }
        std::vector<char> present(n, 0);
        for (const std::size_t index : order)
          if (index < n) present[index] = 1;
        if (order.size() != n ||
            std::count(present.begin(), present.end(), 1) != static_cast<std::ptrdiff_t>(n))
          FAIL() << fmt::format(
              "{}, {} rank(s): the first {} entries of the interleaved shards are not a "
              "permutation of 0..{} ({} entries); expected the shuffled epoch order\n({})",
              where(n, seed, epoch), replicas, n, n - 1, order.size(), draws.describe());
        const auto [earlier, inserted] = first_seen.try_emplace(order, seed, epoch);
        if (!inserted)
          FAIL() << fmt::format(
              "{} gives the same order as seed={} epoch={}; expected independent uniform random "
              "orders, of which two of these {} x {} coincide with probability below 1.4e-11: "
              "the shuffle reaches few orders, or some far more often than others (a seed or an "
              "epoch reduced to a few values, a rotation, a riffle)\n({})",
              where(n, seed, epoch), earlier->second.first, earlier->second.second, kSeeds, kEpochs,
              draws.describe());
        const PermutationShape shape = shape_of(order);
        for (std::size_t e = 0; e < kPermutationEvents.size(); ++e) {
          counts[e] += kPermutationEvents[e].holds(shape, n) ? 1 : 0;
          expected_sum[e] += kPermutationEvents[e].probability(n);
        }
        ++permutations;
      }
  }

  const auto trials = static_cast<double>(permutations);
  double largest_z = 0;
  std::string largest;
  for (std::size_t e = 0; e < kPermutationEvents.size(); ++e) {
    const PermutationEvent& event = kPermutationEvents[e];
    const double p = expected_sum[e] / trials;
    const auto [low, high] = chernoff_interval(p, trials, kTailProbability);
    const double seen = static_cast<double>(counts[e]) / trials;
    if (seen < low || seen > high)
      ADD_FAILURE() << fmt::format(
          "\"{}\" held for {} of {} shuffled orders ({:.4f}); a uniform random permutation "
          "gives {:.4f} on average, and lands outside [{:.4f}, {:.4f}] with probability below "
          "{:.0e}: the orders are not uniform. Seen {}, as in {}\n({})",
          event.name, counts[e], permutations, seen, p, low, high, kTailProbability,
          seen > high ? "too often" : "too rarely",
          seen > high ? event.too_often : event.too_rarely, draws.describe());
    const double z = std::abs(seen - p) / std::sqrt(p * (1 - p) / trials);
    if (z >= largest_z) {
      largest_z = z;
      largest = fmt::format("\"{}\" {:.4f} against {:.4f}", event.name, seen, p);
    }
  }
  if (!HasFailure())
    grading::note_measured(fmt::format(
        "{} orders (n = {} on {} rank(s) and {} on {}, {} seeds x {} epochs), all distinct; "
        "fixed points, 2-cycles, "
        "successions and long cycles as often as in uniform permutations (largest deviation "
        "{:.1f} standard deviations: {}); a uniform shuffle fails this check with probability "
        "below 6.3e-10",
        permutations, sizes[0], ranks[0], sizes[1], ranks[1], kSeeds, kEpochs, largest_z, largest));
}

// --- the broadcast ------------------------------------------------------------------------

/// An MLP "64-h1-h2-10" with drawn hidden widths.
std::string draw_spec(Draws& draws) {
  return fmt::format("64-{}-{}-10", draws.integer("hidden1", 8, 48),
                     draws.integer("hidden2", 8, 32));
}

TEST(Lab1Broadcast, EveryRankHoldsRankZerosWeights) {
  Draws draws("Lab1Broadcast.EveryRankHoldsRankZerosWeights");
  const std::string spec = draw_spec(draws);
  const std::uint64_t seed = draws.seed("model seed");
  const Model reference = Model::mlp(spec, {.seed = seed});
  const std::vector<float> expected = reference.flat_parameters();
  const std::string frozen =
      draws.pick("frozen", std::vector<std::string>{"fc1.weight", "fc1.bias", "fc2.weight",
                                                    "fc2.bias", "fc3.weight", "fc3.bias"});
  const std::uint64_t model_bytes = expected.size() * sizeof(float);
  for (int world : draws.world_sizes()) {
    run_on_ranks(
        world,
        [&](Communicator& comm, Verdict& verdict) {
          // Each rank starts from weights of its own; one parameter is frozen, and the
          // broadcast must copy it too.
          Model model = Model::mlp(spec, {.seed = seed + static_cast<std::uint64_t>(comm.rank()),
                                          .device = grading::check_device()});
          model.freeze(frozen);
          const CommCounters before = comm.counters();
          broadcast_initial_weights(model, comm);
          const CommCounters moved = comm.counters().since(before);
          verdict.expect_empty(grading::compare_parameters(model, expected, 0),
                               "after broadcast_initial_weights, compared with rank 0's weights");
          const std::uint64_t received = moved.total_bytes_received();
          const std::uint64_t expected_received = comm.rank() == 0 ? 0 : model_bytes;
          if (received != expected_received)
            verdict.fail(fmt::format(
                "this rank received {} bytes; expected {} (every parameter's bytes exactly once{})",
                received, expected_received, comm.rank() == 0 ? ", and nothing on rank 0" : ""));
          if (verdict.passed() && comm.size() > 1)
            verdict.note(
                fmt::format("each of the {} other ranks received the {} parameter "
                            "elements ({} bytes) once, in {} call(s)",
                            comm.size() - 1, expected.size(), model_bytes, moved.total_calls()));
        },
        draws);
  }
}

// --- training without synchronisation -----------------------------------------------------

/// One drawn training set-up of the replicated checks.
struct ReplicatedCase {
  std::string spec;
  std::uint64_t model_seed = 0;
  std::shared_ptr<const Dataset> data;  // shared: a case is copied to vary max_steps
  ReplicatedOptions options;
};

/// A drawn training set-up; `epochs` fixes the number of epochs instead of drawing it.
ReplicatedCase draw_training(Draws& draws, int epochs = 0) {
  ReplicatedCase c;
  c.spec = draw_spec(draws);
  c.model_seed = draws.seed("model seed");
  const std::int64_t drawn_samples = draws.integer("samples", 20, 90);
  // Not a multiple of 2 or 3, so that drop_last and padding change the shards on 2, 3 and
  // 4 ranks. The description says what ran (a failure used to print the draw).
  std::int64_t samples = drawn_samples;
  while (samples % 2 == 0 || samples % 3 == 0) ++samples;
  if (samples != drawn_samples)
    draws.overrule("samples", fmt::format("samples={} (drawn {}; never a multiple of 2 or 3)",
                                          samples, drawn_samples));
  c.data = std::make_shared<const Dataset>(
      load_dataset(fmt::format("synthetic:{}", samples), draws.seed("data seed")));
  const std::int64_t drawn_batch = draws.integer("local batch", 3, 12);
  c.options.local_batch = drawn_batch;
  // On one rank the shard is the whole data set: never a multiple of the batch, so that
  // every run has a last, shorter batch.
  while (c.data->size() % static_cast<std::size_t>(c.options.local_batch) == 0)
    c.options.local_batch += 1;
  if (c.options.local_batch != drawn_batch)
    draws.overrule("local batch",
                   fmt::format("local batch={} (drawn {}; never dividing the data set)",
                               c.options.local_batch, drawn_batch));
  c.options.epochs = epochs > 0 ? epochs : static_cast<int>(draws.integer("epochs", 1, 3));
  c.options.sampler.shuffle = draws.coin("shuffle");
  c.options.sampler.drop_last = draws.coin("drop_last");
  c.options.sampler.seed = draws.seed("sampler seed");
  return c;
}

/// What this rank's training must produce: the same steps run plainly in one process on
/// the shards of the (student's) sampler. Losses of every step, and the final parameters.
struct Expected {
  std::vector<float> losses;
  std::vector<float> parameters;
  std::vector<int> epoch_of_step;  // the epoch each step belongs to
};

Expected train_alone(const ReplicatedCase& c, int world, int rank) {
  Model model = Model::mlp(c.spec, {.seed = c.model_seed, .device = grading::check_device()});
  Sgd sgd(model.num_parameters(), {.lr = 0.1f}, model.device());
  Expected expected;
  DistributedSampler sampler(c.data->size(), world, rank, c.options.sampler);
  const auto batch = static_cast<std::size_t>(c.options.local_batch);
  for (int epoch = 0; epoch < c.options.epochs; ++epoch) {
    sampler.set_epoch(static_cast<std::uint64_t>(epoch));
    const std::vector<std::size_t> shard = sampler.indices();
    for (std::size_t start = 0; start < shard.size(); start += batch) {
      if (c.options.max_steps >= 0 &&
          expected.losses.size() >= static_cast<std::size_t>(c.options.max_steps))
        break;
      const Batch b = gather_batch(
          *c.data, std::span(shard).subspan(start, std::min(batch, shard.size() - start)));
      model.zero_grad();
      const Tensor logits = model.forward(b.inputs.to(model.device()));
      expected.losses.push_back(model.backward(logits, b.labels));
      expected.epoch_of_step.push_back(epoch);
      sgd.step(model);
    }
  }
  expected.parameters = model.flat_parameters();
  return expected;
}

/// Runs the student's train_replicated on every drawn world size (up to 4 ranks) and hands
/// each rank's outcome to `judge`.
void for_replicated_runs(
    const char* check_name,
    const std::function<void(const ReplicatedCase&, Communicator&, Verdict&, const Model&,
                             const std::vector<float>&, const CommCounters&)>& judge) {
  Draws draws(check_name);
  ReplicatedCase drawn = draw_training(draws, static_cast<int>(draws.integer("epochs", 2, 3)));
  // Shuffled over several epochs, so that a forgotten set_epoch shows; and with drop_last
  // both off and on, so that ignoring it shows.
  drawn.options.sampler.shuffle = true;
  draws.overrule("shuffle", "shuffle=true (set by the check)");
  draws.overrule("drop_last", "drop_last=false then true (set by the check)");
  // The world sizes of each setting, named by it in the description.
  std::array<std::vector<int>, 2> world_sizes;
  for (const bool drop_last : {false, true}) {
    world_sizes[drop_last ? 1 : 0] = draws.world_sizes(4);
    std::string sizes;
    for (const int world : world_sizes[drop_last ? 1 : 0])
      sizes += fmt::format("{}{}", sizes.empty() ? "" : ",", world);
    draws.overrule("world sizes",
                   fmt::format("world sizes with drop_last={}: {}", drop_last, sizes));
  }
  for (const bool drop_last : {false, true}) {
    ReplicatedCase c = drawn;
    c.options.sampler.drop_last = drop_last;
    for (int world : world_sizes[drop_last ? 1 : 0]) {
      run_on_ranks(
          world,
          [&](Communicator& comm, Verdict& verdict) {
            Model model =
                Model::mlp(c.spec, {.seed = c.model_seed, .device = grading::check_device()});
            Sgd sgd(model.num_parameters(), {.lr = 0.1f}, model.device());
            const CommCounters before = comm.counters();
            const std::vector<float> losses =
                train_replicated(model, sgd, *c.data, comm, c.options);
            const CommCounters during = comm.counters().since(before);
            judge(c, comm, verdict, model, losses, during);
          },
          draws);
    }
  }
}

TEST(Lab1Replicated, EachReplicaTrainsOnItsOwnShardWithoutCommunicating) {
  for_replicated_runs(
      "Lab1Replicated.EachReplicaTrainsOnItsOwnShardWithoutCommunicating",
      [](const ReplicatedCase& c, Communicator& comm, Verdict& verdict, const Model& model,
         const std::vector<float>& losses, const CommCounters& during) {
        const Expected expected = train_alone(c, comm.size(), comm.rank());
        if (during.total_calls() != 0)
          verdict.fail(
              fmt::format("train_replicated made {} communicator calls ({} bytes sent); "
                          "expected none at all in lab 1",
                          during.total_calls(), during.total_bytes_sent()));
        if (losses.size() != expected.losses.size())
          verdict.fail(fmt::format(
              "train_replicated took {} steps; expected {} ({} epoch(s) of "
              "this rank's shard in batches of {}, the last shorter)",
              losses.size(), expected.losses.size(), c.options.epochs, c.options.local_batch));
        verdict.expect_empty(grading::compare_parameters(model, expected.parameters, 0),
                             "compared with this rank's shard trained alone in one process");
        // Where the run first went another way says a lot: a later epoch that starts wrong
        // after a right first epoch is a sampler left at epoch 0.
        for (std::size_t step = 0; step < std::min(losses.size(), expected.losses.size()); ++step)
          if (std::memcmp(&losses[step], &expected.losses[step], sizeof(float)) != 0) {
            const int epoch = expected.epoch_of_step[step];
            verdict.fail(fmt::format(
                "the first step whose loss differs is step {} (epoch {}){}", step + 1, epoch,
                epoch > 0 && (step == 0 || expected.epoch_of_step[step - 1] != epoch)
                    ? ": every earlier epoch was right; is the sampler set to each new epoch?"
                    : ""));
            break;
          }
        if (verdict.passed() && comm.rank() == 0)
          verdict.note(
              fmt::format("drop_last={}: each replica equals its shard trained alone, "
                          "bitwise, after {} step(s) over {} shuffled epochs; no "
                          "communication",
                          c.options.sampler.drop_last, losses.size(), c.options.epochs));
      });
}

/// "" when `losses` are bitwise `expected`, else the first difference.
std::string compare_losses(const std::vector<float>& losses, const std::vector<float>& expected,
                           const ReplicatedOptions& options) {
  if (losses.size() != expected.size())
    return fmt::format(
        "train_replicated returned {} losses; expected {}: one per step, {} epoch(s){}",
        losses.size(), expected.size(), options.epochs,
        options.max_steps >= 0
            ? fmt::format(", at most max_steps = {} steps counted over all epochs",
                          options.max_steps)
            : std::string());
  for (std::size_t step = 0; step < losses.size(); ++step)
    if (std::memcmp(&losses[step], &expected[step], sizeof(float)) != 0)
      return fmt::format(
          "the loss of step {} is {:.9g}; expected {:.9g}, the mean loss "
          "Model::backward returned for that step's batch{}",
          step + 1, losses[step], expected[step],
          std::abs(losses[step] / expected[step] - 1) > 0.5 ? " (a sum, or another step's loss?)"
                                                            : "");
  return "";
}

TEST(Lab1Replicated, ReturnsTheLossOfEveryStepAndStopsAtMaxSteps) {
  Draws draws("Lab1Replicated.ReturnsTheLossOfEveryStepAndStopsAtMaxSteps");
  const ReplicatedCase c = draw_training(draws, /*epochs=*/3);
  // Where max_steps stops the run: in the second epoch, at a drawn step.
  const std::int64_t stop_draw = draws.integer("stop position", 0, 1 << 20);
  for (int world : draws.world_sizes(4)) {
    run_on_ranks(
        world,
        [&](Communicator& comm, Verdict& verdict) {
          // Steps per epoch, from the shard length of the contract (not from your sampler).
          const std::size_t n = c.data->size();
          const auto ranks = static_cast<std::size_t>(world);
          const std::size_t shard =
              c.options.sampler.drop_last ? n / ranks : (n + ranks - 1) / ranks;
          const auto batch = static_cast<std::size_t>(c.options.local_batch);
          const auto per_epoch = static_cast<std::int64_t>((shard + batch - 1) / batch);
          ReplicatedCase stopped = c;
          stopped.options.max_steps = static_cast<int>(per_epoch + 1 + stop_draw % per_epoch);
          ReplicatedCase no_steps = c;  // max_steps = 0: no step at all, not "no limit"
          no_steps.options.max_steps = 0;
          for (const ReplicatedCase* run :
               std::array<const ReplicatedCase*, 3>{&c, &stopped, &no_steps}) {
            Model model =
                Model::mlp(run->spec, {.seed = run->model_seed, .device = grading::check_device()});
            Sgd sgd(model.num_parameters(), {.lr = 0.1f}, model.device());
            const std::vector<float> losses =
                train_replicated(model, sgd, *run->data, comm, run->options);
            const Expected expected = train_alone(*run, world, comm.rank());
            const std::string finding = compare_losses(losses, expected.losses, run->options);
            if (!finding.empty()) {
              verdict.fail(run->options.max_steps >= 0
                               ? fmt::format("with max_steps = {} ({} steps per epoch): {}",
                                             run->options.max_steps, per_epoch, finding)
                               : finding);
              return;
            }
          }
          if (comm.rank() == 0)
            verdict.note(
                fmt::format("3 epochs of {} step(s), max_steps = {} stopping in the second, and "
                            "max_steps = 0: every loss bitwise",
                            per_epoch, stopped.options.max_steps));
        },
        draws);
  }
}

TEST(Lab1Replicated, ReplicasDivergeAfterOneStepWithoutSync) {
  // The lesson of the lab: equal starting weights, different shards, no exchange of
  // gradients, and after a single step the replicas are different models.
  Draws draws("Lab1Replicated.ReplicasDivergeAfterOneStepWithoutSync");
  ReplicatedCase c = draw_training(draws);
  c.options.max_steps = 1;
  c.options.sampler.drop_last = false;
  draws.overrule("drop_last", "drop_last=false max_steps=1 (set by the check)");
  for (int world : draws.world_sizes(4)) {
    if (world == 1) continue;
    run_on_ranks(
        world,
        [&](Communicator& comm, Verdict& verdict) {
          Model model =
              Model::mlp(c.spec, {.seed = c.model_seed, .device = grading::check_device()});
          Sgd sgd(model.num_parameters(), {.lr = 0.1f}, model.device());
          const std::vector<float> losses = train_replicated(model, sgd, *c.data, comm, c.options);
          if (losses.size() != 1)
            verdict.fail(
                fmt::format("with max_steps = 1, train_replicated took {} steps", losses.size()));
          // Every rank measures its distance to rank 0's replica (a collective: all take part).
          std::vector<float> mine = model.flat_parameters();
          std::vector<float> rank0 = mine;
          broadcast_host_values(std::span<float>(rank0), 0, comm);
          const auto mine_to_rank0 = static_cast<float>(grading::max_abs_difference(mine, rank0));
          std::vector<float> distance = {mine_to_rank0};
          allreduce_host_values(std::span<float>(distance), ReduceOp::kMax, comm);
          if (comm.rank() != 0 && mine_to_rank0 == 0)
            verdict.fail(
                "after one step on different shards this replica is bitwise equal to rank 0's; "
                "expected the replicas to diverge, since nothing synchronises their gradients");
          if (comm.rank() == 0)
            verdict.note(
                fmt::format("after one unsynchronised step the replicas differ by up to "
                            "{:.2e} (largest |parameter - rank 0's|)",
                            distance[0]));
        },
        draws);
  }
}

}  // namespace
}  // namespace dp::lab1
