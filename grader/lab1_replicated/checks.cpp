// Lab 1's graded checks: the sampler's shards, the broadcast of the initial weights, and
// training without synchronisation (which must make the replicas diverge). Every check
// draws its configurations from the run's grading seed; rubric.json gives the points and
// the ranges drawn, and labs/lab1_replicated/README.md what each check grades.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "compare.h"
#include "dp/data.h"
#include "dp/error.h"
#include "dp/model.h"
#include "dp/optimizer.h"
#include "grading.h"
#include "lab1.h"

namespace dp::lab1 {
namespace {

using grading::Draws;
using grading::run_on_ranks;
using grading::Verdict;

/// Configurations each sampler check tries.
constexpr int kSamplerConfigurations = 40;

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

/// "" when the first `count` entries of `list` are distinct indices below n (and, without
/// shuffle, 0, 1, 2, ...), else what is wrong.
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
        problem = check_epoch_order(list, total, c);
        if (!problem.empty() || !c.options.shuffle || total == c.n || c.n < 10) return problem;
        // Shuffled, the samples left out must change with the epoch: cutting the tail before
        // shuffling would leave out the same samples every epoch.
        std::set<std::vector<std::size_t>> left_out_sets;
        for (std::uint64_t epoch = c.epoch; epoch < c.epoch + 8; ++epoch) {
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
              c.epoch, c.epoch + 7);
        return "";
      });
}

TEST(Lab1Sampler, ShuffleDependsOnSeedAndEpochOnly) {
  for_drawn_cases(
      "Lab1Sampler.ShuffleDependsOnSeedAndEpochOnly", false,
      [](const SamplerCase& c) -> std::string {
        const auto shards = shards_of(c);
        if (shards_of(c) != shards)
          return "two samplers with equal seed and epoch gave different shards; expected the order "
                 "to depend on (seed, epoch) alone";
        // Two random orders of n >= 10 samples coincide with probability 1/n! < 3e-7: only then
        // may the check insist that they differ.
        if (c.n < 10) return "";
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
        // (seed, epoch) select the order as a pair: seed + epoch would give seed s at epoch
        // e + 1 the order of seed s + 1 at epoch e.
        SamplerCase diagonal = next_epoch;
        diagonal.epoch = c.epoch;
        ++diagonal.options.seed;
        if (shards_of(next_epoch) == shards_of(diagonal))
          return fmt::format(
              "seed {} at epoch {} and seed {} at epoch {} gave the same shards; expected the "
              "pair (seed, epoch) to select the order, not, say, their sum",
              c.options.seed, next_epoch.epoch, diagonal.options.seed, diagonal.epoch);
        SamplerCase unshuffled = c;
        unshuffled.options.shuffle = false;
        if (shards_of(unshuffled) == shards) return "shuffle=true gave the unshuffled order";
        return "";
      },
      /*always_shuffle=*/true);

  // Random, not just different: a family of at most 2n orders (rotations, i * a mod n, ...)
  // must repeat within 2n + 1 epochs; n! random orders (n >= 13) do so with probability
  // below 1e-7 (the birthday bound: (2n + 1)^2 / 2 / n!).
  Draws draws("Lab1Sampler.ShuffleDependsOnSeedAndEpochOnly/random");
  for (int trial = 0; trial < 4; ++trial) {
    SamplerCase c;
    c.n = static_cast<std::size_t>(draws.integer("n", 13, 30));
    c.replicas = static_cast<int>(draws.integer("ranks", 1, 4));
    c.options.shuffle = true;
    c.options.seed = draws.seed("sampler seed");
    std::set<std::vector<std::vector<std::size_t>>> orders;
    for (std::uint64_t epoch = 0; epoch < 2 * c.n + 1; ++epoch) {
      c.epoch = epoch;
      try {
        if (!orders.insert(shards_of(c)).second)
          FAIL() << fmt::format(
              "{}: epoch {} repeats the order of an earlier epoch; expected a random "
              "permutation per epoch (n! of them), which repeats within {} epochs with "
              "probability below 1e-7; a shuffle with few possible orders (a rotation, i * a mod "
              "n) repeats within n\n({})",
              c.describe(), epoch, 2 * c.n + 1, draws.describe());
      } catch (const NotImplemented& error) {
        FAIL() << error.what();
      }
    }
  }
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
  std::int64_t samples = draws.integer("samples", 20, 90);
  // Not a multiple of 2 or 3, so that drop_last and padding change the shards on 2, 3 and
  // 4 ranks.
  while (samples % 2 == 0 || samples % 3 == 0) ++samples;
  c.data = std::make_shared<const Dataset>(
      load_dataset(fmt::format("synthetic:{}", samples), draws.seed("data seed")));
  c.options.local_batch = draws.integer("local batch", 3, 12);
  // On one rank the shard is the whole data set: never a multiple of the batch, so that
  // every run has a last, shorter batch.
  while (c.data->size() % static_cast<std::size_t>(c.options.local_batch) == 0)
    c.options.local_batch += 1;
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
  for (const bool drop_last : {false, true}) {
    ReplicatedCase c = drawn;
    c.options.sampler.drop_last = drop_last;
    for (int world : draws.world_sizes(4)) {
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
          comm.broadcast(std::span<float>(rank0), 0)->wait();
          const auto mine_to_rank0 = static_cast<float>(grading::max_abs_difference(mine, rank0));
          std::vector<float> distance = {mine_to_rank0};
          comm.allreduce(std::span<float>(distance), ReduceOp::kMax)->wait();
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
