// sampler.cpp: lab 1's DistributedSampler. Your part: num_samples() and indices().
#include <fmt/format.h>

#include <utility>

#include "dp/error.h"
#include "dp/rng.h"
#include "lab1.h"

namespace dp::lab1 {

DistributedSampler::DistributedSampler(std::size_t dataset_size, int num_replicas, int rank,
                                       SamplerOptions options)
    : dataset_size_(dataset_size), num_replicas_(num_replicas), rank_(rank), options_(options) {
  if (dataset_size == 0)
    throw Error("DistributedSampler: the data set is empty; expected at least one sample");
  if (num_replicas <= 0)
    throw Error(
        fmt::format("DistributedSampler: num_replicas must be positive, got {}", num_replicas));
  if (rank < 0 || rank >= num_replicas)
    throw Error(
        fmt::format("DistributedSampler: rank must lie in [0, {}), got {}", num_replicas, rank));
  if (options.drop_last && dataset_size < static_cast<std::size_t>(num_replicas))
    throw Error(fmt::format(
        "DistributedSampler: with drop_last, {} samples leave nothing for {} ranks; expected at "
        "least one sample per rank",
        dataset_size, num_replicas));
}

std::size_t DistributedSampler::num_samples() const {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab1::DistributedSampler::num_samples");
  const auto replicas = static_cast<std::size_t>(num_replicas_);
  if (options_.drop_last) return dataset_size_ / replicas;  // cut the tail
  return (dataset_size_ + replicas - 1) / replicas;         // pad up to a multiple
  // END SOLUTION
}

std::vector<std::size_t> DistributedSampler::indices() const {
  // BEGIN SOLUTION
  // SKELETON: throw NotImplemented("lab1::DistributedSampler::indices");
  // The whole list, identical on every rank: 0..n-1, shuffled by (seed, epoch) alone.
  std::vector<std::size_t> order(dataset_size_);
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  if (options_.shuffle) {
    CounterRng rng(options_.seed, epoch_);
    for (std::size_t i = dataset_size_ - 1; i > 0; --i)
      std::swap(order[i], order[rng.below(i + 1)]);
  }

  // Pad by repeating the list from its start (as often as needed when there are more
  // ranks than samples), or cut the tail: every rank then gets num_samples() indices.
  const std::size_t total = total_size();
  for (std::size_t i = 0; order.size() < total; ++i) order.push_back(order[i]);
  order.resize(total);

  // Rank r takes positions r, r + N, r + 2N, ...
  std::vector<std::size_t> mine;
  mine.reserve(num_samples());
  for (std::size_t i = static_cast<std::size_t>(rank_); i < total;
       i += static_cast<std::size_t>(num_replicas_))
    mine.push_back(order[i]);
  return mine;
  // END SOLUTION
}

}  // namespace dp::lab1
