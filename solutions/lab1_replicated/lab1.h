// lab1.h: lab 1, replicated training. The contract between your code and the grader.
//
// N ranks each hold a full replica of the model. Before training, every replica must
// start from the same weights (rank 0's, broadcast); during training, each rank reads
// its own shard of the data, which a `DistributedSampler` picks. In this lab the ranks
// never talk while they train, and the grader shows what follows: the replicas drift
// apart after a single step. Lab 2 repairs that.
//
// Read README.md beside this file first. You write the bodies marked in sampler.cpp and
// replicated.cpp; do not change this header (the grader is compiled against it).
//
// Example:
//
//   dp::lab1::DistributedSampler sampler(data.size(), comm.size(), comm.rank(),
//                                        {.shuffle = true, .seed = 7});
//   sampler.set_epoch(3);
//   std::vector<std::size_t> mine = sampler.indices();   // this rank's 3rd-epoch shard
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
  /// Shuffle the indices every epoch (with the same permutation on every rank).
  bool shuffle = true;
  /// Selects the permutations: equal seeds and epochs give equal orders on every rank.
  std::uint64_t seed = 0;
  /// Drop the tail that does not divide evenly instead of padding with repeated indices.
  bool drop_last = false;
};

/// Splits the indices 0..dataset_size-1 among `num_replicas` ranks, as PyTorch's
/// `torch.utils.data.DistributedSampler` does.
///
/// Every shard has the same length `num_samples()`: without drop_last the index list is
/// padded to a multiple of the world size by repeating its first indices; with drop_last
/// it is cut to the largest multiple. Rank r takes positions r, r + N, r + 2N, ... of the
/// (shuffled) list, so the shards are disjoint apart from the padding, and together they
/// cover every index once per epoch. With shuffle, the list is a permutation drawn from
/// (seed, epoch) alone: the same on every rank without any communication, and different
/// from epoch to epoch.
class DistributedSampler {
 public:
  /// A sampler for rank `rank` of `num_replicas`. Throws `dp::Error`, saying what was
  /// expected and seen, unless dataset_size > 0, num_replicas > 0 and
  /// 0 <= rank < num_replicas, and unless drop_last leaves every rank at least one index.
  DistributedSampler(std::size_t dataset_size, int num_replicas, int rank,
                     SamplerOptions options = {});

  /// Selects the epoch whose permutation `indices()` returns (call it at the start of
  /// every epoch, as with PyTorch).
  void set_epoch(std::uint64_t epoch) { epoch_ = epoch; }
  /// The epoch `set_epoch` selected (0 at first).
  std::uint64_t epoch() const { return epoch_; }

  /// The length of every rank's shard: ceil(dataset_size / num_replicas), or
  /// floor(dataset_size / num_replicas) with drop_last.
  std::size_t num_samples() const;
  /// num_samples() * num_replicas: the length of the padded (or cut) index list.
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

/// Makes every rank's parameters equal to rank 0's: one broadcast from rank 0 per
/// parameter, frozen parameters included, as PyTorch's DDP does when it is constructed.
void broadcast_initial_weights(Model& model, Communicator& comm);

/// How `train_replicated` walks the data.
struct ReplicatedOptions {
  /// Samples per step on this rank.
  std::int64_t local_batch = 16;
  /// Passes over the data set.
  int epochs = 1;
  /// Stop after this many optimizer steps in all (-1: run every epoch to the end).
  int max_steps = -1;
  /// The sampler's settings (the same on every rank).
  SamplerOptions sampler{};
};

/// Trains `model` on this rank's shard, with no communication at all: for each epoch e,
/// a `DistributedSampler` for (data.size(), comm.size(), comm.rank(), options.sampler)
/// set to epoch e gives the shard, which is walked in batches of `local_batch` indices in
/// order (the last batch of an epoch may be shorter). Each batch is one step: zero the
/// gradients, forward, backward (mean loss over the batch), `optimizer.step(model)`.
/// Returns the loss of every step, in order.
std::vector<float> train_replicated(Model& model, Optimizer& optimizer, const Dataset& data,
                                    Communicator& comm, const ReplicatedOptions& options);

}  // namespace dp::lab1
