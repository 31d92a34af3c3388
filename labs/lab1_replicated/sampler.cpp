// Lab skeleton, generated from the reference by tools/make-skeletons: your code goes where
// dp::NotImplemented is thrown.
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
  throw NotImplemented("lab1::DistributedSampler::num_samples");
}

std::vector<std::size_t> DistributedSampler::indices() const {
  throw NotImplemented("lab1::DistributedSampler::indices");
}

}  // namespace dp::lab1
