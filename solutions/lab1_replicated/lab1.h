// lab1.h: lab 1, replicated training. The contract between your code and the grader:
// the interfaces you implement, the invariants they must keep, and how each is checked.
//
// N ranks each hold a full replica of the model. Every replica must start from the same
// weights, each rank must train on its own part of the data, and in this lab the ranks
// never exchange gradients, so the grader can show you what follows. README.md beside
// this file poses the problem; its Hints section, at the end, helps if you are stuck. Do
// not change this header: the grader is compiled against it.
//
// Example:
//
//   dp::lab1::DistributedSampler sampler(data.size(), comm.size(), comm.rank(),
//                                        {.shuffle = true, .seed = 7});
//   sampler.set_epoch(3);
//   std::vector<std::size_t> mine = sampler.indices();   // this rank's shard of epoch 3
//
//   dp::lab1::broadcast_initial_weights(model, comm);    // every replica = rank 0's
//   std::vector<float> losses = dp::lab1::train_replicated(model, optimizer, data, comm, {});
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "dp/comm.h"
#include "dp/data.h"
#include "dp/model.h"
#include "dp/optimizer.h"

namespace dp::lab1 {

/// How a `DistributedSampler` orders and cuts the data set (PyTorch's defaults).
struct SamplerOptions {
  /// Visit the samples in a new random order every epoch (the same order on every rank).
  bool shuffle = true;
  /// Selects the random orders: equal (seed, epoch) give equal orders.
  std::uint64_t seed = 0;
  /// Leave out the samples that would make the shards unequal instead of repeating some.
  bool drop_last = false;
};

/// Gives each of `num_replicas` ranks its shard of the indices 0..n-1 of a data set of n
/// samples, for one epoch at a time, without any communication. It pads, drops and
/// interleaves as PyTorch's `DistributedSampler` does, but its order depends on the pair
/// (seed, epoch), where PyTorch seeds with seed + epoch (seed s at epoch e + 1 would repeat
/// seed s + 1 at epoch e, which the grader fails, as it fails other mixes of the two into
/// one number).
///
/// Invariants (N = num_replicas; each is checked for drawn n, N, seeds and epochs, n < N
/// included):
///   * Every rank's shard has the same length, `num_samples()`: ceil(n / N), or with
///     drop_last floor(n / N). Equal lengths keep the ranks in step, one batch each.
///   * Interleave the shards, L[r + N i] = shard r's i-th index, into one list L of
///     `total_size()` entries. Its first min(n, total_size()) entries are distinct indices,
///     in the epoch's order: without shuffle 0, 1, 2, ...; with shuffle a uniform random
///     permutation of 0..n-1 (each of the n! orders equally likely) that depends on
///     (seed, epoch) only, the same for every N and with or without drop_last, so every
///     rank computes the same one alone (the checks compare L with the indices of one
///     rank's sampler without drop_last).
///   * Without drop_last, L continues by repeating itself from its start:
///     L[n + j] = L[j mod n]. With drop_last, L is the head of the epoch's order and its
///     last n - total_size() entries are left out, so with shuffle the samples left out
///     change from epoch to epoch.
///   * Seed and epoch select the order as a pair, not as one number mixed from both: no two
///     of the 64 x 64 pairs (seed + i, epoch + j) give one order, nor (seed + k, epoch) and
///     (seed, epoch + k), nor the pairs that seed * C + epoch or seed + C * epoch fold
///     together, for C of 100 to 2^32 (checked for n >= 20, where two random orders
///     coincide with probability below 4.2e-19). For 2 <= n < 20, 64 epochs may not all give
///     one order, or all the unshuffled one, nor 64 seeds one order (by chance below 2^-63).
///   * Uniform, not merely different: over 16,000 orders of 40 seeds and 200 epochs, for
///     one data set of 20 to 200 samples on 1 to 8 ranks and one on 2 to 8, none repeats,
///     and fixed points, 2-cycles, runs v, v+1 and v, v-1 and cycles longer than n/2 are as
///     frequent as in uniform random permutations. A rotation, a reversal, a few random
///     swaps, a riffle or Fisher-Yates with below(i) instead of below(i + 1) fails; a
///     correct shuffle fails by chance with probability below 6.3e-10 (rubric.json).
class DistributedSampler {
 public:
  /// A sampler for rank `rank` of `num_replicas`. Throws `dp::Error`, saying what was
  /// expected and seen, unless dataset_size > 0, num_replicas > 0 and
  /// 0 <= rank < num_replicas, and unless drop_last leaves every rank at least one index.
  DistributedSampler(std::size_t dataset_size, int num_replicas, int rank,
                     SamplerOptions options = {});

  /// Selects the epoch whose shard `indices()` returns (call it at the start of every
  /// epoch, as with PyTorch).
  void set_epoch(std::uint64_t epoch) { epoch_ = epoch; }
  /// The epoch `set_epoch` selected (0 at first).
  std::uint64_t epoch() const { return epoch_; }

  /// The length of every rank's shard (see the invariants).
  std::size_t num_samples() const;
  /// num_samples() * num_replicas: the length of the interleaved list L.
  std::size_t total_size() const { return num_samples() * static_cast<std::size_t>(num_replicas_); }
  /// This rank's indices for the current epoch, `num_samples()` of them, in the order to
  /// visit them.
  std::vector<std::size_t> indices() const;

  /// The size of the data set being split.
  std::size_t dataset_size() const { return dataset_size_; }
  /// The number of ranks sharing it.
  int num_replicas() const { return num_replicas_; }
  /// This rank.
  int rank() const { return rank_; }
  /// The options given at construction.
  const SamplerOptions& options() const { return options_; }

 private:
  std::size_t dataset_size_;
  int num_replicas_;
  int rank_;
  SamplerOptions options_;
  std::uint64_t epoch_ = 0;
};

/// Makes every rank's model equal to rank 0's, as PyTorch's DDP does when it is built.
///
/// Invariants (checked for drawn world sizes and models, with a frozen parameter): after
/// the call every parameter of every rank, frozen ones included, is bitwise rank 0's;
/// rank 0's are unchanged; every rank but 0 receives each parameter's bytes exactly once
/// (`comm.counters()`), whatever the number of calls.
void broadcast_initial_weights(Model& model, Communicator& comm);

/// How `train_replicated` walks the data.
struct ReplicatedOptions {
  /// Samples per step on this rank.
  std::int64_t local_batch = 16;
  /// Passes over the data set.
  int epochs = 1;
  /// Stop after this many optimizer steps in all, counted over every epoch (-1: run every
  /// epoch to its end).
  int max_steps = -1;
  /// The sampler's settings (the same on every rank).
  SamplerOptions sampler{};
};

/// Trains `model` on this rank's data alone, with no communication at all.
///
/// Epoch e visits this rank's shard of epoch e (a `DistributedSampler` over (data.size(),
/// comm.size(), comm.rank(), options.sampler)) in order, in batches of `local_batch`
/// indices; the last batch of an epoch may be shorter. Each batch is one optimizer step on
/// the batch's mean loss, from zeroed gradients. Returns the mean loss of every step, as
/// `Model::backward` returns it, in order.
///
/// Invariants (checked for drawn data sets, batch sizes, epochs and max_steps): the model
/// and the returned losses are bitwise those of the same steps run in one process on this
/// rank's batches; the number of steps is what the epochs and max_steps give; no call
/// reaches the communicator.
std::vector<float> train_replicated(Model& model, Optimizer& optimizer, const Dataset& data,
                                    Communicator& comm, const ReplicatedOptions& options);

}  // namespace dp::lab1
